"""Does a drafter earn its keep? Plain greedy against speculative modes, side by side, over a prompt file.

    python -m benchmarks.evaluate --drafter drafters/smollm2 --prompts data/eval_prompts.jsonl
    python -m benchmarks.evaluate --drafter-address tcp://127.0.0.1:5555 --modes chain,tree:4,tree:8,tree:16,adaptive
    python -m benchmarks.evaluate --drafter new/ --baseline drafters/smollm2 --modes chain,adaptive

Every prompt runs first with no proposer (the reference), then in each mode, taking turns,
so drift in machine load spreads over all of them. Modes:

- `chain`: draft every step, verify the drafter's top choice at every position (the block);
- `tree:N`: draft every step, verify a tree of N nodes built from the drafter's distributions;
  `tree:N+lookup`: with the continuation looked up in the context (prompt lookup) as one more branch,
  `+store` with the one looked up in the target's earlier answers (`--datastore`), or both;
- `adaptive`: the default configuration: the governor decides whether to draft and how many
  tree nodes (up to --tree-nodes) to verify, from verify costs measured here at start, and every
  step may verify both looked-up branches; `adaptive-lookup`: the same without the datastore's;
  `adaptive-drafter`: with neither;
- `adaptive-chain`: the governor over chains only.

With `--baseline` (or `--baseline-address`) a second drafter runs every mode too, in the same
turns (rows `MODE@baseline`): two drafters compared under the same load, against one reference.

At temperature 0 every mode's output must equal the reference token for token; a mismatch
is counted and reported, never hidden. Speed is decode tokens per second (prefill excluded),
summed over all prompts, so long answers weigh what they cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draft_node.config import CheckpointError
from launch.common import TARGET_DTYPES, named_dtype, resolve_model
from launch.net import HelpFormatter, one_line_errors
from training.prompts import EVAL_PROMPTS

if TYPE_CHECKING:
    from protocol.sampling import SamplingParams
    from target_node.decoding.stats import Stats
    from target_node.model.target import TargetModel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dflash-evaluate", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--drafter", help="drafter checkpoint folder (config.json + model.safetensors)")
    ap.add_argument("--drafter-address", help="use a running draft daemon instead, e.g. tcp://127.0.0.1:5555")
    ap.add_argument(
        "--baseline", help="a second drafter folder run in the same modes, side by side (rows MODE@baseline)"
    )
    ap.add_argument("--baseline-address", help="a second running draft daemon instead, side by side")
    ap.add_argument(
        "--predraft",
        type=int,
        default=0,
        metavar="N",
        help="also run every mode with pre-drafting of N outcomes (rows MODE@predraft), through the draft daemon "
        "at --baseline-address (else --drafter-address; else in process, where it overlaps nothing)",
    )
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help='jsonl of {"prompt": ...}')
    ap.add_argument("--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", help="torch device for both models")
    ap.add_argument("--dtype", default="auto", choices=TARGET_DTYPES, help="auto: as the daemons resolve it")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument(
        "--modes",
        type=mode_names,
        default="chain",
        help="comma-separated: chain, tree:N (the drafter alone), tree:N+lookup, tree:N+store, tree:N+lookup+store "
        "(with the branches looked up in the context, in the datastore), adaptive (the daemon's default: governed "
        "trees with both branches), adaptive-lookup (without the datastore's), adaptive-drafter (with neither), "
        "adaptive-chain (default chain)",
    )
    ap.add_argument(
        "--datastore",
        default="auto",
        help="the target's earlier answers the datastore branch looks up in, as the daemon's --datastore: an "
        "answer store's folder, auto (the committed data/answers) or none",
    )
    ap.add_argument("--tree-nodes", type=int, default=16, help="the widest tree the adaptive mode may verify")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy, checked token for token")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every run of a prompt)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    ap.add_argument(
        "--json",
        default="",
        help="where to save the results (default: eval/NAME.json in the cache folder, ~/.cache/dflash-split or "
        "$DFLASH_SPLIT_CACHE; NAME the drafter folder's name or 'remote'; never inside a checkpoint folder, which "
        "may be the repository's)",
    )
    return ap.parse_args(argv)


def backend_for(args: argparse.Namespace, target, folder: str | None, address: str | None):
    from target_node.drafting.local_backend import LocalDraftBackend

    if address:
        from target_node.drafting.remote import RemoteDraftBackend

        backend = RemoteDraftBackend(address, target)
        if backend.info is None:  # an evaluation of the drafter needs the drafter, not the fallback
            raise SystemExit(f"no draft daemon answered at {address}")
        return backend
    from draft_node.checkpoint import load_drafter

    return LocalDraftBackend(load_drafter(folder, device=args.device, dtype=named_dtype(args.dtype, args.device)))


def mode_options(mode: str, tree_nodes: int, costs, datastore) -> tuple[dict, object]:  # a VerifyCosts, shared
    """A mode name's DecodeOptions fields, and its governor (None where it drafts every step).
    `adaptive` is the daemon's default (trees, the looked-up branches: the context's, and the
    datastore's where there is one); `adaptive-lookup` without the datastore; `adaptive-drafter`
    with neither; chain and tree:N measure the drafter alone, `+lookup` and `+store` add the branches."""
    from target_node.decoding.governor import Governor

    lookup, store = "+lookup" in mode, "+store" in mode
    base = mode.replace("+lookup", "").replace("+store", "")
    if base == "chain" and not (lookup or store):
        return {"adaptive": False, "tree_nodes": 0, "lookup": False}, None
    if base.startswith("tree:"):
        nodes = int(base.split(":", 1)[1]) if base.split(":", 1)[1].isdigit() else 0
        if nodes < 1:
            raise SystemExit(f"mode {mode!r}: tree:N takes a whole number of nodes N >= 1")
        return {
            "adaptive": False,
            "tree_nodes": nodes,
            "lookup": lookup,
            "datastore": datastore if store else None,
        }, None
    if base in ADAPTIVE and not (lookup or store):
        governor = Governor(max_nodes=tree_nodes, costs=costs)
        nodes = 0 if base == "adaptive-chain" else tree_nodes
        context = base in ("adaptive", "adaptive-lookup")
        return {
            "adaptive": True,
            "tree_nodes": nodes,
            "lookup": context,
            "datastore": datastore if base == "adaptive" else None,
        }, governor
    raise SystemExit(f"unknown mode {mode!r}: use chain, tree:N (+lookup, +store), {', '.join(ADAPTIVE)}")


ADAPTIVE = ("adaptive", "adaptive-lookup", "adaptive-drafter", "adaptive-chain")


def mode_names(text: str) -> str:
    """--modes, checked as it is parsed: a misspelt mode ended the run after the models loaded (an audit)."""
    for mode in (m.strip() for m in text.split(",") if m.strip()):
        try:
            mode_options(mode, 16, None, None)
        except SystemExit as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass
class Runs:
    """Kept across prompts: the governors learn as they go, and the table sums every prompt."""

    target: TargetModel
    modes: dict[str, tuple]  # name: (proposer, (DecodeOptions fields, governor or None))
    sampling: SamplingParams
    max_new: int
    totals: dict[str, Stats] = field(default_factory=dict)  # "plain" first, then the modes
    mismatches: dict[str, int] = field(default_factory=dict)
    plain_outputs: list[list[int]] = field(default_factory=list)  # each prompt's reference, for a second side's check


def prepare_runs(args: argparse.Namespace, target: TargetModel) -> Runs:
    """Every mode for the drafter, and again for the baseline: each pair with options of its own,
    since a governor learns from the drafter it watches."""
    from answers.index import datastore_for
    from protocol.sampling import SamplingParams
    from target_node.decoding.governor import VerifyCosts
    from target_node.decoding.stats import Stats
    from target_node.drafting.proposers import DFlashProposer

    proposers = {"": DFlashProposer(backend_for(args, target, args.drafter, args.drafter_address))}
    if args.baseline or args.baseline_address:
        proposers["@baseline"] = DFlashProposer(backend_for(args, target, args.baseline, args.baseline_address))
    if args.predraft:
        address = args.baseline_address or args.drafter_address
        backend = backend_for(args, target, args.baseline or args.drafter, address)
        proposers["@predraft"] = DFlashProposer(backend, predraft=args.predraft)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    datastore = datastore_for(args.datastore, target.name, vocab_size=target.vocab_size)
    costs = VerifyCosts()
    if any(m.startswith("adaptive") for m in names):
        costs.measure(target, range(1, args.tree_nodes + 2))
    modes = {
        name + tag: (proposer, mode_options(name, args.tree_nodes, costs, datastore))
        for tag, proposer in proposers.items()
        for name in names
    }
    totals = {mode: Stats() for mode in ["plain", *modes]}
    return Runs(target, modes, sampling, args.max_new_tokens, totals, dict.fromkeys(modes, 0))


def run_prompt(runs: Runs, text: str) -> dict:
    """One prompt plain (the reference), then in every mode in turn; its row of the per-prompt table."""
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import generate
    from target_node.drafting.proposers import NoProposer

    target, sampling = runs.target, runs.sampling
    ids = target.encode_chat([{"role": "user", "content": text}])
    plain = generate(target, ids, NoProposer(), DecodeOptions(runs.max_new, sampling=sampling))
    runs.totals["plain"].add(plain.stats)
    runs.plain_outputs.append(plain.tokens)
    row = {"prompt": text, "tokens": len(plain.tokens), "plain_tok_s": round(plain.stats.decode_tok_s, 2)}
    for mode, (proposer, (options, governor)) in runs.modes.items():
        spec = generate(
            target,
            ids,
            proposer,
            DecodeOptions(runs.max_new, sampling=sampling, **options),
            governor=governor,
        )
        runs.totals[mode].add(spec.stats)
        # Sampled answers differ between runs (different draws); only greedy ones must match.
        same = spec.tokens == plain.tokens or not sampling.is_greedy
        runs.mismatches[mode] += not same
        row[mode] = {"tau": round(spec.stats.tau, 3), "tok_s": round(spec.stats.decode_tok_s, 2), "same": same}
    return row


def mode_table(runs: Runs) -> dict:
    """Sums over all prompts, so long answers weigh what they cost."""
    plain_tps = runs.totals["plain"].decode_tok_s
    return {
        mode: {
            "tau": round(s.tau, 4),
            "tok_s": round(s.decode_tok_s, 2),
            "speedup": round(s.decode_tok_s / plain_tps, 3) if plain_tps and mode != "plain" else 1.0,
            "nodes_per_step": round(s.proposed / s.steps, 2) if s.steps else 0.0,
            "mismatches": runs.mismatches.get(mode, 0),
            "histogram": {str(k): v for k, v in sorted(s.histogram.items())},
            # Who drafted each drafting step ("predraft": a pre-draft's hit), and what those steps accepted
            # (every node of them, looked-up branches included).
            "drafted_steps": dict(s.sources),
            "accepted_per_step": {k: round(s.accepted_on_steps[k] / n, 3) for k, n in s.sources.items() if n},
            # Accepted drafts by who proposed them ("lookup": nodes only the looked-up continuation held).
            "accepted_by_source": dict(s.accepted_by_source),
            "propose_ms_per_step": round(1000 * s.propose_s / s.steps, 2) if s.steps else 0.0,
            # What drafting took the target on a drafting step, by who drafted (a hit: no draft to wait for).
            "propose_ms_by_source": {
                k: round(1000 * s.propose_s_by_source[k] / n, 2) for k, n in s.sources.items() if n
            },
            "verify_ms_per_step": round(1000 * s.verify_s / s.steps, 2) if s.steps else 0.0,
            "governor": s.governor,
        }
        for mode, s in runs.totals.items()
    }


def evaluate(args: argparse.Namespace) -> dict:
    from target_node.model.target import TargetModel, inexact
    from training.prompts import read_prompts

    prompts = read_prompts(args.prompts)[: args.limit or None]  # before the model loads: a bad file says so at once
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts")
    target = TargetModel.load(resolve_model(args.model), device=args.device, dtype=args.dtype)
    if not target.exact:
        raise ValueError(inexact(target))
    runs = prepare_runs(args, target)
    rows = []
    for i, text in enumerate(prompts):
        row = run_prompt(runs, text)
        rows.append(row)
        summary = " | ".join(f"{m} tau {row[m]['tau']:.2f}{'' if row[m]['same'] else ' DIFFERS'}" for m in runs.modes)
        print(f"[{i + 1}/{len(prompts)}] {summary} | {text[:40]}", flush=True)
    return {
        "drafter": args.drafter_address or str(args.drafter),
        "baseline": args.baseline_address or args.baseline,
        "prompts": len(prompts),
        "prompt_file": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "sampling": runs.sampling.to_dict(),
        "modes": mode_table(runs),
        "mismatches": sum(runs.mismatches.values()),
        "per_prompt": rows,
    }


def print_table(result: dict) -> None:
    print(f"\n{result['prompts']} prompts x {result['max_new_tokens']} new tokens, {result['threads']} threads")
    print(f"{'mode':>16} {'tau':>7} {'tok/s':>8} {'speedup':>8} {'nodes/step':>10} {'mismatches':>10}")
    for mode, m in result["modes"].items():
        print(
            f"{mode:>16} {m['tau']:7.3f} {m['tok_s']:8.2f} {m['speedup']:7.2f}x {m['nodes_per_step']:10.2f} "
            f"{m['mismatches']:10d}"
        )


def default_results_path(drafter: str | None) -> Path:
    """Under the cache, named after the drafter: a checkpoint folder may be the repository's own."""
    from target_node import CACHE_ROOT

    return CACHE_ROOT / "eval" / f"{Path(drafter).resolve().name if drafter else 'remote'}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.drafter and not args.drafter_address:
        sys.exit("give --drafter DIR or --drafter-address ADDRESS")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.monotonic()
    with one_line_errors("dflash-evaluate", CheckpointError, ValueError):
        result = evaluate(args)
    result["wall_s"] = round(time.monotonic() - start, 1)
    print_table(result)
    out = Path(args.json) if args.json else default_results_path(args.drafter)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
