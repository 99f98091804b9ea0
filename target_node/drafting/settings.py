"""Who drafts for a target daemon, as the command line says it: no torch to load, so that a
daemon's flags are parsed and refused in a tenth of a second (`target_node.drafting.factory`
builds the proposers from these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from basics.settings_fields import refuse_unfinite
from protocol.messages import MAX_PREDRAFT_OUTCOMES, MAX_RING_CAPACITY

NO_PROPOSER = "none"  # `NoProposer.name`: plain decoding
PROPOSER_KINDS = ("remote", "local", "ngram", NO_PROPOSER)


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
