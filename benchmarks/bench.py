"""Benchmarks, measured side by side in one run; prints tables and writes JSON (and a PNG plot).

1. Generation: plain greedy vs the local DFlash drafter vs the remote one (a real draft
   daemon over tcp loopback) vs n-gram lookup, same prompts and model: tok/s, tau, and
   each step split into drafting (draft compute + wire + projection) and verification.
2. Protocol overhead: a propose round trip of a real step's size (encode, send, decode,
   reply) against a raw ZeroMQ round trip of the same bytes: the physical floor.
3. Draft step time against context length, cached context K/V vs recomputing them.
4. Verify cost against its width (1 + drafts): what a step with k drafts costs next to a
   plain step sets the acceptance (tau) a drafter needs just to break even.
5. Engines and peers: plain and default speculative decoding on the transformers path (what
   ran before the engine) and on the engine, in fp32 and bf16, beside transformers `generate`
   (greedy, and its prompt lookup) and llama.cpp (llama-cpp-python on the wheel's GGUF, where
   installed), all on the same prompts in turns; outputs checked against plain in the same
   target; and the width-cost table of each target.

`--quick` runs a tiny random model only, with few tokens: the test suite uses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import zmq

from dflash_kernels import Packed
from draft_node.checkpoint import config_for_target, load_drafter, random_drafter, save_drafter
from draft_node.config import CheckpointError
from draft_node.kv_cache import DraftKVCache
from launch.common import at_least, resolve_model
from launch.local import daemon, free_address
from launch.net import HelpFormatter, one_line_errors
from launch.processes import ends_on_sigterm
from protocol import decode, encode
from protocol.transport import dealer, receive, router
from target_node.decoding.governor import Governor, VerifyCosts
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.decoding.stats import Stats
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer
from target_node.drafting.remote import RemoteDraftBackend
from target_node.model.default_model import ensure_default_drafter
from target_node.model.target import TargetModel
from target_node.model.tiny import tiny_target
from training.prompts import EVAL_PROMPTS, read_prompts

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Explain in three sentences why the sky is blue.",
    "List five countries in Europe and their capitals.",
]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


# --- 1. generation ------------------------------------------------------------


def bench_generation(
    target: TargetModel, prompts: list[list[int]], checkpoint: Path, max_new: int, threads: int
) -> list[dict]:
    drafter = load_drafter(checkpoint, dtype=target.model.dtype)
    local = LocalDraftBackend(drafter, 4096)
    address = free_address()
    flags = ["--checkpoint", str(checkpoint), "--threads", str(threads)]
    with daemon("draft daemon", "launch.draft_daemon", address, flags, 180):
        remote = RemoteDraftBackend(address, target)
        modes = [
            ("plain", NoProposer(), True),
            ("ngram", NGramProposer(), True),
            ("dflash-local (every step)", DFlashProposer(local), False),
            ("dflash-remote (every step)", DFlashProposer(remote), False),
            ("dflash-local (adaptive)", DFlashProposer(local), True),
            ("dflash-remote (adaptive)", DFlashProposer(remote), True),
        ]
        rows = run_modes(target, prompts, modes, max_new)
        remote.close()
    compare_modes(rows)
    return rows


def run_modes(target: TargetModel, prompts: list[list[int]], modes: list[tuple], max_new: int) -> list[dict]:
    """Modes take turns on each prompt, so drift in machine load spreads over all of them."""
    totals = {name: Stats() for name, *_ in modes}
    governors = {name: Governor() for name, *_ in modes}  # as in the daemon: one per proposer
    for _, proposer, _ in modes:
        generate(target, prompts[0], proposer, DecodeOptions(4, adaptive=False))  # warm-up
    # Modes share a backend (every step and adaptive): its counters' moves are summed per run of a
    # mode, or each row reported both modes' figures pooled (an audit).
    spent = {name: Counter() for name, *_ in modes}
    for prompt in prompts:
        for name, proposer, adaptive in modes:
            before = dict(proposer.backend.counters) if proposer.backend is not None else {}
            stats = generate(
                target, prompt, proposer, DecodeOptions(max_new, adaptive=adaptive), governor=governors[name]
            ).stats
            totals[name].add(stats)
            if proposer.backend is not None:
                spent[name].update({k: v - before.get(k, 0) for k, v in proposer.backend.counters.items()})
    return [generation_row(name, totals[name], spent[name] if p.backend is not None else None) for name, p, _ in modes]


def generation_row(name: str, t: Stats, spent: Counter | None) -> dict:
    """A mode's step split: drafting (compute, and for a remote drafter the wire) against verifying;
    `spent`: what its drafter's counters moved by in this mode's runs."""
    row = {
        "mode": name,
        "tok_s": t.decode_tok_s,
        "tau": t.tau,
        "steps": t.steps,
        "sources": dict(t.sources),
        "propose_ms": 1000 * t.propose_s / t.steps,
        "verify_ms": 1000 * t.verify_s / t.steps,
    }
    if spent is None:
        return row
    proposals = row["proposals"] = spent["proposals"]
    if proposals:
        row["draft_compute_ms"] = spent["draft_ms"] / proposals
        if "propose_rtt_ms" in spent:
            row["wire_ms"] = spent["propose_rtt_ms"] / proposals - row["draft_compute_ms"]
            row["bytes_per_step"] = (spent["bytes_out"] + spent["bytes_in"]) / proposals
    return row


def compare_modes(rows: list[dict]) -> None:
    """Each mode against plain decoding, and the remote drafter against the local one: the wire's price."""
    plain = rows[0]["tok_s"]
    by_name = {r["mode"]: r for r in rows}
    for row in rows:
        row["vs_plain"] = row["tok_s"] / plain if plain else 0.0
    for kind in ("every step", "adaptive"):
        local_row, remote_row = by_name[f"dflash-local ({kind})"], by_name[f"dflash-remote ({kind})"]
        remote_row["remote_vs_local"] = remote_row["tok_s"] / local_row["tok_s"] if local_row["tok_s"] else 0.0


