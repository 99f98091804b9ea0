"""Train a DFlash drafter for a local target on the target's own answers (self-distillation).

    python -m launch.train --stage gen --gen-minutes 60      # self-instruct answers into data/answers (resumable)
    python -m launch.train --stage features                  # features for answers that lack them (prefill)
    python -m launch.train --stage train --minutes 30 --out drafters/smollm2
    python -m launch.train --stage variety                   # how varied the stored prompts are
    python -m launch.train --stage average --init A --average-with B --weight 0.5 --out C  # weight-average two drafters
    python -m launch.train --stage grow --init A --layers 8 --out C  # A's drafts at an 8-layer drafter's cost
    python -m launch.train --stage estimate --drafters A,B      # offline chain tau on the held-out prompts' answers
    python -m launch.train --stage train --format dflash2 --init drafters/smollm2 --out NEW --name d2  # then selector
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
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from answers.store import STORE
from basics.processes import a_torchrun_rank_ends_with_its_launcher
from launch.common import at_least, device_name, layer_ids, named_dtype, number_in, resolve_model
from launch.net import HelpFormatter, one_line_errors
from launch.processes import ctrl_c_exits_130, ends_on_sigterm
from protocol import FLOAT_DTYPES
from protocol.messages import MAX_BLOCK_SIZE
from protocol.tensors import torch_dtype
from target_node import CACHE_ROOT
from target_node.model.default_model import SHIPPED_DRAFTER
from training.prompts import EVAL_PROMPTS

if TYPE_CHECKING:
    from training.run_options import RunOptions

ROOT = Path(__file__).resolve().parent.parent
STARTER = ROOT.parent / "shared" / "prompts" / "train.jsonl"  # the starter prompts beside the repo


@ends_on_sigterm  # SIGTERM or SIGHUP ends a run through its clean-up: generation writes out its answers
@ctrl_c_exits_130
def main(argv: list[str] | None = None) -> None:
    """Run the stages --stage names (training.stages), on this rank of a torchrun job or alone.
    While training steps run, a signal stops the run after the step under way, saved
    (training.stopping); elsewhere it ends the run at once through its clean-up: a generation
    stage writes out the answers it finished (it lost them all: an audit)."""
    a_torchrun_rank_ends_with_its_launcher()  # before the imports: a launcher killed meanwhile went unseen
    args = parse_args(argv)  # --help and a flag's refusal before torch loads: a tenth of a second, not three
    if args.model:  # a folder that holds no model, likewise (the default one is converted once the flags pass)
        with one_line_errors("dflash-train"):
            resolve_model(args.model)
    import torch

    from answers.store import AnswerStoreError
    from draft_node.config import CheckpointError
    from training.distributed import start, stop
    from training.features import FeatureCacheError
    from training.stages import run_stages
    from training.stopping import Stopped
    from training.trainer import TrainingError

    options = run_options(args)
    with one_line_errors("dflash-train", CheckpointError, TrainingError, FeatureCacheError, AnswerStoreError):
        model = resolve_model(options.run.model)
        torch.set_num_threads(options.run.threads)
        ranks, device = start(options.run.device)  # under torchrun: this rank's place and device
        try:
            gen_dtype = named_dtype(options.generation.dtype, device)  # "auto" as this rank's device has it
            run = replace(options.run, model=model, device=device)
            options = replace(options, run=run, generation=replace(options.generation, dtype=gen_dtype))
            run_stages(options, ranks)
        except Stopped as exc:
            if ranks.main:  # one line for the run, as its log is rank 0's
                sys.stderr.write(f"dflash-train: {exc}\n")
            raise SystemExit(128 + exc.signum) from None
        finally:
            stop(ranks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, in the order --help lists them; `--stage selector` starts from the shipped drafter
    unless --init names another."""
    ap = argparse.ArgumentParser(prog="dflash-train", description=__doc__, formatter_class=HelpFormatter)
    groups = (_run_flags, _data_flags, _shape_flags, _objective_flags, _schedule_flags, _feature_flags, _stage_flags)
    for add in (*groups, _dflash2_flags, _output_flags):
        add(ap)
    args = ap.parse_args(argv)
    for folder in args.data:  # a mistyped folder trained on nothing more, silently
        if not Path(folder).is_dir():
            ap.error(f"--data {folder}: no such folder")
    if args.stage not in ("gen", "all", "average", "grow") and not Path(args.store).is_dir():  # gen makes one
        ap.error(f"--store {args.store}: no such folder")
    if args.resume and args.restart:
        ap.error("--resume continues the run, --restart starts it over: one of them")
    if args.stage == "average" and not (args.init and args.average_with):
        ap.error("--stage average needs --init A and --average-with B")
    if args.stage == "grow" and not args.init:
        ap.error("--stage grow needs --init A (and --layers N)")
    if args.stage == "selector" and not args.init:
        args.init = SHIPPED_DRAFTER
    if args.out is None:  # a run's drafter stays beside its state until someone ships it
        args.out = str(Path(args.cache) / "train" / args.name / "drafter")
    return args


