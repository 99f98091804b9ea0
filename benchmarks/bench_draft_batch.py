"""What drafting a burst of proposes in one pass saves the draft daemon, in turns in one process.

A batching target sends one propose per drafting slot before it waits for any reply. The draft
daemon answers the proposes that arrived together in one pass (`DraftService.handle_all`); before,
it answered them one by one (`handle`, which a lone propose still takes). Both run here on the
same encoded messages, decode and encode included, alternating round by round so machine noise
falls on both alike; the replies of the two are checked equal, bit for bit.

    python -m benchmarks.bench_draft_batch --sessions 1,2,4,8,16 --threads 1

`--steps-of N` adds whole target steps: N requests of the target model decoding side by side,
drafting every step with the in-process drafter, its slots sharing one pass against a pass
each, in turns (draft and verify together: what a batching target daemon's step costs).

`--resend N` adds the burst a restarted draft daemon meets: N sessions each resending a whole
ring (`--resend-rows`, 4,096) in one burst, drafted one by one, in passes of at most
`--max-pass-rows`, and in one pass; each way in a fresh process, for its peak memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from draft_node.checkpoint import load_drafter
from draft_node.daemon import DraftService
from draft_node.model import DFlashDrafter
from draft_node.settings import DraftSettings
from launch.common import DTYPE_CHOICES, named_dtype
from launch.net import HelpFormatter
from protocol import Message, decode, encode
from target_node.model.default_model import ensure_default_drafter


def _message(type_: str, request_id: int, fields: dict, tensors: dict, peer: str) -> Message:
    msg = decode(encode(type_, request_id, fields, tensors))
    msg.peer = peer
    return msg


class Burst:
    """`sessions` open sessions with `context` rows each, and a propose per session per step:
    `new` fresh feature rows (what a step with a few accepted drafts commits), then the block."""

    def __init__(self, service: DraftService, sessions: int, context: int, new: int, seed: int = 0) -> None:
        cfg = service.config
        self.service, self.new, self.g = service, new, torch.Generator().manual_seed(seed)
        self.width, self.hidden = cfg.feature_width, cfg.hidden_size
        self.length = [context] * sessions
        for i in range(sessions):
            peer = f"slot-{i}"  # a target's slots each speak over their own socket
            service.handle(
                _message("open", 0, {"session": "s"}, {"mask": torch.randn(1, self.hidden, generator=self.g)}, peer)
            )
            features = torch.randn(context, self.width, generator=self.g)
            noise = torch.randn(1, self.hidden, generator=self.g)
            fields = {"session": "s", "start": 0, "position": context}
            service.handle(_message("propose", 0, fields, {"features": features, "noise": noise}, peer))

    def step(self) -> list[Message]:
        burst = []
        for i, start in enumerate(self.length):
            features = torch.randn(self.new, self.width, generator=self.g)
            noise = torch.randn(1, self.hidden, generator=self.g)
            fields = {"session": "s", "start": start, "position": start + self.new}
            burst.append(_message("propose", i, fields, {"features": features, "noise": noise}, f"slot-{i}"))
            self.length[i] = start + self.new
        return burst


def answer(service: DraftService, burst: list[Message], one_by_one: bool) -> list:
    """A burst's replies drafted one by one, as a lone propose still is, or as the daemon drafts
    proposes that arrive together; the ways these benchmarks weigh against each other."""
    return [service.handle(msg) for msg in burst] if one_by_one else service.handle_all(burst)


def target_steps(args: argparse.Namespace, folder: Path) -> dict:
    """ms per batched step of `steps_of` requests drafting every step, one shared pass against a
    pass each, alternating request by request; the outputs of both are checked equal."""
    from launch.common import resolve_model
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import Sequence, step
    from target_node.drafting.draft_pass import DraftPass
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.drafting.proposers import DFlashProposer
    from target_node.model.target import TargetModel

    n = args.steps_of
    target = TargetModel.load(resolve_model(args.model), args.device, "auto", slots=n)
    drafter = load_drafter(folder, args.device, target.model.dtype)
    asks = [target.encode_chat([{"role": "user", "content": f"Tell me fact {i} about rivers."}]) for i in range(n)]
    spent, made, outputs = {"shared_pass": 0.0, "pass_each": 0.0}, dict.fromkeys(("shared_pass", "pass_each"), 0), {}
    for _ in range(args.rounds):
        for way in spent:
            shared = DraftPass(drafter) if way == "shared_pass" else None
            sequences = [
                Sequence(
                    target,
                    ask,
                    DFlashProposer(LocalDraftBackend(drafter, 1024, shared)),
                    DecodeOptions(48, adaptive=False),
                    slot=i,
                )
                for i, ask in enumerate(asks)
            ]
            while any(seq.prefilling for seq in sequences):
                step(target, sequences)
            began = time.perf_counter()
            while not all(seq.done for seq in sequences):
                step(target, [seq for seq in sequences if not seq.done])
                made[way] += 1
            spent[way] += time.perf_counter() - began
            outputs[way] = [seq.result().tokens for seq in sequences]
        if outputs["shared_pass"] != outputs["pass_each"]:
            raise SystemExit("a shared pass changed a request's output")
    row = {way: round(spent[way] / made[way] * 1000, 2) for way in spent}
    row.update(requests=n, dtype=str(target.model.dtype).removeprefix("torch."))
    row["shared_vs_each"] = round(row["shared_pass"] / row["pass_each"], 3)
    print(json.dumps({"target_steps_ms": row}), flush=True)
    return row


RESEND_WAYS = ("one_by_one", "bounded_passes", "one_pass")


def resend_way(args: argparse.Namespace, folder: str) -> dict:
    """One way of drafting a burst of whole-ring resends, in this (fresh) process: its time, its
    peak memory over what the burst's messages already held, and a digest of its replies' bits."""
    drafter = load_drafter(folder, args.device, named_dtype(args.dtypes.split(",")[-1], args.device))
    cfg, g = drafter.config, torch.Generator().manual_seed(0)
    rows_cap = {"bounded_passes": args.max_pass_rows, "one_pass": 1 << 40, "one_by_one": args.max_pass_rows}
    service = DraftService(
        drafter, DraftSettings(ring_capacity=args.resend_rows, max_pass_rows=rows_cap[args.resend_way])
    )
    wire = str(drafter.dtype).removeprefix("torch.")
    burst = []
    for i in range(args.resend):
        peer = f"slot-{i}"
        service.handle(
            _message("open", 0, {"session": "s"}, {"mask": torch.randn(1, cfg.hidden_size, generator=g)}, peer)
        )
        tensors = {
            "features": torch.randn(args.resend_rows, cfg.feature_width, generator=g),
            "noise": torch.randn(1, cfg.hidden_size, generator=g),
        }
        fields = {"session": "s", "start": 0, "position": args.resend_rows}
        msg = decode(encode("propose", i, fields, tensors, wire_dtype=wire))
        msg.peer = peer
        burst.append(msg)
    held_mb = rss_now_mb()
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from now: loading costs more than drafting
    began = time.perf_counter()
    replies = answer(service, burst, one_by_one=args.resend_way == "one_by_one")
    seconds = time.perf_counter() - began
    peak_mb = status_mb("VmHWM")
    digest = hashlib.sha256()
    for reply in replies:
        digest.update(decode(reply).tensor("hidden").float().numpy().tobytes())
    return {"seconds": round(seconds, 3), "peak_over_burst_mb": round(peak_mb - held_mb, 1), "bits": digest.hexdigest()}


def rss_now_mb() -> float:
    return status_mb("VmRSS")


def status_mb(key: str) -> float:
    """A memory figure of this process from /proc (Linux), in MiB."""
    with open(f"/proc/{os.getpid()}/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def resend_burst(args: argparse.Namespace, argv: list[str]) -> dict:
    """Each way of `resend_way` in its own process (`argv` its flags), in turns; the best of two."""
    runs: dict[str, list[dict]] = {way: [] for way in RESEND_WAYS}
    for _ in range(max(1, min(args.rounds, 2))):
        for way in RESEND_WAYS:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_draft_batch", *argv, "--resend-way", way],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    row = {
        way: {
            "seconds": min(r["seconds"] for r in rs),
            "peak_over_burst_mb": min(r["peak_over_burst_mb"] for r in rs),
        }
        for way, rs in runs.items()
    }
    digests = {r["bits"] for rs in runs.values() for r in rs}
    base = row["one_by_one"]
    for way in ("bounded_passes", "one_pass"):
        row[way]["time_vs_one_by_one"] = round(row[way]["seconds"] / base["seconds"], 2)
        row[way]["memory_vs_one_by_one"] = round(row[way]["peak_over_burst_mb"] / max(base["peak_over_burst_mb"], 1), 2)
    row.update(
        sessions=args.resend, rows=args.resend_rows, max_pass_rows=args.max_pass_rows, same_bits=len(digests) == 1
    )
    print(json.dumps({"resend_burst": row}), flush=True)
    if len(digests) != 1:
        raise SystemExit("the ways of drafting a resend burst gave different bits")
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_draft_batch", description=__doc__, formatter_class=HelpFormatter
    )
    ap.add_argument("--drafter", help="drafter checkpoint folder (default: the default model's drafter)")
    ap.add_argument("--sessions", default="1,2,4,8,16", help="burst sizes: proposes arriving together")
    ap.add_argument("--dtypes", default="float32,auto", help=f"drafter dtypes, in turns ({', '.join(DTYPE_CHOICES)})")
    ap.add_argument("--context", type=int, default=256, help="context rows each session holds")
    ap.add_argument("--new", type=int, default=3, help="feature rows each propose brings")
    ap.add_argument("--device", default="cpu", help="where the drafter runs (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the drafter")
    ap.add_argument("--rounds", type=int, default=8, help="turns of each way")
    ap.add_argument("--steps", type=int, default=10, help="bursts per turn")
    ap.add_argument("--steps-of", type=int, default=0, help="also time whole target steps of N requests (0: skip)")
    ap.add_argument("--model", help="target for --steps-of (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--resend", type=int, default=0, help="also time a burst of N whole-ring resends (0: skip)")
    ap.add_argument("--resend-rows", type=int, default=4096, help="rows each resend carries (its ring)")
    ap.add_argument(
        "--max-pass-rows", type=int, default=DraftSettings.max_pass_rows, help="the bound of the bounded way"
    )
    ap.add_argument("--resend-way", choices=RESEND_WAYS, help=argparse.SUPPRESS)  # one way, in a child
    ap.add_argument("--out", help="write the result as JSON here")
    return ap.parse_args(argv)


def resend_flags(args: argparse.Namespace, folder: str | Path) -> list[str]:
    """The flags a child process needs to draft the resend burst this run asked for."""
    child = ["--drafter", str(folder), "--dtypes", args.dtypes, "--device", args.device]
    child += ["--threads", str(args.threads), "--resend", str(args.resend)]
    return child + ["--resend-rows", str(args.resend_rows), "--max-pass-rows", str(args.max_pass_rows)]


def burst_row(args: argparse.Namespace, drafter: DFlashDrafter, dtype: torch.dtype, sessions: int) -> dict:
    """ms per burst of `sessions` proposes, one by one against in one pass, in turns; their drafts
    are checked equal."""
    # Each way drafts its own copy of the same sessions, so both see the same contexts.
    ways = {way: DraftService(drafter, DraftSettings(ring_capacity=4096)) for way in ("one_by_one", "together")}
    bursts = {way: Burst(service, sessions, args.context, args.new) for way, service in ways.items()}
    spent, last = dict.fromkeys(ways, 0.0), {}
    for _ in range(args.rounds):
        for way, service in ways.items():
            for _ in range(args.steps):
                burst = bursts[way].step()
                began = time.perf_counter()
                replies = answer(service, burst, one_by_one=way == "one_by_one")
                spent[way] += time.perf_counter() - began
            last[way] = [decode(reply).tensor("hidden") for reply in replies]
        # Same seeds, same steps: the two ways' last bursts are the same messages.
        pairs = zip(last["together"], last["one_by_one"], strict=True)
        if not all(torch.equal(a, b) for a, b in pairs):
            raise SystemExit("drafting together changed a session's drafts")
    bursts_timed = args.rounds * args.steps
    row = {
        "dtype": str(dtype).removeprefix("torch."),
        "sessions": sessions,
        "batched_in_one_pass": ways["together"].together,
        **{f"{way}_ms": round(spent[way] / bursts_timed * 1000, 3) for way in ways},
    }
    row["together_vs_one_by_one"] = round(row["together_ms"] / row["one_by_one_ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def write_out(args: argparse.Namespace, result: dict) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.drafter or ensure_default_drafter()
    if args.resend_way:
        result = resend_way(args, folder)
        print(json.dumps(result), flush=True)
        return result
    if args.resend:
        result = {"resend_burst": resend_burst(args, resend_flags(args, folder))}
        write_out(args, result)
        return result
    rows = []
    for dtype in dict.fromkeys(named_dtype(name, args.device) for name in args.dtypes.split(",")):
        drafter = load_drafter(folder, args.device, dtype)
        rows += [burst_row(args, drafter, dtype, int(n)) for n in args.sessions.split(",")]
    result = {
        "device": args.device,
        "threads": args.threads,
        "context": args.context,
        "new_rows": args.new,
        "rows": rows,
    }
    if args.steps_of:
        result["target_steps"] = target_steps(args, folder)
    write_out(args, result)
    return result


if __name__ == "__main__":
    main()