# --- 2. protocol overhead -------------------------------------------------------


def _serve(sock: zmq.Socket, stop: threading.Event, reply_fn) -> None:
    while not stop.is_set():
        if sock.poll(50):
            identity, *frames = sock.recv_multipart(copy=False)
            sock.send_multipart([identity, *reply_fn(frames)], copy=False)


def _protocol_round_trip(client: zmq.Socket, features: torch.Tensor, noise: torch.Tensor, counter) -> None:
    rid = next(counter)
    fields = {"session": "s", "start": 0, "position": features.shape[0]}
    client.send_multipart(encode("propose", rid, fields, {"features": features, "noise": noise}), copy=False)
    receive(client, rid, time.monotonic() + 5).tensor("hidden")


def _raw_round_trip(client: zmq.Socket, frames: list[bytes]) -> None:
    client.send_multipart(frames, copy=False)
    client.recv_multipart()


def _protocol_reply(reply_hidden: torch.Tensor, frames: list) -> list:
    msg = decode(frames)
    msg.tensor("features")
    msg.tensor("noise")
    return encode("proposal", msg.id, {"draft_ms": 0.0}, {"hidden": reply_hidden})


def bench_protocol(feature_rows: int, feature_width: int, block: int, hidden: int, repeats: int) -> dict:
    """Same bytes both ways: a propose/proposal pair through the codec vs raw frames echoed."""
    context = zmq.Context.instance()
    features = torch.randn(feature_rows, feature_width)
    noise = torch.randn(1, hidden)  # last_tok's embedding: the mask rows travel once, at open
    reply_hidden = torch.zeros(block - 1, hidden)
    request_bytes = features.numel() * 4 + noise.numel() * 4
    reply_bytes = reply_hidden.numel() * 4
    raw_reply = [b"r", bytes(reply_bytes)]
    servers = {
        "protocol": partial(_protocol_reply, reply_hidden),
        "raw": lambda frames: raw_reply,
    }
    results = {}
    for name, reply_fn in servers.items():
        address = free_address()
        server = router(context, address)
        stop = threading.Event()
        thread = threading.Thread(target=_serve, args=(server, stop, reply_fn), daemon=True)
        thread.start()
        client = dealer(context, address)
        if name == "protocol":
            step = partial(_protocol_round_trip, client, features, noise, iter(range(1, 10**9)))
        else:
            step = partial(_raw_round_trip, client, [b"q", bytes(request_bytes)])
        results[f"{name}_rtt_ms"] = median_ms(step, repeats)
        client.close(0)
        stop.set()
        thread.join()
        server.close(0)
    results.update(
        request_tensor_bytes=request_bytes,
        reply_tensor_bytes=reply_bytes,
        overhead_ratio=results["protocol_rtt_ms"] / results["raw_rtt_ms"],
        feature_rows=feature_rows,
    )
    return results


# --- 3. draft step time vs context ------------------------------------------------