def run_options(args: argparse.Namespace) -> RunOptions:
    """The parsed flags as the typed options every stage reads: the one place a flag becomes a field."""
    from training.run_options import (
        DrafterShape,
        FeatureSource,
        Generation,
        RunOptions,
        RunSetup,
        SelectorSchedule,
        StageInputs,
    )
    from training.trainer import TrainOptions  # it imports transformers, which --help can do without

    # Every schedule, objective and checkpoint flag is named after its TrainOptions field; the
    # rank's device decides the rest (training.stages).
    per_rank = {"device", "autocast", "loader_threads"}
    given = {f.name: getattr(args, f.name) for f in fields(TrainOptions) if hasattr(args, f.name)}
    given = {k: v for k, v in given.items() if k not in per_rank}
    training = TrainOptions(**given | {"save_dtype": torch_dtype(args.save_dtype), "out": Path(args.out)})
    model = Path(args.model) if args.model else None
    drafters = tuple(map(Path, args.drafters.split(","))) if args.drafters else ()
    return RunOptions(
        run=RunSetup(
            stage=args.stage, name=args.name, cache=Path(args.cache), model=model, device=args.device,
            threads=args.threads, restart=args.restart,
        ),
        generation=Generation(
            store=Path(args.store), extra_stores=tuple(map(Path, args.data)),
            starter=Path(args.starter) if args.starter else None, dtype=args.gen_dtype,
            feature_dtype=args.feature_dtype, batch=args.gen_batch, max_new=args.max_new, minutes=args.gen_minutes,
            seed=args.gen_seed,
        ),
        shape=DrafterShape(
            layers=args.layers, block_size=args.block_size, taps=tuple(args.taps), mask_token_id=args.mask_token_id,
            format=args.format, selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
        ),
        features=FeatureSource(
            choice=args.features, cached_only=args.cached_only, fill_minutes=args.feature_minutes,
            autocast_choice=args.autocast, loader_threads_choice=args.loader_threads,
        ),
        selector=SelectorSchedule(steps=args.selector_steps, lr=args.selector_lr, batches=args.selector_batches),
        stage_inputs=StageInputs(
            average_with=Path(args.average_with) if args.average_with else None, weight=args.weight,
            drafters=drafters, prompts=Path(args.prompts), estimate_tokens=args.estimate_tokens,
        ),
        training=training,
    )  # fmt: skip


def _run_flags(ap: argparse.ArgumentParser) -> None:
    """What runs, where, and what it is called: the target, the stage, the cache, the device."""
    ap.add_argument(
        "--model", help="local HF folder of the target (default: SmolLM2-135M-Instruct, converted once into the cache)"
    )
    ap.add_argument("--name", default="smollm2", help="the run's folder under --cache's train/ (its state, its log)")
    ap.add_argument(
        "--stage",
        choices=["gen", "features", "train", "all", "vocab", "variety", "average", "grow", "estimate", "selector"],
        default="all",
        help="vocab: only (re)write --out's draft vocabulary from the stored answers; "
        "average: write (1 - w) * --init + w * --average-with to --out; "
        "grow: write --init grown to --layers layers to --out (the added layers add nothing: the same drafts, "
        "the deeper drafter's cost); "
        "estimate: score --drafters offline on the target's answers to --prompts and on the store's held-out answers; "
        "selector: a DFlash2 drafter at --out from the DFlash drafter --init (default the shipped one), its selector "
        "trained on the backbone's outputs",
    )
    ap.add_argument("--cache", default=str(CACHE_ROOT), help="where features, state and logs go (default %(default)s)")
    ap.add_argument("--device", type=device_name, default="cpu", help="torch device for the target and the drafter")
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (default %(default)s)")


