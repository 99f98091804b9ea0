"""The stages of a training run, as `launch.train --stage` names them, on one rank.

They read the run's options (`training.run_options.RunOptions`, which `launch.train.run_options`
builds from the flags): each field is a flag's, so the command, its docs and these stages say one
thing. `launch.train` fills in what the flags leave to the machine before any stage runs: the
target's folder, the dtype "auto" names on this rank's device, the drafter `--stage selector`
starts from.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from answers.store import Answer, AnswerStore
from basics.files import claimed
from dflash_kernels import computes_bf16
from draft_node.checkpoint import config_for_target, load_drafter, save_draft_vocab, save_drafter
from draft_node.config import DFlashConfig
from target_node.engine.engine import batch_engine
from target_node.model.target import TargetModel
from training.average import average_drafters
from training.batches import draft_vocabulary, samples
from training.distributed import ONE, Ranks
from training.drafter_starts import as_dflash2, export_drafter, grown_drafter
from training.estimate import estimate, kind_table
from training.features import FeatureCache, LiveFeatures, feature_folder
from training.generate import GenerateOptions, generate
from training.prompts import Ask, HeldOut, jobs, read_prompts
from training.run_options import DrafterShape, RunOptions, StageInputs
from training.selector import train_selector
from training.trainer import TARGET_INIT, Trainer, TrainingError, TrainOptions, saved_state, train
from training.variety import report

Log = Callable[[str], None]


def log_to(path: Path) -> Log:
    """Rank 0's log: each line on the terminal and appended to `path`, where it outlives the run."""

    failed = [False]

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        try:
            with open(path, "a") as fh:
                fh.write(line + "\n")
        except OSError as exc:  # a full disk ended the run here, between its saves (an audit)
            if not failed[0]:
                said = f"cannot append to {path} ({exc.strerror}): lines go to the terminal until it can"
                print(f"{line[:8]} {said}", flush=True)
            failed[0] = True

    return log


def _rank_log(ranks: Ranks) -> Log:
    """Ranks other than 0 print their lines (prefixed) but leave the log file to rank 0."""

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [rank {ranks.rank}] {msg}", flush=True)

    return log


def run_stages(options: RunOptions, ranks: Ranks) -> None:
    """The stages --stage names, on this rank, the run's folder held by rank 0 alone: a second run
    of one --name trained beside the first, each rewriting the other's state.pt and drafter (an
    audit)."""
    work = options.run.cache / "train" / options.run.name
    work.mkdir(parents=True, exist_ok=True)
    with claimed(work) if ranks.main else nullcontext(True) as alone:
        if not alone:
            raise TrainingError(
                f"--name {options.run.name}: another run works in {work} now; give this one another --name"
            )
        _run_stages(options, ranks, work)


