"""How the datastore's branch grows with the answer store: its chain tau alone, offline, on the
target's answers to the held-out prompts, for random parts of the store.

    python -m benchmarks.datastore_size                      # 1/16 .. all of data/answers, bf16
    python -m benchmarks.datastore_size --json docs/results/datastore_size.json

The datastore (`target_node.drafting.datastore`) looks up what the target wrote after the
context's last words in its earlier answers; the committed answer store is what it indexes. If its
reach grows with the store, generating answers in the background makes the default mode faster
with no training at all; this says by how much a doubling moves it. The held-out prompts' answers
are generated once and kept under the cache (as `launch.train --stage estimate` keeps them).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from fractions import Fraction
from pathlib import Path

from launch.common import FLOAT_DTYPES, resolve_model
from launch.net import HelpFormatter, one_line_errors

FRACTIONS = "1/16,1/8,1/4,1/2,1"


def measure(args: argparse.Namespace) -> dict:
    import torch

    from answers.store import AnswerStore
    from protocol.tensors import torch_dtype
    from target_node import CACHE_ROOT
    from target_node.drafting.datastore import Datastore
    from target_node.model.target import TargetModel
    from training.estimate import lookup_tau
    from training.stages import prompts_answers

    torch.set_num_threads(args.threads)
    fractions = [Fraction(f) for f in args.fractions.split(",")]
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"--fractions {args.fractions}: each must be in (0, 1]")
    model = str(resolve_model(args.model))
    target = TargetModel.load(model, device="cpu", dtype=torch_dtype(args.dtype), slots=64)
    held_out, _ = prompts_answers(target, model, args.prompts, args.tokens, CACHE_ROOT, print)
    name = held_out.answers[0].model
    stored = [a for a in AnswerStore(args.store).answers if a.model == name]
    if not stored:
        raise ValueError(f"{args.store} holds no answers of {name}")
    random.Random(args.seed).shuffle(stored)
    rows = []
    for fraction in sorted(fractions):
        part = stored[: max(1, int(len(stored) * fraction))]
        began = time.perf_counter()
        datastore = Datastore.build(a.tokens[a.prompt_len :] for a in part)
        built = time.perf_counter() - began
        result = lookup_tau(datastore, held_out.answers, args.block)
        rows.append(
            {
                "fraction": str(fraction),
                "answers": len(part),
                "answer_tokens": sum(a.answer_tokens for a in part),
                "tau": round(result["tau"], 4),
                "first_accepted": round(result["first_accepted"], 4),
                "steps": result["steps"],
                "build_s": round(built, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {"model": name, "store": str(args.store), "held_out_answers": len(held_out.answers), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    from answers.store import STORE
    from training.prompts import EVAL_PROMPTS

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.datastore_size", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--model", default=None, help="target model folder (default: the default model)")
    ap.add_argument("--dtype", choices=FLOAT_DTYPES, default="bfloat16", help="the target's dtype for the answers")
    ap.add_argument("--store", type=Path, default=STORE, help="answer store whose parts are indexed")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="held-out prompts (jsonl)")
    ap.add_argument("--tokens", type=int, default=160, help="answer length of the held-out prompts")
    ap.add_argument("--fractions", default=FRACTIONS, help="parts of the store, each a random draw of its answers")
    ap.add_argument("--block", type=int, default=8, help="block size: a step checks up to block - 1 looked-up tokens")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (for the held-out answers' generation)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    with one_line_errors(ap.prog, ValueError):
        result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
