"""Overlap across requests (issue 31, item 2): does splitting a batch into two halves, so the draft
daemon drafts one half while the target verifies the other, beat drafting the whole batch and
then verifying it in one forward?

Both schedules run here on the same target, the same draft daemon and the same prompts, in turns
with a third, *plain* (the same batch decoded with no drafts), for scale:

- *together* (what the target daemon does): every request sends its propose, the target waits
  for all of them (the daemon drafts them in one pass), then verifies all in one forward;
- *halves*: the requests are two groups; a group's proposes go out as soon as its forward is
  taken, so the daemon drafts them while the target runs the other group's forward.

Halves buy the hidden drafting at the price of two forwards where there was one: each streams the
weights once, so they pay only where a forward's cost grows with its rows more than drafting
costs a step. Every request drafts every step (chain), from its own session over its own socket,
as the target daemon's slots do; prompts are prefilled together first and not timed. Every
output is checked against plain greedy decoding.

    dflash-draft-daemon --checkpoint drafters/smollm2 --threads 1 --bind tcp://127.0.0.1:5611 &
    python -m benchmarks.bench_overlap --drafter-address tcp://127.0.0.1:5611 --batches 1,2,4,8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from launch.common import TARGET_DTYPES, resolve_model
from launch.net import HelpFormatter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import Sequence, generate, step
from target_node.drafting.proposers import DFlashProposer, NoProposer
from target_node.drafting.remote import RemoteDraftBackend
from target_node.engine.engine import batch_engine
from target_node.model.target import TargetModel, inexact
from training.prompts import EVAL_PROMPTS, read_prompts

SCHEDULES = ("together", "halves")  # each measured against "plain": the same batch decoded with no drafts


def start(target: TargetModel, prompts: list[list[int]], proposers: list, max_new: int) -> list[Sequence]:
    """Sequences in slots 0.., prefilled together (untimed) up to their first token."""
    options = DecodeOptions(max_new, adaptive=False, tree_nodes=0)
    sequences = [
        Sequence(target, ids, proposer, options, slot=slot)
        for slot, (ids, proposer) in enumerate(zip(prompts, proposers, strict=True))
    ]
    while any(seq.prefilling for seq in sequences):
        step(target, [seq for seq in sequences if seq.prefilling])
    return sequences


def decode(target: TargetModel, sequences: list[Sequence], schedule: str) -> float:
    """Seconds to decode every sequence to its end under `schedule`."""
    began = time.perf_counter()
    if schedule in ("together", "plain"):
        while running := [seq for seq in sequences if not seq.done]:
            step(target, running)
        return time.perf_counter() - began
    groups = [sequences[0::2], sequences[1::2]]
    for group in groups:
        for seq in group:
            seq.prepare(len(group))
    while any(not seq.done for seq in sequences):
        for group in groups:
            running = [seq for seq in group if not seq.done]
            if not running:
                continue
            step(target, running, prepared=True)
            for seq in running:
                if not seq.done:  # its next drafts are drafted while the other group's forward runs
                    seq.prepare(len(running))
    return time.perf_counter() - began


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_overlap",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--drafter-address", required=True, help="a running draft daemon")
    ap.add_argument("--model", default=None, help="local HF folder of the target (default: SmolLM2)")
    ap.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda, cuda:1, ...)")
    ap.add_argument(
        "--dtype", default="auto", choices=TARGET_DTYPES, help="the target's dtype (auto: as the daemon picks)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own choice) (default 1)")
    ap.add_argument("--batches", default="1,2,4,8", help="comma-separated numbers of requests decoded at once")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="jsonl of {'prompt': ...}")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer at most")
    ap.add_argument("--rounds", type=int, default=2, help="turns of both schedules at each batch size")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    engine = batch_engine(args.device)
    target = TargetModel.load(resolve_model(args.model), args.device, args.dtype, engine=engine, slots=max(batches))
    if not target.exact:  # a target off the engine in fp16 or bf16: its drafts measured nothing (an audit)
        raise SystemExit(inexact(target))
    texts = read_prompts(Path(args.prompts))
    proposers = []
    for _ in range(max(batches)):
        backend = RemoteDraftBackend(args.drafter_address, target)
        if backend.info is None:
            raise SystemExit(f"no draft daemon answered at {args.drafter_address}")
        proposers.append(DFlashProposer(backend))
    rows, mismatches = [], 0
    for batch in batches:
        chosen = [texts[i % len(texts)] for i in range(batch)]
        prompts = [target.encode_chat([{"role": "user", "content": text}]) for text in chosen]
        plain = [generate(target, ids, NoProposer(), DecodeOptions(args.max_new_tokens)).tokens for ids in prompts]
        schedules = ("plain", *SCHEDULES)
        seconds = {schedule: 0.0 for schedule in schedules}
        tokens = {schedule: 0 for schedule in schedules}
        for _ in range(args.rounds):
            for schedule in schedules:
                drafting = proposers[:batch] if schedule != "plain" else [NoProposer() for _ in range(batch)]
                sequences = start(target, prompts, drafting, args.max_new_tokens)
                first = sum(len(seq.output.tokens) for seq in sequences)
                seconds[schedule] += decode(target, sequences, schedule)
                tokens[schedule] += sum(len(seq.output.tokens) for seq in sequences) - first
                mismatches += sum(seq.result().tokens != want for seq, want in zip(sequences, plain, strict=True))
        rate = {schedule: tokens[schedule] / seconds[schedule] for schedule in schedules}
        rows.append(
            {"batch": batch}
            | {f"{schedule}_tok_s": round(rate[schedule], 2) for schedule in schedules}
            | {"halves_vs_together": round(rate["halves"] / rate["together"], 3)}
            | {"halves_vs_plain": round(rate["halves"] / rate["plain"], 3)}
        )
        print(rows[-1], flush=True)
    result = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "rows": rows, "mismatches": mismatches}
    print(f"\n{'batch':>5} {'plain tok/s':>12} {'together':>9} {'halves':>7} {'halves / together':>18} {'/ plain':>8}")
    for row in rows:
        print(
            f"{row['batch']:>5} {row['plain_tok_s']:>12} {row['together_tok_s']:>9} {row['halves_tok_s']:>7} "
            f"{row['halves_vs_together']:>17}x {row['halves_vs_plain']:>7}x"
        )
    print(f"outputs that differ from plain greedy: {mismatches}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