def _run_stages(options: RunOptions, ranks: Ranks, work: Path) -> None:
    """Generation and features sharded by rank, training data-parallel, everything else
    (one-process work) on rank 0 alone."""
    run, gen, source = options.run, options.generation, options.features
    log = log_to(work / "train.log") if ranks.main else _rank_log(ranks)
    check_run(options, ranks)
    if run.stage in ("variety", "average", "grow"):
        offline_stage(options, log)
        return
    # The target as the daemon serves it on this device (--feature-dtype "auto": bf16 where the
    # device computes it natively and the engine runs the model), with as many engine slots as
    # generation decodes rows at once (slots cost memory only once used). Its engine computes the
    # features, so the drafter trains on the rows serving feeds it; training reads its embeddings
    # and head (in fp32 from here on: the values serving projects through).
    target = TargetModel.load(run.model, run.device, gen.feature_dtype, slots=gen.batch)
    cfg = drafter_config(options.shape, target)
    if run.stage in ("train", "all") and options.training.resume:  # refused now, not after hours of feature fill
        saved_state(work / "state.pt", cfg)
    # Distillation reads the target's last layer too, cached beside the drafter's taps.
    taps = tuple(cfg.target_layer_ids) + ((target.config.num_hidden_layers - 1,) if options.training.distill else ())
    width = len(taps) * target.config.hidden_size
    folder = feature_folder(run.cache, run.model, taps, target.model.dtype)
    hold = run.stage != "gen"  # generation alone reads no answer back: their keys and totals do
    features, store = FeatureCache(folder, width, model=run.model), AnswerStore(gen.store, hold=hold)
    if run.stage in ("gen", "all"):
        generate_stage(options, target, taps, store, features, log, ranks)
        if ranks.many:  # every rank's answers and rows, not its own alone: rank 0 trained on half of them
            ranks.barrier()
            store, features = AnswerStore(gen.store, hold=hold), FeatureCache(folder, width, model=run.model)
    answers = list(store.answers)
    for extra in gen.extra_stores:
        answers += [a for a in AnswerStore(extra).answers if a.key not in store.keys]
    live = run.stage in ("train", "all") and live_features(source.choice, run.device)
    if run.stage == "features" or (run.stage in ("train", "all") and not source.cached_only and not live):
        deadline = time.monotonic() + source.fill_minutes * 60 if source.fill_minutes else None
        mine = answers[ranks.rank :: ranks.world]
        rows = rows_per_forward(run.device)
        added = features.fill(mine, target, taps, batch_tokens=rows, deadline=deadline, log=log)
        ranks.barrier()  # every rank's rows are in before any trains on them
        features = FeatureCache(folder, width, model=run.model)
        log(f"features: {added} answers filled by prefill; {len(features)} cached")
    if run.stage in ("estimate", "selector", "vocab"):
        target_stage(options, target, store, answers, log)
    if run.stage in ("train", "all"):
        if ranks.many:  # a store or cache that grew while the ranks read it: what every rank holds
            common = ranks.common({a.key for a in answers if live or a.key in features})
            answers = [a for a in answers if a.key in common]
        rows_from = LiveFeatures(target, taps, batch_tokens=rows_per_forward(run.device)) if live else features
        log(f"features: live, from the target's forward on each batch ({run.device})" if live else "features: cached")
        train_stage(options, target, cfg, answers, rows_from, work, log, ranks)


def check_run(options: RunOptions, ranks: Ranks) -> None:
    """What would fail only after minutes of work, refused before any."""
    run, training = options.run, options.training
    if ranks.many and run.stage not in ("gen", "features", "train", "all"):
        raise SystemExit(f"--stage {run.stage} runs in one process; torchrun runs gen, features and train")
    if ranks.many and run.stage in ("train", "all") and training.batch < ranks.world:
        raise TrainingError(f"--batch {training.batch} gives {ranks.world} ranks nothing to share: at least one each")
    state = run.cache / "train" / run.name / "state.pt"
    if run.stage in ("train", "all") and state.exists() and not (training.resume or run.restart):
        # A run that forgot --resume replaced a 4,000-step state with its own, silently (an audit).
        raise TrainingError(f"--name {run.name} has a run already ({state}): --resume it, or --restart it from scratch")
    if run.stage in ("train", "all") and training.init and not str(training.init).startswith(TARGET_INIT):
        load_drafter(training.init)  # a bad --init ends the run before any feature fill, not after it


def offline_stage(options: RunOptions, log: Log) -> None:
    """The stages that need no target: variety, average, grow."""
    if options.run.stage == "variety":
        print(json.dumps(report(AnswerStore(options.generation.store).answers), indent=2))
    elif options.run.stage == "average":
        average_stage(options.training, options.stage_inputs, log)
    else:
        grow_stage(options.training, options.shape, log)


