"""How one request decodes, as one object: the daemon builds it from a request, `Sequence` and
`generate` read it, and nothing passes its fields one by one."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.sampling import SamplingParams
from target_node.drafting.datastore import Datastore


@dataclass(frozen=True)
class DecodeOptions:
    """`sampling` None or temperature 0 is exact greedy decoding. `adaptive` lets a Governor switch
    to plain steps while drafting does not pay and choose how many drafts to verify; not for seeded
    sampling, which must reproduce exactly. `tree_nodes` > 0 verifies greedy drafts as a tree of up
    to that many nodes; `lookup` adds to those trees the continuation of the context's tail found
    earlier in the context (prompt lookup), every step, and a `datastore`, where given, the
    continuation it finds in the target's earlier answers; `prefill_chunk` > 0 runs the prompt that
    many tokens per forward. `hint_tokens` are a known continuation (verified like drafts, never
    trusted)."""

    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    hint_tokens: tuple[int, ...] = ()
    stop_on_eos: bool = True
    sampling: SamplingParams | None = None
    adaptive: bool = True
    tree_nodes: int = 0
    lookup: bool = True
    datastore: Datastore | None = None
    prefill_chunk: int = 0

    def __post_init__(self) -> None:
        # Callers hand lists; a frozen options object keeps tuples, so it is hashable and never shared mutably.
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "hint_tokens", tuple(self.hint_tokens or ()))
