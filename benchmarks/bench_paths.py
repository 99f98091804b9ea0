"""What AMX tiles buy: the target's step by width on each bf16 matmul path, in turns in one process.

    python -m benchmarks.bench_paths --json docs/results/bench_amx.json

A process serves on one path only (`dflash_kernels.bf16_matmul`, measured once per machine); here
both run the same steps, the paths taking turns so a burst of load hits both alike, measured as
the governor's cost table measures them (`VerifyCosts.measure`: after a 128-token context).
Prints the best time per width and each as a multiple of AVX-512's step at the narrowest width
(one row by default).
"""

from __future__ import annotations

import argparse
import json

import torch

import dflash_kernels
from launch.net import HelpFormatter
from target_node.decoding.governor import VerifyCosts
from target_node.model.default_model import DEFAULT_MODEL_DIR
from target_node.model.target import TargetModel


def step_seconds(target: TargetModel, widths: list[int], rounds: int, paths: list[str]) -> dict[str, dict[int, float]]:
    """Per path and width, the best over `rounds` of the governor's own cost measurement (the
    median of 3 steps), the paths in turns."""
    best = {path: dict.fromkeys(widths, float("inf")) for path in paths}
    for _ in range(rounds):
        for path in paths:
            torch.ops.dflash.linear_path(dflash_kernels.BF16_PATHS[path])
            costs = VerifyCosts()
            costs.measure(target, widths)
            for width in widths:
                best[path][width] = min(best[path][width], costs.seconds[width])
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_paths",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local HF folder of the target")
    ap.add_argument(
        "--widths", default="1,2,3,5,9,13,17", help="comma-separated rows per step (a verify of 1 + drafts)"
    )
    ap.add_argument("--rounds", type=int, default=6, help="turns of both paths at each width (the best is shown)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.model, dtype="bfloat16")
    if target.engine is None:
        raise SystemExit("the engine does not serve this model here: nothing to compare")
    chosen = torch.ops.dflash.linear_path(-1)
    paths = [p for p, n in dflash_kernels.BF16_PATHS.items() if torch.ops.dflash.linear_path(n) == n]
    widths = [int(w) for w in args.widths.split(",")]
    best = step_seconds(target, widths, args.rounds, paths)
    torch.ops.dflash.linear_path(chosen)
    base = best["avx512"][min(widths)]
    print(f"step ms by width (bf16, {args.threads} thread(s)); in parentheses: x AVX-512's step of {min(widths)} rows")
    for path in paths:
        print(f"{path:7s}", "  ".join(f"{w}: {1e3 * s:.2f} ({s / base:.2f})" for w, s in best[path].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "ms": {p: {w: 1e3 * s for w, s in b.items()} for p, b in best.items()}},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
