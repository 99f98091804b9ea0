"""Serving under load: N concurrent streaming clients against target daemons, side by side in one run.

    python -m benchmarks.bench_serving --clients 1,2,4,8,16 --threads 2

Daemons (each a real process, SmolLM2 by default, with one draft daemon for those that draft):
`batched` (the default: `--max-batch` requests per forward, the default speculative mode),
`batched plain` (`--proposer none`), and `serial` (`--max-batch 1`: one request at a time, as
the daemon served before batching). For every N, each daemon in turn gets N clients at once,
each streaming `--requests` chat requests of 64-128 tokens one after another (held-out prompts),
so the load is sustained rather than draining after one request each. Reported per daemon and N:
aggregate generated tokens/s, per-request latency and time to first token (p50/p95), the
batch sizes the daemon ran, and whether every output equals the same prompt alone (from the
serial plain daemon, one at a time). A last scenario sends short requests while a 3,000-token
prompt is in prefill and reports their time to first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from frontend.target_client import TargetClient
from launch.common import resolve_model
from launch.local import daemon, free_address
from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm
from target_node.model.default_model import ensure_default_drafter
from training.prompts import EVAL_PROMPTS, read_prompts


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] if ordered else 0.0


def request(address: str, ask: dict, out: dict) -> None:
    """One client: stream `ask`, record when it started, its first chunk, its end and its tokens."""
    client = TargetClient(address, timeout_s=600)
    began = time.monotonic()
    first = None
    try:
        for reply in client.stream(**ask):
            if first is None:
                first = time.monotonic()
            if reply.type == "done":
                out.update(tokens=reply["token_ids"], stats=reply["stats"])
    finally:
        client.close()
    out.update(began=began, ttft_s=(first or time.monotonic()) - began, latency_s=time.monotonic() - began)


def client_of(address: str, asks: list[dict], outs: list[dict], failed: list[BaseException]) -> None:
    """One client sending its requests one after another, each as soon as the last one is done; what
    ends it early goes to `failed`, for the round to raise (it ended in a KeyError: an audit)."""
    try:
        for ask, out in zip(asks, outs, strict=True):
            request(address, ask, out)
    except BaseException as exc:
        failed.append(exc)


def round_of(address: str, per_client: list[list[dict]]) -> dict:
    """Every client at once, each with its own requests in turn; the round's figures."""
    outs = [[{} for _ in asks] for asks in per_client]
    failed: list[BaseException] = []
    threads = [
        threading.Thread(target=client_of, args=(address, asks, o, failed), daemon=True)  # a signal must not wait
        for asks, o in zip(per_client, outs, strict=True)
    ]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - began
    if failed:
        raise failed[0]
    flat = [o for client in outs for o in client]
    tokens = sum(len(o.get("tokens", [])) for o in flat)
    latency = [o["latency_s"] for o in flat]
    ttft = [o["ttft_s"] for o in flat]
    return {
        "clients": len(per_client),
        "requests": len(flat),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "latency_p50_s": round(percentile(latency, 0.5), 3),
        "latency_p95_s": round(percentile(latency, 0.95), 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3),
        "ttft_p95_s": round(percentile(ttft, 0.95), 3),
        "batch_max": max(o.get("stats", {}).get("batch", 0) for o in flat),
        "steps": sum(o.get("stats", {}).get("steps", 0) for o in flat),
        "plain_steps": sum(o.get("stats", {}).get("plain_steps", 0) for o in flat),
        "outputs": [o.get("tokens", []) for o in flat],
    }