def target_stage(options: RunOptions, target: TargetModel, store: AnswerStore, answers: list[Answer], log: Log) -> None:
    """The one-process stages that read the target: estimate, selector, vocab."""
    if options.run.stage == "estimate":
        estimate_stage(options, target, store, log)
    elif options.run.stage == "selector":
        selector_stage(options, target, answers, log)
    else:
        # The answers' own tokens: counting only those with cached features wrote [] for a fresh
        # cache, which reads as the whole vocabulary (an audit).
        ids = draft_vocabulary(samples([a for a in answers if not a.held_out], None), options.training.draft_vocab)
        if not ids:
            raise TrainingError(f"--stage vocab: no answer tokens in {options.generation.store}")
        log(f"draft vocabulary: {len(ids)} tokens -> {save_draft_vocab(options.training.out, ids)}")


def rows_per_forward(device: str) -> int:
    """The rows of a feature prefill's forward (padding counted): a GPU wants many."""
    return 65536 if device.startswith("cuda") else 4096


def live_features(choice: str, device: str) -> bool:
    """--features: `auto` computes them live on a GPU (a prefill there outruns the drafter's step, and
    the cache would outgrow its disk), from the cache on a CPU (a prefill there costs more than the
    step it feeds: docs/training.md)."""
    return choice == "live" or (choice == "auto" and device.startswith("cuda"))


def drafter_config(shape: DrafterShape, target: TargetModel) -> DFlashConfig:
    """The drafter this run trains, for `target`, from the shape flags."""
    cfg = config_for_target(
        target.config,
        num_layers=shape.layers,
        block_size=shape.block_size,
        taps=list(shape.taps) or 5,
        mask_token_id=shape.mask_token_id,
        dflash2=shape.format == "dflash2",
    )
    if not cfg.dflash2:
        return cfg
    return replace(
        cfg,
        selector_rank=shape.selector_rank or cfg.selector_rank,
        selector_top_k=shape.selector_top_k or cfg.selector_top_k,
    )


def generate_stage(
    options: RunOptions,
    target: TargetModel,
    taps: tuple[int, ...],
    store: AnswerStore,
    features: FeatureCache,
    log: Log,
    ranks: Ranks,
) -> None:
    """Self-instruct answers into the store, until --gen-minutes have passed; rank r of a torchrun
    job answers the job stream of seed --gen-seed + r (streams of different seeds do not overlap).
    The target writes them where it is in --gen-dtype and decodes a batch at once, and its answers'
    features come for free; else a target that does (where "auto" declines the device, the engine
    all the same: the transformers path decodes one row at a time) writes, and prefill fills them."""
    run, gen = options.run, options.generation
    engine = batch_engine(run.device)
    same = gen.dtype == target.model.dtype and (target.slots >= gen.batch or engine is None)
    load = {"engine": engine, "slots": gen.batch}
    writer = target if same else TargetModel.load(run.model, run.device, gen.dtype, **load)
    deadline = time.monotonic() + gen.minutes * 60  # a clock that steps (NTP, a suspend) moves no deadline
    starter = read_prompts(gen.starter) if gen.starter and gen.starter.is_file() else []
    log(
        f"gen: {writer.model.dtype}, batch {gen.batch}, max_new {gen.max_new}, threads {run.threads}, "
        f"taps {list(taps)}, until {time.strftime('%H:%M:%S', time.localtime(time.time() + gen.minutes * 60))}"
    )
    seed = gen.seed + ranks.rank
    opts = GenerateOptions(seed=seed, batch=gen.batch, max_new=gen.max_new, deadline=deadline)
    openings = jobs(seed, starter=starter if ranks.main else [])
    generate(writer, store, openings, opts, features=features if same else None, layer_ids=taps, log=log)


