"""A drafter's acceptance, estimated offline on answers with cached features.

It needs both the trainer (the count `Trainer.evaluate` makes) and the selector's walk
(`training.selector.chain_tau`), and the selector builds on the trainer: so it lives here, above
both, and the imports run one way.
"""

from __future__ import annotations

from draft_node.model import DFlashDrafter
from training.answer_store import Answer
from training.features import FeatureCache
from training.selector import chain_tau
from training.trainer import Trainer, TrainOptions, samples


def estimate(
    target,  # a TargetModel (its embedding table and LM head)
    drafter: DFlashDrafter,
    answers: list[Answer],
    features: FeatureCache,
    anchors: int = 100,
) -> dict:
    """A drafter's greedy-chain acceptance on `answers` (held out or not), offline; a DFlash2
    drafter's also with its selector's walk (`selector_tau`).

    The count `Trainer.evaluate` makes, through the drafter's own draft vocabulary, at anchors
    fixed by the answer list: drafters scored on one list are scored on the same blocks, in
    about a minute where a live `benchmarks.evaluate` of as many blocks takes half an hour.
    """
    trainer = Trainer(target, drafter.config, answers, features, TrainOptions(draft_vocab=0))
    trainer.use_vocabulary(list(drafter.draft_vocab or []))
    trainer.init_from(drafter)
    records = samples(answers, features)
    result = trainer.evaluate(records, anchors=anchors)
    if result and drafter.config.dflash2:  # and the selector's walk, on the same blocks
        result["selector_tau"] = chain_tau(trainer, trainer.drafter, records, anchors)["selector"]
    return result