def _data_flags(ap: argparse.ArgumentParser) -> None:
    """Where answers come from and go, and how generation makes them."""
    ap.add_argument("--store", default=str(STORE), help="answer store folder (generation appends here)")
    ap.add_argument("--data", action="append", default=[], help="more answer folders to train on (recorded traffic)")
    ap.add_argument("--starter", default=str(STARTER), help="extra prompts file (jsonl), answered first if present")
    ap.add_argument(
        "--gen-dtype",
        choices=("auto", *FLOAT_DTYPES),
        default="auto",
        help="target dtype for generation; auto: bf16 on a GPU or a CPU with native bf16 (2.3x the answers "
        "of fp32 on an AVX512-BF16 EPYC core), else fp32; answers in the --feature-dtype get their features "
        "as they are generated, others by prefill",
    )
    ap.add_argument(
        "--feature-dtype",
        choices=("auto", *FLOAT_DTYPES),
        default="auto",
        help="dtype the target computes the drafter's features in, on its engine, as the target daemon "
        "serves them; auto: as the daemon's --dtype auto (bf16 where the device computes it natively and "
        "the engine runs the model, else fp32). Training reads the target's embeddings and head in it too",
    )
    ap.add_argument(
        "--gen-batch", type=at_least(1), default=64, help="rows decoded at once (finished rows are refilled)"
    )
    ap.add_argument("--max-new", type=at_least(1), default=192, help="answer token cap")
    ap.add_argument("--gen-minutes", type=number_in(0), default=60.0, help="minutes of answer generation (--stage gen)")
    ap.add_argument("--gen-seed", type=int, default=0, help="seed of the self-instruct job stream")


def _shape_flags(ap: argparse.ArgumentParser) -> None:
    """The drafter's shape."""
    ap.add_argument(
        "--layers", type=at_least(1), default=1, help="drafter layers (a new drafter; --stage grow: the target depth)"
    )
    ap.add_argument(
        "--block-size",
        type=at_least(2, MAX_BLOCK_SIZE),
        default=8,
        help="tokens a drafted block holds (its anchor included)",
    )
    ap.add_argument(
        "--taps", type=layer_ids, default=[], help="comma-separated target layer ids (default: spread over depth)"
    )
    ap.add_argument("--mask-token-id", type=at_least(0), default=0, help="token id of the block's mask slots")


def _objective_flags(ap: argparse.ArgumentParser) -> None:
    """What a step learns from: the slots' loss weights, the blocks' form, the answers drawn."""
    ap.add_argument(
        "--slot-weights",
        choices=["decay", "acceptance"],
        default="decay",
        help="decay: slot k weighs exp(-(k-1)/gamma); acceptance: as much as the expected accepted length "
        "grows with its log-probability (D-PACE), recomputed every step",
    )
    ap.add_argument(
        "--gamma", type=number_in(0, above=True), default=4.0, help="--slot-weights decay: the decay's length"
    )
    ap.add_argument(
        "--mix",
        choices=["answers", "jobs"],
        default="answers",
        help="draw answers uniformly, or each job kind at its share of the generator's job mix",
    )
    ap.add_argument(
        "--known",
        type=number_in(0, 1),
        default=0.0,
        help="share of blocks given 1..B-2 of the tokens after their anchor (a pre-draft's form); no loss there",
    )
    ap.add_argument(
        "--distill",
        type=number_in(0, 1),
        default=0.0,
        help="share of the loss that is the KL divergence from the target's distribution (0: its greedy "
        "token alone); features then cache the target's last layer too, in a folder of their own",
    )


