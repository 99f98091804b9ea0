"""Does a drafter earn its keep? Plain greedy vs speculative decoding over a prompt file.

    python -m launch.evaluate --drafter drafters/smollm2 --prompts data/eval_prompts.jsonl

Every prompt runs twice through the same loop: once with no proposer (the reference) and
once with the DFlash drafter (in process, or a draft daemon via --drafter-address). The
speculative output must equal the reference token for token; a mismatch is counted and
reported, never hidden. Speed is decode tokens per second (prefill excluded), summed over
all prompts, so long answers weigh what they cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from launch.common import dtype_of, resolve_model
from protocol import FLOAT_DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", help="drafter checkpoint folder (config.json + model.safetensors)")
    ap.add_argument("--drafter-address", help="use a running draft daemon instead, e.g. tcp://127.0.0.1:5555")
    ap.add_argument("--prompts", default="data/eval_prompts.jsonl", help='jsonl of {"prompt": ...}')
    ap.add_argument("--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="let the loop's governor skip drafting when it does not pay (default: always draft, "
        "which measures the drafter itself)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy, checked token for token")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the same for both runs of a prompt)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    ap.add_argument("--json", default="", help="where to save the results (default: next to the drafter)")
    return ap.parse_args(argv)


def backend_for(args: argparse.Namespace, target):
    from target_node.proposers import LocalDraftBackend

    if args.drafter_address:
        from target_node.remote import RemoteDraftBackend

        return RemoteDraftBackend(args.drafter_address, target)
    from draft_node.checkpoint import load_drafter

    return LocalDraftBackend(load_drafter(args.drafter, device=args.device, dtype=dtype_of(args)))


def evaluate(args: argparse.Namespace) -> dict:
    from target_node.proposers import DFlashProposer, NoProposer
    from target_node.speculative import generate
    from target_node.stats import Stats
    from target_node.target import TargetModel
    from training.prompts import read_prompts

    target = TargetModel.load(resolve_model(args.model), device=args.device, dtype=dtype_of(args))
    prompts = read_prompts(args.prompts)[: args.limit or None]
    proposer = DFlashProposer(backend_for(args, target))
    from target_node.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    # Sampled answers differ between the two runs (different draws); only greedy ones must match.
    from target_node.governor import Governor

    # One governor across prompts, as the target daemon keeps one across requests.
    extra = {"adaptive": args.adaptive, "sampling": sampling, "governor": Governor()}
    plain_total, spec_total = Stats(), Stats()
    mismatches = 0
    rows = []
    for i, text in enumerate(prompts):
        ids = target.encode_chat([{"role": "user", "content": text}])
        plain = generate(target, ids, NoProposer(), args.max_new_tokens, sampling=sampling)
        spec = generate(target, ids, proposer, args.max_new_tokens, **extra)
        same = spec.tokens == plain.tokens or not sampling.is_greedy
        mismatches += not same
        plain_total.add(plain.stats)
        spec_total.add(spec.stats)
        rows.append(
            {
                "prompt": text,
                "tokens": len(spec.tokens),
                "tau": round(spec.stats.tau, 3),
                "identical": same,
                "steps": spec.stats.steps,
                "plain_steps": spec.stats.plain_steps,
                "plain_tok_s": round(plain.stats.decode_tok_s, 2),
                "spec_tok_s": round(spec.stats.decode_tok_s, 2),
            }
        )
        print(
            f"[{i + 1}/{len(prompts)}] tau {spec.stats.tau:.2f} | {len(spec.tokens)} tok | "
            f"{plain.stats.decode_tok_s:.1f} -> {spec.stats.decode_tok_s:.1f} tok/s"
            f"{'' if same else ' | OUTPUT DIFFERS'} | {text[:50]}",
            flush=True,
        )
    plain_tps, spec_tps = plain_total.decode_tok_s, spec_total.decode_tok_s
    return {
        "drafter": args.drafter_address or str(args.drafter),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "sampling": sampling.to_dict(),
        "tau": round(spec_total.tau, 4),
        "histogram": {str(k): v for k, v in sorted(spec_total.histogram.items())},
        "plain_tok_s": round(plain_tps, 2),
        "spec_tok_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3) if plain_tps else 0.0,
        "mismatches": mismatches,
        "per_prompt": rows,
    }


def print_table(result: dict) -> None:
    width = max(result["histogram"].values(), default=1)
    print(f"\n{'prompts':>14} {result['prompts']}\n{'tau':>14} {result['tau']:.3f}")
    print(f"{'plain tok/s':>14} {result['plain_tok_s']:.1f}\n{'spec tok/s':>14} {result['spec_tok_s']:.1f}")
    print(f"{'speedup':>14} {result['speedup']:.2f}x\n{'mismatches':>14} {result['mismatches']}")
    print("accepted drafts per step:")
    for k, v in result["histogram"].items():
        print(f"{k:>14} {v:6d} {'#' * max(1, round(40 * v / width))}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.drafter and not args.drafter_address:
        sys.exit("give --drafter DIR or --drafter-address ADDRESS")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    result = evaluate(args)
    result["wall_s"] = round(time.time() - start, 1)
    print_table(result)
    if args.json:
        out = Path(args.json)
    elif args.drafter:
        out = Path(args.drafter) / "eval.json"
    else:
        from target_node.default_model import CACHE_ROOT

        out = CACHE_ROOT / "eval" / "remote.json"
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