def _cached_step(cache: DraftKVCache, features: torch.Tensor, noise: torch.Tensor) -> None:
    """A typical step: two newly committed rows arrive, then the block is drafted."""
    p = cache.length
    cache.append(p, features[p : p + 2])
    cache.draft_rows(noise, p + 2, cache.drafter.config.block_size - 1)


def bench_context(drafter, contexts: list[int], repeats: int) -> list[dict]:
    cfg = drafter.config
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in contexts:
        features = torch.randn(n + 2 * (repeats + 2), cfg.feature_width, generator=g).to(drafter.dtype)
        noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g).to(drafter.dtype)
        cache = DraftKVCache(drafter, max(contexts) + 4 * (repeats + 2))
        cache.append(0, features[:n])
        recompute = partial(drafter, features[:n], torch.arange(n), noise, n)
        rows.append(
            {
                "context": n,
                "cached_ms": median_ms(partial(_cached_step, cache, features, noise), repeats),
                "recompute_ms": median_ms(recompute, max(2, repeats // 4)),
            }
        )
    base = rows[0]["cached_ms"]
    for row in rows:
        row["cached_vs_first"] = row["cached_ms"] / base
    return rows


# --- 4. verify cost vs width ------------------------------------------------------


def bench_verify(target: TargetModel, widths: list[int], repeats: int) -> list[dict]:
    """Target step time by tokens verified at once, after a 128-token context, with no features
    tapped: the same measurement the governor's cost table starts from."""
    costs = VerifyCosts()
    costs.measure(target, widths, repeats=repeats)
    rows = [{"width": w, "verify_ms": costs.seconds[w] * 1000} for w in widths]
    for row in rows:
        # With no draft cost at all, a step this wide pays only above this many tokens per step.
        row["break_even_tau"] = row["verify_ms"] / rows[0]["verify_ms"]
    return rows


# --- 5. engines and peers ----------------------------------------------------------


def _end_to_end(stats: Stats) -> float:
    seconds = stats.ttft_s + stats.decode_s
    return stats.new_tokens / seconds if seconds > 0 else 0.0


def _generate_peer(model, ids: list[int], max_new: int, **options) -> tuple[int, float]:
    """transformers' own generate (greedy): new tokens and seconds."""
    inputs = torch.tensor([ids], device=model.device)
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, max_new_tokens=max_new, do_sample=False, pad_token_id=0, **options)
    return out.shape[1] - len(ids), time.perf_counter() - began


def _llama_cpp(threads: int):
    """llama.cpp through llama-cpp-python on the wheel's Q4_1 GGUF, or None where either is missing."""
    try:
        from llama_cpp import Llama

        from target_node.model.default_model import GGUF_NAME, _wheel_folder
    except ImportError:
        return None
    path = _wheel_folder() / GGUF_NAME
    if not path.is_file():
        return None
    return Llama(model_path=str(path), n_threads=threads, n_ctx=4096, verbose=False)


def _run_llama_cpp(llm, ids: list[int], max_new: int) -> tuple[int, float]:
    began = time.perf_counter()
    out = llm.create_completion(prompt=ids, max_tokens=max_new, temperature=0.0, top_k=1)
    return out["usage"]["completion_tokens"], time.perf_counter() - began


def load_target(folder: Path | None, dtype: torch.dtype, engine: bool) -> TargetModel:
    """`folder` None: a tiny random model, for the test suite's quick run."""
    if folder is None:
        return tiny_target(vocab=512, engine=engine, dtype=dtype)
    return TargetModel.load(folder, dtype=dtype, engine=engine)


def prompt_ids(target: TargetModel, texts: list[str], tiny: bool) -> list[list[int]]:
    """A tiny random model has no chat template: as many fixed token prompts instead."""
    if tiny:
        return [[1 + (7 * i + j) % 500 for j in range(24)] for i in range(len(texts))]
    return [target.encode_chat([{"role": "user", "content": p}]) for p in texts]


class Peers:
    """transformers' own generate (greedy, and its prompt lookup) and llama.cpp where it is
    installed: the yardsticks outside this project, their new tokens and seconds summed."""

    def __init__(self, targets: dict[str, TargetModel], llm: object | None, max_new: int) -> None:
        fp32, bf16 = targets["float32 transformers path"].model, targets["bfloat16 transformers path"].model
        self.runs = {
            "transformers generate fp32 greedy": lambda p: _generate_peer(fp32, p, max_new),
            "transformers generate fp32 prompt lookup": lambda p: _generate_peer(
                fp32, p, max_new, prompt_lookup_num_tokens=10
            ),
            "transformers generate bf16 greedy": lambda p: _generate_peer(bf16, p, max_new),
        }
        if llm is not None:
            self.runs["llama.cpp Q4_1 (llama-cpp-python)"] = lambda p: _run_llama_cpp(llm, p, max_new)
        self.totals = {peer: [0, 0.0] for peer in self.runs}

    def run(self, prompt: list[int]) -> None:
        for peer, fn in self.runs.items():
            tokens, seconds = fn(prompt)
            self.totals[peer][0] += tokens
            self.totals[peer][1] += seconds

    def rows(self) -> list[dict]:
        return [{"target": peer, "mode": "peer", "tok_s": t / s if s else 0.0} for peer, (t, s) in self.totals.items()]


def bench_engines(
    folder: Path | None, checkpoint: Path, prompts: list[str], max_new: int, threads: int, widths: list[int]
) -> dict:
    """Each (dtype, path) target decodes every prompt plain and with the default speculative mode
    (the governor, trees of up to 16 nodes, the drafter in this process), then the peers do: all
    in turns, prompt by prompt. `folder` None: a tiny random model (the test suite's quick run)."""
    targets = {
        f"{dtype} {'engine' if engine else 'transformers path'}": load_target(folder, getattr(torch, dtype), engine)
        for dtype in ("float32", "bfloat16")
        for engine in (False, True)
    }
    drafter = load_drafter(checkpoint, dtype=torch.bfloat16)
    proposers = {name: DFlashProposer(LocalDraftBackend(drafter)) for name in targets}
    governors = {name: Governor(max_nodes=16) for name in targets}
    ids = prompt_ids(next(iter(targets.values())), prompts, folder is None)
    peers = Peers(targets, _llama_cpp(threads) if folder is not None else None, max_new)
    totals = {f"{name}: {mode}": Stats() for name in targets for mode in ("plain", "default")}
    mismatches = dict.fromkeys(targets, 0)
    for name, target in targets.items():  # warm-up
        generate(target, ids[0], proposers[name], DecodeOptions(4, tree_nodes=16), governor=governors[name])
    for prompt in ids:
        for name, target in targets.items():
            plain = generate(target, prompt, NoProposer(), DecodeOptions(max_new))
            spec = generate(
                target, prompt, proposers[name], DecodeOptions(max_new, tree_nodes=16), governor=governors[name]
            )
            totals[f"{name}: plain"].add(plain.stats)
            totals[f"{name}: default"].add(spec.stats)
            mismatches[name] += spec.tokens != plain.tokens
        peers.run(prompt)
    rows = engine_rows(totals, mismatches) + peers.rows()
    compare_engines(rows)
    return {"prompts": len(ids), "max_new_tokens": max_new, "rows": rows, "width_ms": width_costs(targets, widths)}


def engine_rows(totals: dict[str, Stats], mismatches: dict[str, int]) -> list[dict]:
    rows = []
    for key, stats in totals.items():
        name, mode = key.split(": ")
        rows.append(
            {
                "target": name,
                "mode": mode,
                "tok_s": _end_to_end(stats),
                "decode_tok_s": stats.decode_tok_s,
                "tau": stats.tau,
                "differs_from_plain": mismatches[name] if mode == "default" else 0,
            }
        )
    return rows


def compare_engines(rows: list[dict]) -> None:
    """Every row against transformers' greedy generate, and against plain decoding on its own target."""
    base = next(r["tok_s"] for r in rows if r["target"] == "transformers generate fp32 greedy")
    for row in rows:
        row["vs_transformers_generate"] = row["tok_s"] / base if base else 0.0
        plain = next(r for r in rows if r["target"] == row["target"])  # the plain row comes first
        row["vs_plain_same_target"] = row["tok_s"] / plain["tok_s"] if plain["tok_s"] else 0.0


def width_costs(targets: dict[str, TargetModel], widths: list[int]) -> dict[str, dict[str, float]]:
    """Each target's step time (ms) by width: what the governor weighs drafts against, per target."""
    cost = {}
    for name, target in targets.items():
        costs = VerifyCosts()
        costs.measure(target, widths, repeats=3)
        cost[name] = {str(w): round(costs.seconds[w] * 1000, 2) for w in widths}
    return cost


# --- 6. what invariance costs -------------------------------------------------------


class OneDNNLinears:
    """The engine with oneDNN's prepacked matmul (what inductor's weight freezing uses) in place of
    the invariant kernels' linear: the fastest CPU matmul torch has here, and not batch-invariant.
    For measuring what invariance costs, never for serving."""

    block = None

    def prepare(self, *weights: torch.Tensor) -> Packed:
        w = torch.cat([x.detach() for x in weights]).contiguous()
        return Packed(torch.ops.mkldnn._reorder_linear_weight(w, 16), w.shape[0])

    def linear(self, x, w, n, bias, residual, out) -> None:
        y = torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, None, "none", [], "").float()
        if bias is not None:
            y = y + bias
        out.copy_(y if residual is None else residual + y)

    def __getattr__(self, name: str):  # norms, rotary, attention: the kernels' own
        return getattr(torch.ops.dflash, name)


