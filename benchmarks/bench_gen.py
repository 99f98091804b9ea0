"""How fast the training-data generator decodes, by batch size and thread count.

Answers the store's own prompts (those of stored answers, shuffled the same way every
run) with `training.generate.RefillGenerator` (the target's engine), features captured as in `--stage gen`, for
`--seconds` per setting, and counts every token the target produced, rows still in flight
included, so a short window measures the steady rate rather than who finished first.

    python -m benchmarks.bench_gen --batch 32,64,128 --threads 1,2 --seconds 120
    python -m benchmarks.bench_gen --dtypes float32,bfloat16 --rounds 2 --seconds 90   # in turns
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from answers.store import STORE, AnswerStore
from draft_node.checkpoint import config_for_target
from launch.common import resolve_model
from launch.net import HelpFormatter
from protocol import FLOAT_DTYPES
from protocol.tensors import torch_dtype
from target_node.model.target import TargetModel
from training.generate import RefillGenerator


def measure(target: TargetModel, prompts: list[list[int]], batch: int, seconds: float, taps: tuple[int, ...]) -> dict:
    generator = RefillGenerator(target, batch, max_new=192, layer_ids=taps)
    queue = iter(enumerate(prompts))
    began = time.perf_counter()
    answered = generator.run(lambda: next(queue, None), lambda *done: None, deadline=time.monotonic() + seconds)
    elapsed = time.perf_counter() - began
    return {"batch": batch, "tok_s": round(generator.produced / elapsed, 1), "answered": answered, "s": round(elapsed)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gen", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument(
        "--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct, converted once into the cache)"
    )
    ap.add_argument("--store", default=str(STORE), help="answer store whose prompts are answered again")
    ap.add_argument("--batch", default="64", help="comma-separated batch sizes")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    ap.add_argument("--seconds", type=float, default=120.0, help="decoding time per setting")
    ap.add_argument("--dtypes", default="float32", help=f"comma-separated target dtypes, of {', '.join(FLOAT_DTYPES)}")
    ap.add_argument("--rounds", type=int, default=1, help="run every setting this many times, in turns")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    names = args.dtypes.split(",")
    if unknown := [n for n in names if n not in FLOAT_DTYPES]:
        raise SystemExit(f"--dtypes: {', '.join(unknown)} not among {', '.join(FLOAT_DTYPES)}")
    model = resolve_model(args.model)
    slots = max(int(b) for b in args.batch.split(","))
    targets = {name: TargetModel.load(model, "cpu", torch_dtype(name), slots=slots) for name in names}
    taps = config_for_target(next(iter(targets.values())).config, num_layers=1).target_layer_ids  # the default taps
    prompts = [a.tokens[: a.prompt_len] for a in AnswerStore(args.store).answers]
    random.Random(0).shuffle(prompts)  # the store's mix of short and long prompts from the start
    if not prompts:
        raise SystemExit(f"no stored answers in {args.store} to take prompts from")
    rows = []
    for _ in range(args.rounds):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for batch in (int(b) for b in args.batch.split(",")):
                for name, target in targets.items():
                    row = {"dtype": name, "threads": threads, **measure(target, prompts, batch, args.seconds, taps)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
