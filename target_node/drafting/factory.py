"""Who drafts for each of a target daemon's slots, from one settings object: the one place the
proposers are wired (drafter weights loaded once and shared, a remote session per slot)."""

from __future__ import annotations

from draft_node.checkpoint import load_drafter
from protocol.keys import ClientKeys
from protocol.messages import fit_problems
from target_node.drafting.bridge import DrafterMismatch
from target_node.drafting.draft_pass import DraftPass
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer, Proposer
from target_node.drafting.remote import LinkTiming, Reachability, RemoteDraftBackend
from target_node.drafting.settings import ProposerSettings
from target_node.model.target import TargetModel


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