def bench_invariance_cost(folder: Path | None, widths: list[int], repeats: int) -> dict:
    """Step time by width on the engine with its invariant linears and with oneDNN's, in turns,
    after a 128-token context; fp32 and bf16. The ratio is the price of exactness."""
    from target_node.engine.engine import Engine

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_target(folder, dtype, engine=False).model
        try:
            theirs = Engine(model, ops=OneDNNLinears())
        except RuntimeError as exc:  # oneDNN's bf16 prepack needs AVX512BW/VL/DQ or AVX-NE-CONVERT
            out[str(dtype).removeprefix("torch.")] = {"skipped": f"oneDNN cannot pack {dtype} here: {exc}"}
            continue
        engines = {"invariant kernels": Engine(model), "oneDNN prepacked": theirs}
        context = [3 + i % 97 for i in range(128)]
        for engine in engines.values():
            engine.step(context)
        times = {(name, w): [] for name in engines for w in widths}
        for _ in range(repeats):
            for w in widths:
                for name, engine in engines.items():
                    began = time.perf_counter()
                    hidden, _ = engine.step([5] * w)
                    engine.head(hidden).argmax(-1)
                    times[(name, w)].append(time.perf_counter() - began)
                    engine.rollback(len(context))
        rows = []
        for w in widths:
            ours, theirs = (statistics.median(times[(n, w)]) * 1000 for n in engines)
            rows.append({"width": w, "invariant_ms": ours, "onednn_ms": theirs, "cost": ours / theirs})
        out[str(dtype).removeprefix("torch.")] = rows
    return out


