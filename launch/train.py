"""Train a DFlash drafter for a local target on the target's own answers (self-distillation).

    python -m launch.train --stage gen --gen-minutes 60      # self-instruct answers into data/answers (resumable)
    python -m launch.train --stage features                  # features for answers that lack them (prefill)
    python -m launch.train --stage train --minutes 30 --out drafters/smollm2
    python -m launch.train --stage variety                   # how varied the stored prompts are
    python -m launch.train --stage average --init A --average-with B --weight 0.5 --out C  # weight-average two drafters
    python -m launch.train --stage estimate --drafters A,B      # offline chain tau on the held-out prompts' answers
    python -m launch.train --stage train --format dflash2 --init drafters/smollm2 --out NEW  # backbone, then selector
    python -m launch.train --stage selector --out drafters/smollm2-dflash2   # DFlash2: shipped backbone + selector
    python -m launch.train                                   # gen, features, train in turn

The answer store (token ids, compressed) lives in the repository under data/answers and
grows across machines: commit it. Features, optimizer state and logs are bulky and
rebuildable, so they live under ~/.cache/dflash-split/, never in the repo; only the final
public checkpoint (config.json + model.safetensors + draft_vocab.json) goes to --out.
Recorded traffic (`dflash-target-daemon --record DIR`) is more data: `--data DIR`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from launch.common import named_dtype, resolve_model
from protocol import FLOAT_DTYPES
from protocol.tensors import torch_dtype
from target_node import CACHE_ROOT
from training.answer_store import STORE
from training.prompts import EVAL_PROMPTS

ROOT = Path(__file__).resolve().parent.parent
STARTER = ROOT.parent / "shared" / "prompts" / "train.jsonl"  # the starter prompts beside the repo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="dflash-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct, converted once into the cache)"
    )
    ap.add_argument("--name", default="smollm2", help="cache folder name under ~/.cache/dflash-split/train/")
    ap.add_argument(
        "--stage",
        choices=["gen", "features", "train", "all", "vocab", "variety", "average", "estimate", "selector"],
        default="all",
        help="vocab: only (re)write --out's draft vocabulary from the stored answers; "
        "average: write (1 - w) * --init + w * --average-with to --out; "
        "estimate: score --drafters offline on the target's answers to --prompts and on the store's held-out answers; "
        "selector: a DFlash2 drafter at --out from the DFlash drafter --init (default the shipped one), its selector "
        "trained on the backbone's outputs",
    )
    ap.add_argument("--cache", default=str(CACHE_ROOT), help="where features, state and logs go (default %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    # data
    ap.add_argument("--store", default=str(STORE), help="answer store folder (generation appends here)")
    ap.add_argument("--data", action="append", default=[], help="more answer folders to train on (recorded traffic)")
    ap.add_argument("--starter", default=str(STARTER), help="extra prompts file (jsonl), answered first if present")
    ap.add_argument(
        "--gen-dtype",
        choices=("auto", *FLOAT_DTYPES),
        default="auto",
        help="target dtype for generation; auto: bf16 on a GPU or a CPU with native bf16 (2.3x the answers "
        "of fp32 on an AVX512-BF16 EPYC core), else fp32; bf16 answers get their features by fp32 prefill",
    )
    ap.add_argument("--gen-batch", type=int, default=64, help="rows decoded at once (finished rows are refilled)")
    ap.add_argument("--max-new", type=int, default=192, help="answer token cap")
    ap.add_argument("--gen-minutes", type=float, default=60.0)
    ap.add_argument("--gen-seed", type=int, default=0, help="seed of the self-instruct job stream")
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
    ap.add_argument(
        "--conv-lr-scale", type=float, default=1.0, help="DFlash2: the convolutions' learning rate relative to --lr"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-answers", type=int, default=60, help="held-out answers for acceptance estimates")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="train on the answers whose features are cached, without first computing the rest (--stage features)",
    )
    ap.add_argument("--resume", action="store_true", help="continue from the cache's state.pt")
    ap.add_argument(
        "--init",
        help="start from this drafter checkpoint's weights (same shape, or fewer layers: grown to --layers), or "
        "'target:L1,L2,...' (one per --layers): each drafter layer starts as that target decoder layer",
    )
    ap.add_argument("--average-with", help="--stage average: the second drafter checkpoint")
    ap.add_argument("--weight", type=float, default=0.5, help="--stage average: the second drafter's share")
    ap.add_argument("--drafters", default="", help="--stage estimate: comma-separated drafter checkpoints")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="--stage estimate: held-out prompts (jsonl)")
    ap.add_argument("--estimate-tokens", type=int, default=160, help="--stage estimate: answer length")
    ap.add_argument(
        "--format",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="the checkpoint format trained: dflash2 adds a convolution around every sublayer, trained with the "
        "backbone (from a DFlash --init it starts as the identity), and a candidate selector, trained on the "
        "backbone's outputs once it is done (the --selector-* flags)",
    )
    ap.add_argument(
        "--selector-rank", type=int, default=0, help="DFlash2 codebook rank (0: the published 256, at most the width)"
    )
    ap.add_argument("--selector-top-k", type=int, default=0, help="DFlash2 candidates per position (0: 16)")
    ap.add_argument("--selector-steps", type=int, default=400, help="DFlash2 selector: optimizer steps")
    ap.add_argument("--selector-lr", type=float, default=3e-3, help="DFlash2 selector: learning rate")
    ap.add_argument("--selector-batches", type=int, default=40, help="DFlash2 selector: batches of rows it learns on")
    ap.add_argument("--out", default=str(ROOT / "drafters" / "smollm2"), help="public checkpoint folder")
    ap.add_argument("--save-dtype", choices=FLOAT_DTYPES, default="bfloat16", help="checkpoint weights dtype")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="the drafter proposes from the N most frequent answer tokens (0: all)",
    )
    return ap.parse_args(argv)


def log_to(path: Path):
    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(path, "a") as fh:
            fh.write(line + "\n")

    return log


def generate_stage(args: argparse.Namespace, target, cfg, store, features, log, ranks) -> None:
    """Self-instruct answers into the store, until --gen-minutes have passed; rank r of a torchrun
    job answers the job stream of seed --gen-seed + r (streams of different seeds do not overlap)."""
    from training.generate import generate
    from training.prompts import jobs, read_prompts

    deadline = time.time() + args.gen_minutes * 60
    starter = read_prompts(args.starter) if args.starter and Path(args.starter).is_file() else []
    log(
        f"gen: {target.model.dtype}, batch {args.gen_batch}, max_new {args.max_new}, {args.threads} threads, "
        f"taps {list(cfg.target_layer_ids)}, until {time.strftime('%H:%M:%S', time.localtime(deadline))}"
    )
    generate(
        target,
        store,
        jobs(args.gen_seed + ranks.rank, starter=starter if ranks.main else []),
        seed=args.gen_seed + ranks.rank,
        batch=args.gen_batch,
        max_new=args.max_new,
        deadline=deadline,
        features=features,
        layer_ids=cfg.target_layer_ids,
        log=log,
    )


def train_stage(args: argparse.Namespace, target, cfg, answers, features, work: Path, log, ranks) -> None:
    from training.trainer import TrainOptions, train

    # Every training flag is named after its TrainOptions field; only the dtype needs parsing.
    given = {f.name: getattr(args, f.name) for f in fields(TrainOptions) if hasattr(args, f.name)}
    given["save_dtype"] = torch_dtype(args.save_dtype)
    opts = TrainOptions(**given)
    out = Path(args.out)
    state = work / "state.pt"
    trainer = train(
        target, cfg, answers, features, opts, state, out, resume=args.resume, init=args.init, log=log, ranks=ranks
    )
    if cfg.dflash2 and ranks.main:  # the backbone is done: its selector learns on its outputs
        from training.selector import train_selector

        train_selector(trainer, args.selector_batches, args.selector_steps, args.selector_lr, log)
        trainer.save(work / "state.pt", out)
        log(f"DFlash2 drafter -> {out}")


def average_stage(args: argparse.Namespace, log) -> None:
    from draft_node.checkpoint import load_drafter, save_drafter
    from training.average import average_drafters

    if not (args.init and args.average_with):
        raise SystemExit("--stage average needs --init A and --average-with B")
    drafter = average_drafters(load_drafter(args.init), load_drafter(args.average_with), args.weight)
    save_drafter(drafter.to(torch_dtype(args.save_dtype)), args.out)
    log(f"average: {1 - args.weight:g} x {args.init} + {args.weight:g} x {args.average_with} -> {args.out}")


def estimate_stage(args: argparse.Namespace, target, store, cache: Path, log) -> None:
    """Each drafter's chain acceptance, offline, on the same blocks: the held-out prompts' answers, the store's.

    The target answers --prompts once (greedy, kept under the cache, keyed by the prompts and
    the model); features come by prefill for each drafter's taps.
    """
    import hashlib

    from draft_node.checkpoint import load_drafter
    from training.answer_store import AnswerStore
    from training.features import FeatureCache
    from training.generate import generate
    from training.prompts import Ask, HeldOut, read_prompts
    from training.trainer import estimate

    if not args.drafters:
        raise SystemExit("--stage estimate needs --drafters A[,B...]")
    prompts = read_prompts(args.prompts)
    tag = hashlib.sha1(json.dumps([prompts, args.estimate_tokens]).encode()).hexdigest()[:10]
    folder = cache / "estimate" / f"{Path(args.model).name}-{Path(args.prompts).stem}-{tag}"
    answers = AnswerStore(folder / "answers")
    asks = (Ask(f"estimate-{i}", "answer", (("user", p),)) for i, p in enumerate(prompts))
    generate(target, answers, asks, batch=len(prompts), max_new=args.estimate_tokens, held_out=HeldOut(), log=log)
    held_out = [a for a in store.answers if a.held_out]
    rows = ["| drafter | held-out prompts' answers | store held-out answers |", "|---|---|---|"]
    for path in args.drafters.split(","):
        drafter = load_drafter(path)
        taps, width = "-".join(map(str, drafter.config.target_layer_ids)), drafter.config.feature_width
        groups = (
            (answers.answers, FeatureCache(folder / f"features-taps{taps}", width)),
            (held_out, FeatureCache(cache / "features" / f"{Path(args.model).name}-taps{taps}", width)),
        )
        scores = []
        for group, features in groups:
            features.fill(group, target.model, drafter.config.target_layer_ids, log=None)
            result = estimate(target, drafter, group, features)
            walk = f", walk {result['selector_tau']:.3f}" if "selector_tau" in result else ""
            scores.append(f"{result['tau']:.3f}{walk} ({sum(result['histogram'])} blocks)" if result else "-")
        rows.append(f"| {path} | {scores[0]} | {scores[1]} |")
    log("chain tau, estimated offline:\n" + "\n".join(rows))


def selector_stage(args: argparse.Namespace, target, answers, cache: Path, log) -> None:
    """A DFlash2 drafter from a trained drafter (--init, default the shipped one): the same
    backbone (a DFlash one gains identity convolutions) and a selector trained on its block rows
    (training.selector)."""
    from draft_node.checkpoint import load_drafter, save_draft_vocab, save_drafter
    from launch.common import SHIPPED_DRAFTER
    from training.features import FeatureCache
    from training.selector import train_selector
    from training.trainer import Trainer, TrainOptions, as_dflash2, export_drafter

    backbone = load_drafter(args.init or SHIPPED_DRAFTER)
    drafter = as_dflash2(backbone.float(), target.vocab_size, args.selector_rank, args.selector_top_k)
    cfg = drafter.config
    taps = "-".join(map(str, cfg.target_layer_ids))
    features = FeatureCache(cache / "features" / f"{Path(args.model).name}-taps{taps}", cfg.feature_width)
    # The answers whose features are cached (--stage features fills the rest): the backbone's rows need them.
    log(f"selector: {sum(a.key in features for a in answers)} of {len(answers)} answers have cached features")
    opts = TrainOptions(
        batch=args.batch, anchors=args.anchors, max_len=args.max_len, seed=args.seed, val_answers=args.val_answers,
        draft_vocab=0,
    )  # fmt: skip
    trainer = Trainer(target, cfg, answers, features, opts)
    trainer.use_vocabulary(list(backbone.draft_vocab or []))
    trainer.init_from(drafter)
    train_selector(trainer, args.selector_batches, args.selector_steps, args.selector_lr, log)
    out = Path(args.out)
    save_drafter(export_drafter(trainer.drafter, trainer.scale).to(torch_dtype(args.save_dtype)), out)
    if backbone.draft_vocab:
        save_draft_vocab(out, list(backbone.draft_vocab))
    log(f"selector: DFlash2 drafter -> {out}")


def main(argv: list[str] | None = None) -> None:
    from training.distributed import start, stop

    args = parse_args(argv)
    args.model = str(resolve_model(args.model))
    torch.set_num_threads(args.threads)
    ranks, args.device = start(args.device)  # under torchrun: this rank's place and device
    try:
        run_stages(args, ranks)
    finally:
        stop(ranks)


def run_stages(args: argparse.Namespace, ranks) -> None:
    """The stages --stage names, on this rank: generation and features sharded by rank, training
    data-parallel, everything else (one-process work) on rank 0 alone."""
    from draft_node.checkpoint import save_draft_vocab
    from target_node.model.target import TargetModel
    from training.answer_store import AnswerStore
    from training.features import FeatureCache

    cache = Path(args.cache)
    work = cache / "train" / args.name
    work.mkdir(parents=True, exist_ok=True)
    log = log_to(work / "train.log") if ranks.main else _rank_log(ranks)
    store = AnswerStore(args.store)
    if ranks.many and args.stage not in ("gen", "features", "train", "all"):
        raise SystemExit(f"--stage {args.stage} runs in one process; torchrun runs gen, features and train")
    if args.stage == "variety":
        from training.variety import report

        print(json.dumps(report(store.answers), indent=2))
        return
    if args.stage == "average":
        average_stage(args, log)
        return

    # Generation may run the target in bf16 (a GPU, a CPU with native bf16); features and
    # training use fp32, as inference does.
    generating = args.stage in ("gen", "all")
    dtype = named_dtype(args.gen_dtype, args.device) if generating else torch.float32
    target = TargetModel.load(args.model, args.device, dtype)
    cfg = drafter_config(args, target)
    layers = "-".join(map(str, cfg.target_layer_ids))
    features = FeatureCache(cache / "features" / f"{Path(args.model).name}-taps{layers}", cfg.feature_width)
    if generating:
        full_precision = target.model.dtype == torch.float32
        generate_stage(args, target, cfg, store, features if full_precision else None, log, ranks)
        if not full_precision:
            target = TargetModel.load(args.model, args.device, torch.float32)
    answers = list(store.answers)
    for folder in args.data:
        answers += [a for a in AnswerStore(folder).answers if a.key not in store.keys]
    if args.stage == "features" or (args.stage in ("train", "all") and not args.cached_only):
        added = features.fill(answers[ranks.rank :: ranks.world], target.model, cfg.target_layer_ids, log=log)
        ranks.barrier()  # every rank's rows are in before any trains on them
        features = FeatureCache(features.folder, cfg.feature_width)
        log(f"features: {added} answers filled by prefill; {len(features)} cached")
    if args.stage == "estimate":
        estimate_stage(args, target, store, cache, log)
        return
    if args.stage == "selector":
        selector_stage(args, target, answers, cache, log)
        return
    if args.stage == "vocab":
        from training.trainer import draft_vocabulary, samples

        ids = draft_vocabulary(samples([a for a in answers if not a.held_out], features), args.draft_vocab)
        log(f"draft vocabulary: {len(ids)} tokens -> {save_draft_vocab(args.out, ids)}")
    if args.stage in ("train", "all"):
        train_stage(args, target, cfg, answers, features, work, log, ranks)


def drafter_config(args: argparse.Namespace, target):
    """The drafter this run trains, for `target`, from the shape flags."""
    from draft_node.checkpoint import config_for_target

    taps = [int(x) for x in args.taps.split(",")] if args.taps else None
    cfg = config_for_target(
        target.config,
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=taps,
        mask_token_id=args.mask_token_id,
        dflash2=args.format == "dflash2",
    )
    if not cfg.dflash2:
        return cfg
    return replace(
        cfg,
        selector_rank=args.selector_rank or cfg.selector_rank,
        selector_top_k=args.selector_top_k or cfg.selector_top_k,
    )


def _rank_log(ranks):
    """Ranks other than 0 print their lines (prefixed) but leave the log file to rank 0."""

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [rank {ranks.rank}] {msg}", flush=True)

    return log


if __name__ == "__main__":
    main()