def _schedule_flags(ap: argparse.ArgumentParser) -> None:
    """Optimization: the schedule, the batches, evaluation and saving, and where training starts."""
    ap.add_argument("--lr", type=number_in(0, above=True), default=1e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=at_least(0), default=100, help="steps of linear warm-up to --lr")
    ap.add_argument("--steps", type=at_least(1), default=100000, help="schedule length (cosine to 10%% of lr)")
    ap.add_argument(
        "--minutes",
        type=number_in(0),
        default=0.0,
        help="stop training after this long, the schedule's cosine ending then if --steps would end later "
        "(0: run all steps)",
    )
    ap.add_argument("--batch", type=at_least(1), default=8, help="sequences per step")
    ap.add_argument("--anchors", type=at_least(1), default=24, help="anchors (blocks) per sequence")
    ap.add_argument("--max-len", type=at_least(3), default=320, help="longest sequence used (tokens)")
    ap.add_argument(
        "--conv-lr-scale",
        type=number_in(0),
        default=1.0,
        help="DFlash2: the convolutions' learning rate relative to --lr",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of initialisation, anchors and batch order")
    ap.add_argument("--val-answers", type=at_least(0), default=60, help="held-out answers for acceptance estimates")
    ap.add_argument("--eval-every", type=at_least(0), default=200, help="steps between validation losses")
    ap.add_argument(
        "--save-every", type=at_least(0), default=200, help="steps between checkpoints (resumable with --resume)"
    )
    ap.add_argument("--resume", action="store_true", help="continue from the cache's state.pt")
    ap.add_argument(
        "--restart", action="store_true", help="start --name's run over, replacing its saved state (else refused)"
    )
    ap.add_argument(
        "--init",
        help="start from this drafter checkpoint's weights (same shape, or fewer layers: grown to --layers), or "
        "'target:L1,L2,...' (one per --layers): each drafter layer starts as that target decoder layer",
    )


def _feature_flags(ap: argparse.ArgumentParser) -> None:
    """Where a step's feature rows and batches come from, and how a step computes."""
    ap.add_argument(
        "--features",
        choices=("auto", "cache", "live"),
        default="auto",
        help="where training's feature rows come from: the cache (filled by prefill first), or the target's "
        "forward on each batch as it trains, stored nowhere (no fill, no disk, the whole store); auto: live on "
        "a GPU, where that forward is cheap against a step, the cache on a CPU, where it is not",
    )
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="train on the answers whose features are cached, without first computing the rest (--stage features)",
    )
    ap.add_argument(
        "--feature-minutes",
        type=number_in(0),
        default=0.0,
        help="stop filling features after this long and train on what is cached (0: fill them all)",
    )
    ap.add_argument(
        "--autocast",
        choices=["auto", "on", "off"],
        default="auto",
        help="train the drafter's forward in bf16 autocast; auto: where the device computes bf16 natively",
    )
    ap.add_argument(
        "--loader-threads",
        type=at_least(-1),
        default=-1,
        help="threads building the next batches while a step runs; -1: 4 on a GPU (where copying the "
        "batch's feature rows bounds the step), none on a CPU (they would take its cores)",
    )


def _stage_flags(ap: argparse.ArgumentParser) -> None:
    """What only --stage average and --stage estimate read."""
    ap.add_argument("--average-with", help="--stage average: the second drafter checkpoint")
    ap.add_argument("--weight", type=number_in(0, 1), default=0.5, help="--stage average: the second drafter's share")
    ap.add_argument("--drafters", default="", help="--stage estimate: comma-separated drafter checkpoints")
    ap.add_argument("--prompts", default=str(EVAL_PROMPTS), help="--stage estimate: held-out prompts (jsonl)")
    ap.add_argument("--estimate-tokens", type=at_least(1), default=160, help="--stage estimate: answer length")


def _dflash2_flags(ap: argparse.ArgumentParser) -> None:
    """The checkpoint format, and DFlash2's selector."""
    ap.add_argument(
        "--format",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="the checkpoint format trained: dflash2 adds a convolution around every sublayer, trained with the "
        "backbone (from a DFlash --init it starts as the identity), and a candidate selector, trained on the "
        "backbone's outputs once it is done (the --selector-* flags)",
    )
    ap.add_argument(
        "--selector-rank",
        type=at_least(0),
        default=0,
        help="DFlash2 codebook rank (0: the published 256, at most the width)",
    )
    ap.add_argument("--selector-top-k", type=at_least(0), default=0, help="DFlash2 candidates per position (0: 16)")
    ap.add_argument("--selector-steps", type=at_least(0), default=400, help="DFlash2 selector: optimizer steps")
    ap.add_argument(
        "--selector-lr", type=number_in(0, above=True), default=3e-3, help="DFlash2 selector: learning rate"
    )
    ap.add_argument(
        "--selector-batches", type=at_least(1), default=40, help="DFlash2 selector: batches of rows it learns on"
    )


def _output_flags(ap: argparse.ArgumentParser) -> None:
    """The public checkpoint: where it goes, its dtype, its draft vocabulary."""
    ap.add_argument(
        "--out",
        help="public checkpoint folder (default: drafter/ in --name's cache folder; never the shipped drafter "
        "unless named: copy a drafter there once it has measured better)",
    )
    ap.add_argument("--save-dtype", choices=FLOAT_DTYPES, default="bfloat16", help="checkpoint weights dtype")
    ap.add_argument(
        "--draft-vocab",
        type=at_least(0),
        default=8192,
        help="the drafter proposes from the N most frequent answer tokens (0: all)",
    )


if __name__ == "__main__":
    main()
