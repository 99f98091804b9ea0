"""How fast a drafter trains: labelled positions per second of a whole training step, by setting.

Each setting (drafter depth x bf16 autocast) gets a `Trainer` over the same answers, and the
settings take turns, `--steps` optimizer steps each per round, so a shared machine's drift falls
on all of them alike. A labelled position is a block slot with a loss (a target token to learn);
the step is the whole of it: the batch built from the cache, the forward, the head, the
backward and AdamW. The first step of each setting warms up and is not counted.

Features come from the cache `--stage features` fills (the same folder); answers that lack them
get them first by prefill, up to `--answers` of them. `--features cache,live` also times steps whose
features the target computes for each batch (`launch.train --features live`), the prefill inside
the step.

    python -m benchmarks.bench_train --layers 1,4 --autocast off,on --batch 8 --rounds 3 --steps 4

`--loader-threads 0,2,4` times the batches alone instead, built by that many threads ahead
(training.loader), in turns: on a GPU the copy of their feature rows, not the drafter, bounds a
step, so batches/s against the GPU's steps/s says how many threads a run needs.

    python -m benchmarks.bench_train --batch 64 --anchors 48 --loader-threads 0,1,2 --steps 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from answers.store import STORE, AnswerStore
from dflash_kernels import native_bf16
from draft_node.checkpoint import config_for_target
from launch.common import resolve_model
from launch.net import HelpFormatter
from target_node import CACHE_ROOT
from target_node.model.target import TargetModel
from training.features import FeatureCache, LiveFeatures, feature_folder
from training.loader import BatchStream
from training.trainer import Trainer, TrainOptions


@dataclass
class Setting:
    layers: int
    autocast: bool
    trainer: Trainer
    rates: list[float]
    features: str = "cache"

    @property
    def name(self) -> str:
        return f"{self.layers} layer(s), autocast {'on' if self.autocast else 'off'}, {self.features}"


def labelled(trainer: Trainer) -> int:
    """The loss-bearing slots of the batch the trainer's next step draws (batches depend only on the step)."""
    return int((trainer.batch(trainer.step).labels[..., 1:] >= 0).sum())


def timed_steps(setting: Setting, steps: int) -> float:
    trainer, positions = setting.trainer, 0
    elapsed = 0.0
    for _ in range(steps):
        positions += labelled(trainer)
        began = time.perf_counter()
        trainer.train_step()
        elapsed += time.perf_counter() - began
    return positions / elapsed


def batch_rate(trainer: Trainer, threads: int, first: int, steps: int) -> float:
    """Batches per second of steps [first, first + steps), taken in order from `threads` threads."""
    began = time.perf_counter()
    with BatchStream(trainer.batch, first, threads) as batches:
        for step in range(first, first + steps):
            batches.take(step)
    return steps / (time.perf_counter() - began)


def loader_rates(trainer: Trainer, counts: list[int], rounds: int, steps: int) -> list[dict]:
    """Each thread count's batches/s, in turns; each run takes steps no run took before (no batch
    comes from a warm cache the previous run left, beyond what the page cache holds)."""
    rates: dict[int, list[float]] = {n: [] for n in counts}
    first = 0
    for r in range(rounds):
        for n in counts:
            rates[n].append(batch_rate(trainer, n, first, steps))
            first += steps
        print(f"round {r + 1}: " + ", ".join(f"{n} thread(s) {rates[n][-1]:.2f} batches/s" for n in counts))
    megabytes = trainer.batch(0).features.numel() * 2 / 1e6
    return [
        {"threads": n, "batches_s": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v]}
        for n, v in rates.items()
    ] + [{"feature_mb_per_batch": round(megabytes, 3)}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_train",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default=None, help="local HF folder of the target (default: SmolLM2)")
    ap.add_argument("--device", default="cpu", help="where the drafter trains (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--layers", default="1,4", help="comma-separated drafter depths")
    ap.add_argument("--autocast", default="off,on", help="comma-separated: off, on (bf16 autocast of the forward)")
    ap.add_argument(
        "--features", default="cache", help="comma-separated: cache, live (the target's prefill in the step)"
    )
    ap.add_argument("--batch", type=int, default=8, help="answers per step")
    ap.add_argument("--anchors", type=int, default=24, help="blocks per answer")
    ap.add_argument("--answers", type=int, default=300, help="answers to train on (features filled where missing)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every setting")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting per round")
    ap.add_argument("--store", default=str(STORE), help="answer store folder")
    ap.add_argument("--cache", default=str(CACHE_ROOT), help="where the feature cache is (features/ under it)")
    ap.add_argument("--loader-threads", default="", help="e.g. 0,1,2: time building batches alone, by threads")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    target = TargetModel.load(model, args.device, "auto", slots=16)  # as launch.train loads it
    depths = [int(x) for x in args.layers.split(",")]
    autocasts = [x.strip() == "on" for x in args.autocast.split(",")]
    cfgs = {n: config_for_target(target.config, num_layers=n) for n in depths}
    base = cfgs[depths[0]]
    folder = feature_folder(args.cache, model, base.target_layer_ids, target.model.dtype)
    features = FeatureCache(folder, base.feature_width, model=model)
    answers = [a for a in AnswerStore(Path(args.store)).answers if not a.held_out][: args.answers]
    added = features.fill(answers, target, base.target_layer_ids, log=None)
    features = FeatureCache(features.folder, base.feature_width, model=model)
    print(f"{len(answers)} answers ({added} filled now); cpu native bf16: {native_bf16()}")
    if args.loader_threads:
        opts = TrainOptions(batch=args.batch, anchors=args.anchors, device=args.device, val_answers=0)
        counts = [int(x) for x in args.loader_threads.split(",")]
        rows = loader_rates(Trainer(target, base, answers, features, opts), counts, args.rounds, args.steps)
        print(json.dumps(rows))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"batch": args.batch, "anchors": args.anchors, "loader": rows}) + "\n"
            )
        return
    sources = {"cache": features, "live": LiveFeatures(target, base.target_layer_ids)}
    settings = []
    for n in depths:
        for cast in autocasts:
            for source in args.features.split(","):
                opts = TrainOptions(
                    batch=args.batch, anchors=args.anchors, autocast=cast, device=args.device, val_answers=0
                )
                trainer = Trainer(target, cfgs[n], answers, sources[source.strip()], opts)
                settings.append(Setting(n, cast, trainer, [], source.strip()))
    for setting in settings:
        setting.trainer.train_step()  # warm-up
    for r in range(args.rounds):
        for setting in settings:
            setting.rates.append(timed_steps(setting, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{s.name} {s.rates[-1]:.0f}" for s in settings))
    first = statistics.median(settings[0].rates)
    rows = [
        {
            "layers": s.layers,
            "autocast": s.autocast,
            "features": s.features,
            "positions_s": round(statistics.median(s.rates), 1),
            "vs_first": round(statistics.median(s.rates) / first, 2),
            "rounds": [round(x, 1) for x in s.rates],
        }
        for s in settings
    ]
    print(f"\n{'setting':>35} {'positions/s':>12} {'vs first':>9}")
    for s, row in zip(settings, rows, strict=True):
        print(f"{s.name:>35} {row['positions_s']:>12} {row['vs_first']:>8}x")
    if args.json:
        result = {"threads": args.threads, "batch": args.batch, "anchors": args.anchors, "native_bf16": native_bf16()}
        Path(args.json).write_text(json.dumps(result | {"settings": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
