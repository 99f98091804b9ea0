"""Who drafts for each of a target daemon's slots, from one settings object: the one place the
proposers are wired (drafter weights loaded once and shared, a remote session per slot)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from basics.settings_fields import refuse_unfinite
from draft_node.checkpoint import load_drafter
from protocol.keys import ClientKeys
from protocol.messages import MAX_PREDRAFT_OUTCOMES, MAX_RING_CAPACITY, fit_problems
from target_node.drafting.bridge import DrafterMismatch
from target_node.drafting.draft_pass import DraftPass
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer, Proposer
from target_node.drafting.remote import LinkTiming, Reachability, RemoteDraftBackend
from target_node.model.target import TargetModel

PROPOSER_KINDS = ("remote", "local", "ngram", "none")


@dataclass(frozen=True)
class ProposerSettings:
    """`kind`: a draft daemon at `drafter` (`remote`, with `fallback` drafting while it is away),
    a drafter `checkpoint` in this process (`local`: needed by the time proposers are built),
    prompt lookup (`ngram`) or none."""

    kind: str = "remote"
    drafter: str = ""  # the draft daemon's address, for remote
    checkpoint: Path | None = None  # the drafter's folder, for local
    fallback: str = "ngram"
    draft_timeout_s: float = 2.0
    draft_retry_s: float = 5.0
    wire_dtype: str | None = None  # None: negotiated
    ring_capacity: int = 4096  # context positions a local drafter keeps
    predraft: int = 0  # outcomes pre-drafted per chain verify (draft_node/predraft.py); 0: none

    def __post_init__(self) -> None:
        if not 0 <= self.predraft <= MAX_PREDRAFT_OUTCOMES:
            raise ValueError(f"predraft names 0 to {MAX_PREDRAFT_OUTCOMES} outcomes, got {self.predraft}")
        if self.kind not in PROPOSER_KINDS:
            raise ValueError(f"unknown proposer {self.kind!r}; expected one of {PROPOSER_KINDS}")
        if not 1 <= self.ring_capacity <= MAX_RING_CAPACITY:  # refused by fit_problems only once both had loaded
            raise ValueError(f"ring_capacity must be in 1..{MAX_RING_CAPACITY}, got {self.ring_capacity}")
        refuse_unfinite(self)
        if not self.draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s must be above 0, got {self.draft_timeout_s}")
        if not self.draft_retry_s > 0:  # 0 probed a dead daemon once per slot at start (--max-batch 64: 128 s)
            raise ValueError(f"draft_retry_s must be above 0, got {self.draft_retry_s}")


def build_proposers(
    settings: ProposerSettings, target: TargetModel, count: int, drafter_keys: ClientKeys | None = None
) -> list[Proposer]:
    """One proposer per slot (each request drafts from its own state)."""
    if settings.kind == "none":
        return [NoProposer() for _ in range(count)]
    if settings.kind == "ngram":
        return [NGramProposer() for _ in range(count)]
    if settings.kind == "local":
        if settings.checkpoint is None:
            raise ValueError("a local proposer needs a drafter checkpoint")
        drafter = load_drafter(settings.checkpoint, target.device, target.model.dtype)
        problems = fit_problems(drafter.describe(settings.ring_capacity), target.info)
        if problems:  # at start, as a remote drafter is checked, not at every request
            raise DrafterMismatch(f"{settings.checkpoint} does not fit this target: " + "; ".join(problems))
        together = DraftPass(drafter)  # the slots' drafts of one step in one pass
        return [
            DFlashProposer(
                LocalDraftBackend(drafter, settings.ring_capacity, together), NGramProposer(), settings.predraft
            )
            for _ in range(count)
        ]
    reach = Reachability()  # one daemon behind every slot's session: one probe when it is away

    def remote() -> Proposer:
        backend = RemoteDraftBackend(
            settings.drafter,
            target,
            timing=LinkTiming(timeout_s=settings.draft_timeout_s, retry_s=settings.draft_retry_s),
            wire_dtype=settings.wire_dtype,
            curve=drafter_keys,
            reach=reach,
        )
        fallback = NGramProposer() if settings.fallback == "ngram" else NoProposer()
        return DFlashProposer(backend, fallback, settings.predraft)

    return [remote() for _ in range(count)]
