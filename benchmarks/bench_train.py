"""How fast a drafter trains: labelled positions per second of a whole training step, by setting.

Each setting (drafter depth x bf16 autocast) gets a `Trainer` over the same answers, and the
settings take turns, `--steps` optimizer steps each per round, so a shared machine's drift falls
on all of them alike. A labelled position is a block slot with a loss (a target token to learn);
the step is the whole of it: the batch built from the cache, the forward, the head, the
backward and AdamW. The first step of each setting warms up and is not counted.

Features come from the cache `--stage features` fills (the same folder); answers that lack them
get them first by prefill, up to `--answers` of them.

    python -m benchmarks.bench_train --layers 1,4 --autocast off,on --batch 8 --rounds 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_kernels import native_bf16
from draft_node.checkpoint import config_for_target
from launch.common import resolve_model
from target_node import CACHE_ROOT
from target_node.model.target import TargetModel
from training.answer_store import STORE, AnswerStore
from training.features import FeatureCache, feature_folder
from training.trainer import Trainer, TrainOptions


@dataclass
class Setting:
    layers: int
    autocast: bool
    trainer: Trainer
    rates: list[float]

    @property
    def name(self) -> str:
        return f"{self.layers} layer(s), autocast {'on' if self.autocast else 'off'}"


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF folder of the target (default: SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--layers", default="1,4", help="comma-separated drafter depths")
    ap.add_argument("--autocast", default="off,on", help="comma-separated: off, on (bf16 autocast of the forward)")
    ap.add_argument("--batch", type=int, default=8, help="answers per step")
    ap.add_argument("--anchors", type=int, default=24, help="blocks per answer")
    ap.add_argument("--answers", type=int, default=300, help="answers to train on (features filled where missing)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting per round")
    ap.add_argument("--store", default=str(STORE), help="answer store folder")
    ap.add_argument("--cache", default=str(CACHE_ROOT), help="where the feature cache is (features/ under it)")
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
    features = FeatureCache(folder, base.feature_width)
    answers = [a for a in AnswerStore(Path(args.store)).answers if not a.held_out][: args.answers]
    added = features.fill(answers, target, base.target_layer_ids, log=None)
    features = FeatureCache(features.folder, base.feature_width)
    print(f"{len(answers)} answers ({added} filled now); cpu native bf16: {native_bf16()}")
    settings = []
    for n in depths:
        for cast in autocasts:
            opts = TrainOptions(
                batch=args.batch, anchors=args.anchors, autocast=cast, device=args.device, val_answers=0
            )
            settings.append(Setting(n, cast, Trainer(target, cfgs[n], answers, features, opts), []))
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
            "positions_s": round(statistics.median(s.rates), 1),
            "vs_first": round(statistics.median(s.rates) / first, 2),
            "rounds": [round(x, 1) for x in s.rates],
        }
        for s in settings
    ]
    print(f"\n{'setting':>28} {'positions/s':>12} {'vs first':>9}")
    for s, row in zip(settings, rows, strict=True):
        print(f"{s.name:>28} {row['positions_s']:>12} {row['vs_first']:>8}x")
    if args.json:
        result = {"threads": args.threads, "batch": args.batch, "anchors": args.anchors, "native_bf16": native_bf16()}
        Path(args.json).write_text(json.dumps(result | {"settings": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