def train_stage(
    options: RunOptions,
    target: TargetModel,
    cfg: DFlashConfig,
    answers: list[Answer],
    features: FeatureCache | LiveFeatures,
    work: Path,
    log: Log,
    ranks: Ranks,
) -> None:
    """Train the drafter on every rank (its state under `work`, its checkpoint at --out); a DFlash2
    drafter's selector then learns on the finished backbone's outputs, on rank 0."""
    device, choices = options.run.device, options.features
    opts = replace(
        options.training,
        device=device,
        autocast=autocast(choices.autocast_choice, device),
        loader_threads=loader_threads(choices.loader_threads_choice, device),
    )
    trainer = train(target, cfg, answers, features, opts, work / "state.pt", log=log, ranks=ranks)
    if cfg.dflash2 and ranks.main:  # the backbone is done: its selector learns on its outputs
        trainer.ranks = ONE  # rank 0 alone, on whole batches: it learnt on rank 0's shares (an audit)
        selector = options.selector
        train_selector(trainer, selector.batches, selector.steps, selector.lr, log)
        trainer.save(work / "state.pt", opts.out)
        log(f"DFlash2 drafter -> {opts.out}")


def loader_threads(choice: int, device: str) -> int:
    """--loader-threads: -1 is 4 threads beside a GPU (a 64 x 48 batch is 117 MB of feature rows to
    copy, far more time than the GPU's step), none on a CPU, whose cores compute the steps."""
    if choice >= 0:
        return choice
    return min(4, max((os.cpu_count() or 1) - 1, 1)) if device.startswith("cuda") else 0


def autocast(choice: str, device: str) -> bool:
    """--autocast: `auto` trains under bf16 autocast where the device computes bf16 natively (CUDA,
    a CPU with AVX512-BF16 or AMX; on AVX2 bf16 matmuls are several times slower than fp32)."""
    if choice != "auto":
        return choice == "on"
    return computes_bf16(device)


def average_stage(training: TrainOptions, inputs: StageInputs, log: Log) -> None:
    """(1 - --weight) x --init + --weight x --average-with, saved at --out (training.average); both
    named (dflash-train refuses them missing)."""
    if not (training.init and inputs.average_with):
        raise TrainingError("--stage average needs --init A and --average-with B")
    drafter = average_drafters(load_drafter(training.init), load_drafter(inputs.average_with), inputs.weight)
    save_drafter(drafter.to(training.save_dtype), training.out)
    log(
        f"average: {1 - inputs.weight:g} x {training.init} + {inputs.weight:g} x {inputs.average_with} "
        f"-> {training.out}"
    )


def grow_stage(training: TrainOptions, shape: DrafterShape, log: Log) -> None:
    """--init grown to --layers layers (training.drafter_starts.grown_drafter), saved at --out."""
    if not training.init:  # dflash-train refuses it missing
        raise TrainingError("--stage grow needs --init A (and --layers N)")
    drafter = load_drafter(training.init)
    try:
        grown = grown_drafter(drafter, shape.layers)
    except ValueError as exc:
        raise SystemExit(f"--stage grow: {exc}") from exc
    save_drafter(grown.to(training.save_dtype), training.out)
    log(f"grow: {training.init} ({drafter.config.num_hidden_layers} layers) -> {training.out} ({shape.layers} layers)")


