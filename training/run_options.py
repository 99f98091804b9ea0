"""A training run's options, as `launch.train` parses them: one frozen object the stages read.

The groups mirror the command's flag groups, so a flag, its `--help` line and the field a stage
reads say one thing. The schedule and the objective keep their one home, `TrainOptions`: the run
carries one rather than a second copy of its fields. What only the rank's device decides (the
device itself, the generation dtype "auto" names) `launch.train` fills in with `dataclasses.replace`
once the rank has joined its job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from training.trainer import TrainOptions


@dataclass(frozen=True)
class RunSetup:
    """What runs, where, and under which name: a run's state and log live under `cache`/train/`name`."""

    stage: str
    name: str
    cache: Path
    model: Path | None  # None until `launch.train` resolves it: the default target, converted once
    device: str  # the flag's until the rank's: under torchrun each rank takes its local GPU
    threads: int
    restart: bool  # replace the saved state of `name`'s run, which is otherwise refused


@dataclass(frozen=True)
class Generation:
    """Where answers come from and go, and how the target writes them (--stage gen)."""

    store: Path
    extra_stores: tuple[Path, ...]  # --data: recorded traffic, trained on, never appended to
    starter: Path | None  # answered first where the file exists
    dtype: str | torch.dtype  # the flag's name ("auto") until resolved on the rank's device
    feature_dtype: str  # as the target daemon's --dtype: the features the drafter is served are these
    batch: int
    max_new: int
    minutes: float
    seed: int  # rank r answers the job stream of seed + r


@dataclass(frozen=True)
class DrafterShape:
    """The drafter a run builds: the shape flags and the checkpoint format."""

    layers: int
    block_size: int
    taps: tuple[int, ...]  # empty: five target layers spread over depth
    mask_token_id: int
    format: str  # "dflash" or "dflash2"
    selector_rank: int  # 0: the format's own default
    selector_top_k: int  # 0: the format's own default


@dataclass(frozen=True)
class FeatureSource:
    """Where a step's feature rows come from and how a step computes; the choices stay as the flags
    name them, since only the rank's device resolves "auto" (`training.stages`)."""

    choice: str  # "auto", "cache" or "live"
    cached_only: bool
    fill_minutes: float  # 0: fill every answer's features
    autocast_choice: str  # "auto", "on" or "off"
    loader_threads_choice: int  # -1: as the device suits


@dataclass(frozen=True)
class SelectorSchedule:
    """How DFlash2's selector learns on a finished backbone's outputs."""

    steps: int
    lr: float
    batches: int


@dataclass(frozen=True)
class StageInputs:
    """What only --stage average and --stage estimate read."""

    average_with: Path | None
    weight: float  # the second drafter's share of the average
    drafters: tuple[Path, ...]
    prompts: Path
    estimate_tokens: int


@dataclass(frozen=True)
class RunOptions:
    """Everything a run's stages read. `training` holds the schedule, the objective and the drafter's
    start and checkpoint (--init, --resume, --out, --save-dtype, --draft-vocab); its device, autocast
    and loader threads are the rank's, which `training.stages` fills in as training starts."""

    run: RunSetup
    generation: Generation
    shape: DrafterShape
    features: FeatureSource
    selector: SelectorSchedule
    stage_inputs: StageInputs
    training: TrainOptions
