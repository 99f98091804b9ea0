"""What rolling back costs, per target family and cache policy, next to a plain decode step.

For each tiny family (target_node/model/tiny.py) and each rollback its cache allows, after a
context longer than any sliding window: a plain step (one token forward), a verify forward
of `--width` tokens, and the rollback after it keeping 1, half or all of them (0, half or
every draft accepted). Tokens are forced, not decided, so every policy does the same work.
The step columns are (verify + rollback) / plain step: what a step costs in plain steps.

    python -m benchmarks.bench_rollback --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from launch.net import HelpFormatter
from target_node.model.policies import RECURRENT_POLICIES
from target_node.model.target import TargetModel
from target_node.model.tiny import FAMILIES, tiny_target


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1000


def measure(target: TargetModel, context: int, width: int, steps: int, seed: int = 0) -> dict:
    """Median milliseconds of a plain step, a verify forward and its rollbacks (see module doc)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3, target.vocab_size - 3) for _ in range(context + steps * (1 + 3 * width) + width)]
    target.reset()
    target.forward(tokens[:context])
    n = context
    plain = []
    for _ in range(steps):
        plain.append(_timed(lambda n=n: target.forward([tokens[n]])) + _timed(lambda n=n: target.rollback(n + 1)))
        n += 1
    row = {"plain_ms": statistics.median(plain)}
    verify, kept = [], {}
    for accepted in (0, width // 2 - 1, width - 1):
        times = []
        for _ in range(steps):
            verify.append(_timed(lambda n=n: target.forward(tokens[n : n + width])))
            times.append(_timed(lambda n=n, a=accepted: target.rollback(n + a + 1)))
            n += accepted + 1
        kept[accepted] = statistics.median(times)
    row["verify_ms"] = statistics.median(verify)
    for accepted, label in zip(kept, ("none", "half", "all"), strict=True):
        row[f"rollback_{label}_ms"] = kept[accepted]
        row[f"step_{label}_vs_plain"] = (row["verify_ms"] + kept[accepted]) / row["plain_ms"]
    target.reset()
    return row


def run(families: list[str], context: int, width: int, steps: int, repeats: int) -> list[dict]:
    """One row per family and policy; each number the median of `repeats` measurements, taken in
    turn across the family's policies so a busy machine's slow spells fall on all of them."""
    rows = []
    for family in families:
        probe = tiny_target(family)
        recurrent = any(part in probe.policy.name for part in RECURRENT_POLICIES)
        targets = [probe] if not recurrent else [tiny_target(family, cache_policy=p) for p in RECURRENT_POLICIES]
        for target in targets:
            measure(target, context, width, 2)  # warm-up
        runs = [[measure(target, context, width, steps) for target in targets] for _ in range(repeats)]
        for i, target in enumerate(targets):
            row = {key: statistics.median(run[i][key] for run in runs) for key in runs[0][i]}
            rows.append({"family": family, "policy": target.policy.name, **row})
            print(_line(rows[-1]), flush=True)
    return rows


COLUMNS = [
    "family",
    "policy",
    "plain_ms",
    "verify_ms",
    "rollback_none_ms",
    "rollback_half_ms",
    "rollback_all_ms",
    "step_none_vs_plain",
    "step_half_vs_plain",
    "step_all_vs_plain",
]


def _line(row: dict) -> str:
    return "  ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_rollback",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES), help="tiny random targets to time"
    )
    parser.add_argument("--context", type=int, default=64, help="tokens before the measured steps")
    parser.add_argument("--width", type=int, default=8, help="tokens per verify (1 + drafts)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per row (the median is shown)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("  ".join(COLUMNS))
    rows = run(args.families, args.context, args.width, args.steps, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