def long_prefill(address: str, prompt_tokens: int, short: dict, count: int, vocab: int) -> dict:
    """Short requests arriving one after another while a long prompt is in prefill: their TTFT."""
    long_ask = {"token_ids": [3 + (i * 7) % (vocab - 10) for i in range(prompt_tokens)], "max_new_tokens": 8}
    held = {}
    runner = threading.Thread(target=request, args=(address, long_ask, held), daemon=True)
    runner.start()
    time.sleep(0.2)  # the long prompt is in
    ttfts = []
    for _ in range(count):
        out = {}
        request(address, short, out)
        ttfts.append(out["ttft_s"])
        if not runner.is_alive():
            break
    runner.join()
    return {
        "prompt_tokens": prompt_tokens,
        "short_requests": len(ttfts),
        "long_request_s": round(held.get("latency_s", 0.0), 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
        "ttft_max_s": round(max(ttfts), 3) if ttfts else 0.0,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", help="drafter checkpoint (default: the model's default drafter)")
    ap.add_argument("--clients", default="1,2,4,8,16", help="concurrent clients per round, comma-separated")
    ap.add_argument("--max-batch", type=int, default=16, help="the batched daemons' --max-batch")
    ap.add_argument(
        "--requests", type=int, default=3, help="requests each client sends, one after another (a sustained load)"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="rounds per daemon and N, in turns; the median by tokens/s is reported"
    )
    ap.add_argument("--min-tokens", type=int, default=64, help="the shortest request's max_new_tokens")
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="the longest request's max_new_tokens (requests spread between)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads per daemon")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="held-out prompts (jsonl)")
    ap.add_argument("--long-prompt", type=int, default=3000, help="tokens of the long prompt (0: skip that part)")
    ap.add_argument("--extra", default="", help="more flags for the drafting target daemons, space-separated")
    ap.add_argument("--json", default="bench_results/bench_serving.json", help="write the results here")
    return ap.parse_args(argv)


def chat_asks(args: argparse.Namespace, count: int) -> list[dict]:
    """Held-out prompts with lengths spread over the span, so requests end at different steps."""
    texts = read_prompts(args.prompts)
    span = args.max_tokens - args.min_tokens
    return [
        {
            "messages": [{"role": "user", "content": texts[i % len(texts)]}],
            "max_new_tokens": args.min_tokens + (i * 37) % (span + 1),
            "stream": True,
        }
        for i in range(count)
    ]


def start_daemons(stack: ExitStack, args: argparse.Namespace, model: Path, checkpoint: str) -> dict[str, str]:
    """One draft daemon shared by the target daemons that draft; each target daemon's address, by name."""
    threads = ["--threads", str(args.threads)]
    common = ["--model", str(model), *threads]
    draft_address = free_address()
    drafting = ["--drafter", draft_address, *args.extra.split()]  # a plain daemon refuses drafting flags
    targets = {
        "batched": [*drafting, "--max-batch", str(args.max_batch)],
        "batched plain": ["--proposer", "none", "--max-batch", str(args.max_batch)],
        "serial": [*drafting, "--max-batch", "1"],
        "serial plain": ["--proposer", "none", "--max-batch", "1"],
    }
    stack.enter_context(
        daemon("draft daemon", "launch.draft_daemon", draft_address, ["--checkpoint", checkpoint, *threads], 300)
    )
    addresses = {}
    for name, flags in targets.items():
        addresses[name] = free_address()
        stack.enter_context(
            daemon(f"target daemon ({name})", "launch.target_daemon", addresses[name], [*common, *flags], 600)
        )
    return addresses


def alone_outputs(address: str, asks: list[dict]) -> list[list[int]]:
    """Each prompt alone, one at a time: the reference every loaded output must equal."""
    alone = []
    for ask in asks:
        out = {}
        request(address, ask, out)
        alone.append(out["tokens"])
    return alone


def rounds_of(
    addresses: dict[str, str], asks: list[dict], alone: list[list[int]], n: int, args: argparse.Namespace
) -> list[dict]:
    """N clients against each daemon, `--repeats` times in turns (each repeat starting one daemon
    later, so no daemon always follows the same one); each daemon's median round."""
    # Client c sends asks c, c + n, c + 2n, ...: every round runs the first n * requests asks.
    per_client = [asks[c : n * args.requests : n] for c in range(n)]
    want = [alone[i] for c in range(n) for i in range(c, n * args.requests, n)]
    runs: dict[str, list[dict]] = {name: [] for name in addresses}
    names = list(addresses)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            result = round_of(addresses[name], per_client)
            result["daemon"] = name
            outputs = result.pop("outputs")
            result["identical_to_alone"] = sum(o == a for o, a in zip(outputs, want, strict=True))
            runs[name].append(result)
            print(json.dumps(result), flush=True)
    return [median_round(results) for results in runs.values()]


def median_round(results: list[dict]) -> dict:
    """The median run by throughput, with every run's figure; identical only as the worst run was."""
    ordered = sorted(results, key=lambda r: r["tok_s"])
    median = dict(ordered[len(ordered) // 2], tok_s_runs=[r["tok_s"] for r in results])
    median["identical_to_alone"] = min(r["identical_to_alone"] for r in results)
    return median


def long_prefills(args: argparse.Namespace, addresses: dict[str, str], asks: list[dict]) -> dict:
    short = {**asks[0], "max_new_tokens": 8}
    found = {}
    for name in ("batched", "serial"):
        found[name] = long_prefill(addresses[name], args.long_prompt, short, 10, 49152)
        print(json.dumps({"long_prefill": name, **found[name]}), flush=True)
    return found


def compare_to_serial(rounds: list[dict], counts: list[int]) -> None:
    by = {(r["daemon"], r["clients"]): r for r in rounds}
    for n in counts:
        serial, batched = by.get(("serial", n)), by.get(("batched", n))
        if serial and batched:
            batched["vs_serial"] = round(batched["tok_s"] / serial["tok_s"], 3)


@ends_on_sigterm
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = resolve_model(args.model)
    checkpoint = args.drafter or str(ensure_default_drafter(model))
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    asks = chat_asks(args, max(counts) * args.requests)
    report: dict = {"model": str(model), "drafter": checkpoint, "max_batch": args.max_batch, "rounds": []}
    with ExitStack() as stack:
        addresses = start_daemons(stack, args, model, checkpoint)
        alone = alone_outputs(addresses["serial plain"], asks)
        for n in counts:
            report["rounds"] += rounds_of(addresses, asks, alone, n, args)
        if args.long_prompt:
            report["long_prefill"] = long_prefills(args, addresses, asks)
    compare_to_serial(report["rounds"], counts)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out}")
    # An answer under load that is not the one alone is a failure: it showed as a column and exited 0 (an audit).
    short = [r for r in report["rounds"] if r["identical_to_alone"] != r["requests"]]
    if short:
        print(f"benchmarks.bench_serving: {len(short)} rounds answered differently than alone", file=sys.stderr)
        raise SystemExit(1)
    return report


def drafted_share(r: dict) -> float:
    """Of the round's steps, the share that verified drafts (as the batch grows, the governor drafts
    less; a step that asked the drafter and got nothing back counts as plain here: `drafter_steps`
    in each request's stats counts those too)."""
    return (r["steps"] - r["plain_steps"]) / r["steps"] if r["steps"] else 0.0


def print_table(report: dict) -> None:
    print(
        f"\n{'daemon':>14} {'N':>3} {'tok/s':>8} {'vs serial':>9} {'lat p50':>8} {'lat p95':>8} {'ttft p50':>9} "
        f"{'ttft p95':>9} {'batch':>5} {'drafted':>7} {'same':>7}"
    )
    for r in report["rounds"]:
        print(
            f"{r['daemon']:>14} {r['clients']:>3} {r['tok_s']:8.1f} {r.get('vs_serial', 0):9.2f} "
            f"{r['latency_p50_s']:8.2f} {r['latency_p95_s']:8.2f} {r['ttft_p50_s']:9.2f} {r['ttft_p95_s']:9.2f} "
            f"{r['batch_max']:5d} {drafted_share(r):7.0%} {r['identical_to_alone']:>3}/{r['requests']}"
        )
    for name, r in report.get("long_prefill", {}).items():
        print(
            f"short requests during a {r['prompt_tokens']}-token prefill ({name}): ttft p50 {r['ttft_p50_s']:.2f} s, "
            f"p95 {r['ttft_p95_s']:.2f} s, max {r['ttft_max_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
