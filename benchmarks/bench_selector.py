"""What a DFlash2 selector costs the target per step: a step's guesses with and without it, in turns.

A DFlash step's guesses on the target are the draft head's projection and its argmaxes; a
DFlash2 step adds the candidates, the lattice, the walk and the re-ranking. Both run here on
the same drafter rows in one process, alternating, so machine noise falls on both alike.

    python -m benchmarks.bench_selector --drafter DFLASH2_DIR --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draft_node.checkpoint import load_drafter
from launch.common import TARGET_DTYPES, resolve_model
from launch.net import HelpFormatter
from target_node.drafting.bridge import DrafterBridge
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.model.target import TargetModel, inexact


def per_call_ms(fn, calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_selector", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--drafter", required=True, help="a DFlash2 drafter checkpoint folder")
    ap.add_argument(
        "--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct, converted once into the cache)"
    )
    ap.add_argument(
        "--dtype", default="auto", choices=TARGET_DTYPES, help="the target's dtype (auto: as the daemon picks)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--rounds", type=int, default=10, help="turns of each")
    ap.add_argument("--calls", type=int, default=200, help="calls per turn")
    args = ap.parse_args(argv)
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.model, "cpu", args.dtype)
    if not target.exact:  # a target off the engine in fp16 or bf16: its drafts measured nothing (an audit)
        raise SystemExit(inexact(target))
    drafter = load_drafter(args.drafter)
    if not drafter.config.dflash2:
        raise SystemExit(f"{args.drafter} is not a DFlash2 drafter")
    backend = LocalDraftBackend(drafter)
    drafting = DrafterBridge(target, backend.info, backend.codebooks)
    cfg = drafter.config
    rows = torch.randn(cfg.block_size - 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    gate = drafter.gate(rows).float()
    plain = selected = 0.0
    for _ in range(args.rounds):
        plain += per_call_ms(lambda: drafting.guesses(rows, None, 5), args.calls)
        selected += per_call_ms(lambda: drafting.guesses(rows, gate, 5), args.calls)
    result = {
        "dtype": str(target.model.dtype),
        "threads": args.threads,
        "dflash_ms": round(plain / args.rounds, 3),
        "dflash2_ms": round(selected / args.rounds, 3),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
