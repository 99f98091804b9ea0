"""Train a DFlash drafter for a local target: generate self-distillation data, then train.

    python -m launch.train --stage gen --gen-minutes 60      # answers + features, resumable
    python -m launch.train --stage train --minutes 30 --out drafters/smollm2
    python -m launch.train                                   # both, one after the other

Everything bulky (answers, features, optimizer state, logs) lives under
~/.cache/dflash-split/train/<name>/, never in the repo; only the final public checkpoint
(config.json + model.safetensors) is written to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch

from target_node.default_model import CACHE_ROOT, DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
STARTER = ROOT.parent / "shared" / "prompts" / "train.jsonl"  # the starter prompts beside the repo
EVAL = ROOT / "data" / "eval_prompts.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local HF folder of the target")
    ap.add_argument("--name", default="smollm2", help="cache folder name under ~/.cache/dflash-split/train/")
    ap.add_argument(
        "--stage",
        choices=["gen", "train", "all", "vocab"],
        default="all",
        help="vocab: only (re)write --out's draft vocabulary from the cached answers",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    # data
    ap.add_argument("--prompts", type=int, default=20000, help="size of the built prompt set")
    ap.add_argument("--starter", default=str(STARTER), help="extra prompts file (jsonl), used first if present")
    ap.add_argument("--gen-dtype", choices=["bf16", "fp32"], default="bf16", help="target dtype for generation")
    ap.add_argument("--gen-batch", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--gen-minutes", type=float, default=60.0)
    # drafter shape
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--taps", default="", help="comma-separated target layer ids (default: spread over depth)")
    ap.add_argument("--mask-token-id", type=int, default=0)
    # optimization
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100000, help="schedule length (cosine to 10%% of lr)")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: run all steps)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=24, help="anchors (blocks) per sequence")
    ap.add_argument("--max-len", type=int, default=320, help="longest sequence used (tokens)")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-answers", type=int, default=60, help="cached answers held out for acceptance estimates")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--resume", action="store_true", help="continue from the cache's state.pt")
    ap.add_argument("--out", default=str(ROOT / "drafters" / "smollm2"), help="public checkpoint folder")
    ap.add_argument("--save-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="the drafter proposes from the N most frequent answer tokens (0: all)",
    )
    return ap.parse_args(argv)


def log_to(path: Path):  # noqa: ANN201
    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(path, "a") as fh:
            fh.write(line + "\n")

    return log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from draft_node.checkpoint import config_for_target
    from draft_node.prompts import build_prompts, read_prompts
    from draft_node.train_data import AnswerStore, generate_answers
    from target_node.target import TargetModel

    work = CACHE_ROOT / "train" / args.name
    work.mkdir(parents=True, exist_ok=True)
    log = log_to(work / "train.log")
    gen_bf16 = args.gen_dtype == "bf16" and args.stage in ("gen", "all")
    dtype = torch.bfloat16 if gen_bf16 else torch.float32
    target = TargetModel.load(args.model, device=args.device, dtype=dtype)
    taps = [int(x) for x in args.taps.split(",")] if args.taps else None
    cfg = config_for_target(
        target.config,
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=taps,
        mask_token_id=args.mask_token_id,
    )
    meta_path = work / "meta.json"
    meta = {"model": str(args.model), "target_layer_ids": list(cfg.target_layer_ids), "max_new": args.max_new}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old["target_layer_ids"] != meta["target_layer_ids"]:
            raise SystemExit(f"{work} holds features for taps {old['target_layer_ids']}; use another --name")
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    # Training alone opens the store read-only: a generator may still be appending to it.
    store = AnswerStore(work / "data", cfg.feature_width, readonly=args.stage in ("train", "vocab"))

    if args.stage == "vocab":
        from draft_node.checkpoint import save_draft_vocab
        from draft_node.train_data import draft_vocabulary

        ids = draft_vocabulary(store.records, args.draft_vocab)
        log(f"draft vocabulary: {len(ids)} tokens -> {save_draft_vocab(args.out, ids)}")
        return

    if args.stage in ("gen", "all"):
        held_out = set(read_prompts(EVAL)) if EVAL.exists() else set()
        prompts = build_prompts(args.prompts, seed=args.seed, starter=args.starter, exclude=held_out)
        deadline = time.time() + args.gen_minutes * 60
        log(
            f"gen: {len(prompts)} prompts, taps {list(cfg.target_layer_ids)}, {args.gen_dtype}, "
            f"batch {args.gen_batch}, max_new {args.max_new}, {args.threads} threads, until "
            f"{time.strftime('%H:%M:%S', time.localtime(deadline))}"
        )
        generate_answers(
            target,
            prompts,
            store,
            cfg.target_layer_ids,
            batch=args.gen_batch,
            max_new=args.max_new,
            deadline=deadline,
            log=log,
        )
        log(f"gen done: {len(store.records)} answers, {store.answer_tokens} answer tokens")

    if args.stage in ("train", "all"):
        from draft_node.train import TrainOptions, train

        if gen_bf16:  # the drafter trains against the fp32 embeddings and head that inference uses
            target = TargetModel.load(args.model, device=args.device, dtype=torch.float32)
        # Every training flag is named after its TrainOptions field; only the dtype needs parsing.
        given = {f.name: getattr(args, f.name) for f in fields(TrainOptions) if hasattr(args, f.name)}
        given["save_dtype"] = torch.bfloat16 if args.save_dtype == "bf16" else torch.float32
        opts = TrainOptions(**given)
        train(target, cfg, store, opts, work / "state.pt", Path(args.out), resume=args.resume, log=log)


if __name__ == "__main__":
    main()
