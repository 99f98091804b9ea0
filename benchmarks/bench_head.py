"""The int8-screened greedy head against the whole head: every mode of `benchmarks.evaluate`, prompt by
prompt in turns, one process, so load drifts over both alike.

    python -m benchmarks.bench_head --threads 1 --dtype bfloat16 --modes adaptive
    python -m benchmarks.bench_head --threads 1 --dtype float32 --limit 20

Each side has its own runs (governors and their verify costs measured with its own head); both must
give the plain greedy output token for token. Where the CPU has no AVX512-VNNI the engine has no
screen and the two sides are the same code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.evaluate import mode_table, parse_args, prepare_runs, run_prompt
from launch.common import resolve_model


def bench(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench_head", description=__doc__)
    ap.add_argument("--out", default="", help="where to write the JSON (default: print only)")
    own, rest = ap.parse_known_args(argv)
    args = parse_args(["--drafter", "drafters/smollm2", "--modes", "adaptive", "--max-new-tokens", "96", *rest])
    from target_node.model.target import TargetModel
    from training.prompts import read_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetModel.load(resolve_model(args.model), device=args.device, dtype=args.dtype)
    engine = target.engine
    measured = engine.screen_rows if engine is not None else 0
    runs = {}
    for side, rows in (("screened", measured), ("whole", 0)):
        if engine is not None:
            engine.screen_rows = rows
        runs[side] = (rows, prepare_runs(args, target))
    prompts = read_prompts(args.prompts)[: args.limit or None]
    for i, text in enumerate(prompts):
        for side in list(runs)[:: 1 if i % 2 == 0 else -1]:
            rows, side_runs = runs[side]
            if engine is not None:
                engine.screen_rows = rows
            run_prompt(side_runs, text)
    if engine is not None:
        engine.screen_rows = measured
    tables = {side: mode_table(side_runs) for side, (_, side_runs) in runs.items()}
    result = {
        "dtype": str(target.head.weight.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "screen_rows": measured,
        "modes": tables,
        "screened_vs_whole": {
            mode: round(tables["screened"][mode]["tok_s"] / tables["whole"][mode]["tok_s"], 3)
            for mode in tables["whole"]
            if tables["whole"][mode]["tok_s"]
        },
        "mismatches": sum(t[m]["mismatches"] for t in tables.values() for m in t),
    }
    if own.out:
        Path(own.out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    result = bench(argv)
    print(f"screen serves 1-{result['screen_rows']} rows; {result['dtype']}, {result['threads']} threads")
    for mode, ratio in result["screened_vs_whole"].items():
        whole, screened = result["modes"]["whole"][mode]["tok_s"], result["modes"]["screened"][mode]["tok_s"]
        print(f"{mode:>12}: {whole:7.2f} -> {screened:7.2f} tok/s ({ratio:.3f}x)")
    print(f"outputs differing from plain: {result['mismatches']}")
    return 0 if result["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