# --- reporting -------------------------------------------------------------------


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def plot(context_rows: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, rows in context_rows.items():
        xs = [r["context"] for r in rows]
        ax.plot(xs, [r["cached_ms"] for r in rows], marker="o", label=f"{model}: cached K/V ring")
        ax.plot(xs, [r["recompute_ms"] for r in rows], marker="x", linestyle="--", label=f"{model}: recompute")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("draft step time (ms)")
    ax.set_title("DFlash draft step time vs context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def print_model(name: str, entry: dict, setting: str) -> None:
    """The four tables of one model."""
    print(f"\n== {name}: generation ({setting})")
    columns = ["mode", "tok_s", "vs_plain", "tau", "propose_ms", "verify_ms", "draft_compute_ms", "wire_ms"]
    print(table(entry["generation"], [*columns, "bytes_per_step", "remote_vs_local"]))
    print(f"== {name}: protocol round trip vs raw ZeroMQ, same bytes")
    columns = ["feature_rows", "protocol_rtt_ms", "raw_rtt_ms", "overhead_ratio"]
    print(table([entry["protocol"]], [*columns, "bytes_per_step_measured", "minimum_bytes_per_step"]))
    print(f"== {name}: draft step vs context")
    print(table(entry["context"], ["context", "cached_ms", "recompute_ms", "cached_vs_first"]))
    print(f"== {name}: verify step vs width (1 + drafts)")
    print(table(entry["verify"], ["width", "verify_ms", "break_even_tau"]))
    if "engines" in entry:
        engines = entry["engines"]
        print(f"== {name}: engines and peers ({engines['prompts']} prompts x {engines['max_new_tokens']} tokens)")
        columns = ["target", "mode", "tok_s", "decode_tok_s", "tau", "vs_plain_same_target"]
        print(table(engines["rows"], [*columns, "vs_transformers_generate", "differs_from_plain"]))
        widths = list(next(iter(engines["width_ms"].values())))
        print(table([{"target": t, **ms} for t, ms in engines["width_ms"].items()], ["target", *widths]))
    for dtype, rows in entry.get("invariance_cost", {}).items():
        print(f"== {name}: what invariance costs ({dtype}: the engine's step, invariant kernels vs oneDNN)")
        columns = ["width", "invariant_ms", "onednn_ms", "cost"]
        print(rows["skipped"] if isinstance(rows, dict) else table(rows, columns))


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "models": {}}
    contexts = [128, 256] if args.quick else [128, 256, 512, 1024, 2048, 4096]
    repeats = 3 if args.quick else args.repeats
    targets = [("tiny", None)] if args.quick else [("tiny", None), ("smollm2", resolve_model(args.model))]
    context_rows = {}
    for name, folder in targets:
        if folder is None:
            target = tiny_target(vocab=512)
            cfg = config_for_target(target.config, block_size=8, taps=3)
            checkpoint = save_drafter(random_drafter(cfg), out / "tiny-drafter")
        else:
            target = TargetModel.load(folder)
            checkpoint = Path(args.drafter) if args.drafter else ensure_default_drafter(folder)
        prompts = prompt_ids(target, DEFAULT_PROMPTS, folder is None)
        drafter = load_drafter(checkpoint)
        cfg = drafter.config
        generation = bench_generation(target, prompts, checkpoint, args.max_new_tokens, args.threads)
        remote = next(r for r in generation if r["mode"] == "dflash-remote (every step)")
        rows_per_step = max(1, round(remote["tau"]))
        protocol = bench_protocol(rows_per_step, cfg.feature_width, cfg.block_size, cfg.hidden_size, repeats * 10)
        protocol["bytes_per_step_measured"] = remote.get("bytes_per_step", 0.0)
        protocol["minimum_bytes_per_step"] = protocol["request_tensor_bytes"] + protocol["reply_tensor_bytes"]
        context_rows[name] = bench_context(drafter, contexts, repeats)
        verify = bench_verify(target, list(range(1, 2 * cfg.block_size + 1)), repeats)
        report["models"][name] = {
            "drafter": str(checkpoint),
            "generation": generation,
            "protocol": protocol,
            "context": context_rows[name],
            "verify": verify,
        }
        if not args.skip_engines:
            texts = DEFAULT_PROMPTS if args.quick else read_prompts(args.prompts)[: args.prompt_limit]
            report["models"][name]["engines"] = bench_engines(
                folder, checkpoint, texts, args.max_new_tokens, args.threads, list(range(1, 18))
            )
            report["models"][name]["invariance_cost"] = bench_invariance_cost(folder, [1, 2, 5, 9, 17], repeats)
        setting = f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.threads} threads"
        print_model(name, report["models"][name], setting)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.quick and plot(context_rows, out / "draft_step_vs_context.png"):
        report["plot"] = str(out / "draft_step_vs_context.png")
    print(f"\nwrote {out / 'bench.json'}")
    return report


