"""A drafter's acceptance, estimated offline on answers with cached features.

It needs both the trainer (the count `Trainer.evaluate` makes) and the selector's walk
(`training.selector.chain_tau`), and the selector builds on the trainer: so it lives here, above
both, and the imports run one way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from answers.store import Answer
from draft_node.model import DFlashDrafter
from target_node.drafting.proposal import Continuation
from training.batches import Sample, samples
from training.features import FeatureCache
from training.selector import chain_tau
from training.trainer import Trainer, TrainOptions
from training.variety import answer_kind


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
    if result:
        result["by_kind"] = by_kind(answers, records, result.pop("per_record"))
    if result and drafter.config.dflash2:  # and the selector's walk, on the same blocks
        result["selector_tau"] = chain_tau(trainer, trainer.drafter, records, anchors)["selector"]
    return result


def lookup_tau(lookup: Callable[[list[int], int], Continuation], answers: list[Answer], block: int = 8) -> dict:
    """A lookup's chain acceptance on `answers`, offline: steps walked as a live chain walks them,
    each verifying the lookup's continuation of the text so far (up to `block` - 1 tokens) and
    keeping the agreeing prefix plus the target's next token.

    What the datastore's branch alone would give (`target_node.drafting.datastore`), on the
    same answers for every store measured: how its reach grows with the store, without the
    drafter's branch and the governor's trees in the way.
    """
    steps = tokens = first = 0
    for answer in answers:
        text, at = list(answer.tokens), answer.prompt_len
        while at < len(text):
            guess = lookup(text[:at], block - 1).tokens
            agree = 0
            while agree < len(guess) and at + agree < len(text) and guess[agree] == text[at + agree]:
                agree += 1
            advance = min(agree + 1, len(text) - at)
            steps, tokens, first, at = steps + 1, tokens + advance, first + (agree > 0), at + advance
    return {"tau": tokens / steps if steps else 0.0, "first_accepted": first / steps if steps else 0.0, "steps": steps}


def by_kind(answers: list[Answer], records: list[Sample], per_record: list[list[int]]) -> dict[str, dict]:
    """tau per answer kind (`answer_kind`), from one pass's per-answer counts: the kinds' blocks
    are the whole estimate's, so drafters scored on one list compare kind by kind too."""
    kind_of = {a.key: answer_kind(a) for a in answers}
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # answers, drafts accepted, blocks
    for record, (accepted, blocks) in zip(records, per_record, strict=True):
        t = totals[kind_of[record.key]]
        t[0], t[1], t[2] = t[0] + 1, t[1] + accepted, t[2] + blocks
    return {
        kind: {"answers": n, "blocks": blocks, "tau": round(1.0 + accepted / blocks, 4) if blocks else 1.0}
        for kind, (n, accepted, blocks) in sorted(totals.items(), key=lambda kv: -kv[1][2])
    }


def kind_table(kinds: dict[str, dict]) -> list[str]:
    """Markdown rows: one per answer kind (most blocks first), one column per drafter."""
    names = list(kinds)
    first = next(iter(kinds.values()), {})
    order = sorted({k for by in kinds.values() for k in by}, key=lambda k: -first.get(k, {}).get("blocks", 0))
    rows = ["| kind | answers | blocks | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
    for kind in order:
        some = next(by[kind] for by in kinds.values() if kind in by)
        taus = [f"{kinds[n][kind]['tau']:.3f}" if kind in kinds[n] else "-" for n in names]
        rows.append(f"| {kind} | {some['answers']} | {some['blocks']} | " + " | ".join(taus) + " |")
    return rows