def estimate_stage(options: RunOptions, target: TargetModel, store: AnswerStore, log: Log) -> None:
    """Each drafter's chain acceptance, offline, on the same blocks: the held-out prompts' answers, the store's.

    The target answers --prompts once (greedy, kept under the cache, keyed by the prompts, the
    model and its dtype); features come by prefill for each drafter's taps.
    """
    inputs, cache, model = options.stage_inputs, options.run.cache, options.run.model
    if not inputs.drafters:
        raise SystemExit("--stage estimate needs --drafters A[,B...]")
    dtype = target.model.dtype
    answers, folder = prompts_answers(target, model, inputs.prompts, inputs.estimate_tokens, cache, log)
    held_out = [a for a in store.answers if a.held_out]
    rows = ["| drafter | held-out prompts' answers | store held-out answers |", "|---|---|---|"]
    kinds: dict[str, dict] = {}  # drafter -> the store's held-out answers' tau by kind
    for path in inputs.drafters:
        drafter = load_drafter(path)
        taps, width = "-".join(map(str, drafter.config.target_layer_ids)), drafter.config.feature_width
        groups = (
            (answers.answers, FeatureCache(folder / f"features-taps{taps}", width, model=model)),
            (
                held_out,
                FeatureCache(feature_folder(cache, model, drafter.config.target_layer_ids, dtype), width, model=model),
            ),
        )
        scores = []
        for group, features in groups:
            # The first run on a store may fill features for hundreds of held-out answers: it says so.
            features.fill(group, target, drafter.config.target_layer_ids, log=log)
            result = estimate(target, drafter, group, features)
            walk = f", walk {result['selector_tau']:.3f}" if "selector_tau" in result else ""
            scores.append(f"{result['tau']:.3f}{walk} ({sum(result['histogram'])} blocks)" if result else "-")
        kinds[str(path)] = result.get("by_kind", {}) if result else {}  # the store's: the last group scored
        rows.append(f"| {path} | {scores[0]} | {scores[1]} |")
    log("chain tau, estimated offline:\n" + "\n".join(rows))
    log("the store's held-out answers by kind:\n" + "\n".join(kind_table(kinds)))


def prompts_answers(
    target: TargetModel, model: str | Path, prompts_path: str | Path, tokens: int, cache: Path, log: Log
) -> tuple[AnswerStore, Path]:
    """The target's greedy answers to held-out prompts (`tokens` each), generated once and kept
    under the cache, keyed by the prompts, the model and its dtype; and the folder that holds them."""
    prompts = read_prompts(prompts_path)
    tag = hashlib.sha1(json.dumps([prompts, tokens, str(target.model.dtype)]).encode()).hexdigest()[:10]
    folder = cache / "estimate" / f"{Path(model).name}-{Path(prompts_path).stem}-{tag}"
    answers = AnswerStore(folder / "answers")
    asks = (Ask(f"estimate-{i}", "answer", (("user", p),)) for i, p in enumerate(prompts))
    opts = GenerateOptions(batch=len(prompts), max_new=tokens, held_out=HeldOut())
    generate(target, answers, asks, opts, log=log)
    return answers, folder


def selector_stage(options: RunOptions, target: TargetModel, answers: list[Answer], log: Log) -> None:
    """A DFlash2 drafter from a trained drafter (--init, which `launch.train` defaults to the shipped
    one): the same backbone (a DFlash one gains identity convolutions) and a selector trained on its
    block rows (training.selector)."""
    shape, selector, training = options.shape, options.selector, options.training
    backbone = load_drafter(training.init)
    drafter = as_dflash2(backbone.float(), target.vocab_size, shape.selector_rank, shape.selector_top_k)
    cfg = drafter.config
    folder = feature_folder(options.run.cache, options.run.model, cfg.target_layer_ids, target.model.dtype)
    features = FeatureCache(folder, cfg.feature_width, model=options.run.model)
    # The answers whose features are cached (--stage features fills the rest): the backbone's rows need them.
    log(f"selector: {sum(a.key in features for a in answers)} of {len(answers)} answers have cached features")
    opts = TrainOptions(
        batch=training.batch, anchors=training.anchors, max_len=training.max_len, seed=training.seed,
        val_answers=training.val_answers, draft_vocab=0,
    )  # fmt: skip
    trainer = Trainer(target, cfg, answers, features, opts)
    trainer.use_vocabulary(list(backbone.draft_vocab or []))
    trainer.init_from(drafter)
    train_selector(trainer, selector.batches, selector.steps, selector.lr, log)
    exported = export_drafter(trainer.drafter, trainer.scale).to(training.save_dtype)
    exported.draft_vocab = list(backbone.draft_vocab or [])
    save_drafter(exported, training.out)
    log(f"selector: DFlash2 drafter -> {training.out}")