@ends_on_sigterm
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only, few tokens (for the test suite)")
    parser.add_argument("--model", help="target folder for the real-model part (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--drafter", help="drafter checkpoint for the real model (default: the model's default drafter)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=12, help="timed repetitions per micro-benchmark")
    parser.add_argument(
        "--threads", type=at_least(1), default=2, help="torch threads in this process and the draft daemon"
    )
    parser.add_argument("--out", default="bench_results", help="folder for bench.json and the plot")
    parser.add_argument("--prompts", default=str(EVAL_PROMPTS), help="prompts of the engines table (jsonl)")
    parser.add_argument("--prompt-limit", type=int, default=12, help="how many of them")
    parser.add_argument("--skip-engines", action="store_true", help="leave out the engines and peers table")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the plot from an earlier bench.json")
    args = parser.parse_args(argv)
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        path = Path(args.out) / "draft_step_vs_context.png"
        rows = {name: model["context"] for name, model in report["models"].items()}
        print(path if plot(rows, path) else "matplotlib is not installed: pip install matplotlib")
        return
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, 24)
    with one_line_errors(parser.prog, CheckpointError):
        report = run(args)
    # A drafted output that is not plain decoding's is a failure, not a table entry: it exited 0 (an audit).
    differing = differing_outputs(report)
    if differing:
        print(f"dflash-bench: {differing} outputs differ from plain decoding", file=sys.stderr)
        raise SystemExit(1)


def differing_outputs(report: dict) -> int:
    """How many of this engine's drafted outputs differ from its plain decoding's, over every engines
    table. The transformers path's rows count for nothing here: in bf16 it is inexact, as
    docs/engine.md shows (counted, every full run failed, a review)."""
    return sum(
        row.get("differs_from_plain", 0)
        for model in report["models"].values()
        for row in model.get("engines", {}).get("rows", [])
        if "engine" in row["target"]
    )


if __name__ == "__main__":
    main()
