"""What a target daemon allows and how it paces its work: one object, one field per flag.

Each field carries its default and its help; the daemon's command line is built from them
(`launch.common.add_settings`), and the limits table in docs/serving.md is tested against them,
so a limit is written once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from basics.settings_fields import refuse_unfinite, setting
from protocol.messages import MAX_REPLY_TOKENS
from target_node.drafting.settings import NO_PROPOSER

if TYPE_CHECKING:  # the daemon's flags are parsed from these settings before torch loads
    from target_node.drafting.proposers import Proposer

# The widest tree a step verifies: more nodes than a drafter's best-first guesses ever pay for on
# any machine measured (docs/trees.md), and the governor times each width at start.
MAX_TREE_NODES = 256


def default_budget_mb() -> int:
    """A tenth of this machine's memory, at most 4 GiB: room for many conversations' rows
    without crowding the model (SmolLM2-135M in fp32 needs 58 KB a position with its features)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 512
    return int(min(total / 10, 4 << 30) / (1 << 20))


@dataclass(frozen=True)
class ServiceSettings:
    max_new_tokens_limit: int = setting(
        4096, f"largest max_new_tokens accepted (at most {MAX_REPLY_TOKENS}, what one reply carries)"
    )
    max_queued: int = setting(1024, "requests queued over all clients (then: busy)")
    max_queued_per_client: int = setting(64, "requests one client may queue")
    max_queued_bytes: int = setting(
        256 << 20,
        "memory queued requests may hold, over all clients (then: busy); a number of bytes, or with K, M or G",
        unit="bytes",
    )
    tree_nodes: int = setting(
        16,
        "verify greedy drafts as a tree of up to this many nodes (0: one chain of guesses); the governor picks "
        "how many pay, from verify costs it measures at start",
        limit=False,
    )
    no_lookup: bool = setting(
        False,
        "do not add to each greedy tree the continuations of the context's tail found earlier in the context (prompt "
        "lookup) and in the --datastore: free to find, verified like drafts; off with --proposer none, which "
        "decodes plainly",
        limit=False,
    )
    datastore: str = setting(
        "auto",
        "add to each greedy tree the continuation the target wrote after the context's tail in its earlier answers: "
        "an answer store's folder (recorded traffic, say), auto (the committed data/answers, where it exists), or "
        "none. Only the served model's answers count; their index is kept under $DFLASH_SPLIT_CACHE (default "
        "~/.cache/dflash-split)/datastore, built by a process of its own while the daemon serves without it",
        limit=False,
    )
    always_draft: bool = setting(
        False, "draft every step, even while measured speculation is slower than plain decoding", limit=False
    )
    prefill_chunk: int = setting(
        512,
        "the most prompt tokens in one forward; between chunks the daemon serves its socket and the other "
        "requests step (0: no cap)",
    )
    prefill_budget_ms: float = setting(
        150.0,
        "size prompt chunks so a forward that carries one takes about this long, from prefill rates measured as "
        "it runs: other requests' tokens and first tokens wait at most about this (0: fixed chunks of "
        "--prefill-chunk). A prompt alone, with no other request running or queued, takes --prefill-chunk tokens "
        "a forward: it pauses no one",
        unit="ms",
    )
    max_silence: float = setting(
        600.0,
        "seconds a client that promised no heartbeats (heartbeat_s 0) may send nothing while its requests run or "
        "wait; then they are cancelled, as for a client gone (0: wait forever). Clients that heartbeat "
        "(dflash-client, dflash-serve) are dropped after 3 missed beats instead, or this long where that is sooner",
        unit="s",
    )
    prefix_cache_mb: float = setting(
        default_budget_mb(),
        "MB of committed KV and feature rows kept by token prefix for later prompts that start with them (a "
        "chat's next turn, a shared system prompt); least recently used out first (0: off; default: a tenth of "
        "this machine's memory, at most 4 GiB). The engine's targets only",
    )
    max_messages_per_step: int = setting(
        64, "messages taken in between two decode steps (bounds what a flood from one peer costs the others)"
    )

    def __post_init__(self) -> None:
        refuse_unfinite(self)
        if self.tree_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree_nodes must be at most {MAX_TREE_NODES}, got {self.tree_nodes}")
        if not 1 <= self.max_new_tokens_limit <= MAX_REPLY_TOKENS:
            # Else a request would be accepted, run to its end, and have its `done` refused by the wire.
            raise ValueError(
                f"max_new_tokens_limit must be in [1, {MAX_REPLY_TOKENS}] (what one reply carries), "
                f"got {self.max_new_tokens_limit}"
            )
        # A daemon that starts and then refuses everything, or reads nothing (0 messages a step: not
        # even pings), or fails on its first prompt, is worse than a refusal at start (an audit).
        for name in ("max_queued", "max_queued_per_client", "max_queued_bytes", "max_messages_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("tree_nodes", "prefill_chunk", "prefill_budget_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.max_silence < 0:
            raise ValueError("max_silence must be 0 (wait forever) or a number of seconds")
        if self.prefix_cache_mb < 0:
            raise ValueError("prefix_cache_mb must be 0 (off) or a number of MB")
        if self.datastore not in ("auto", "none") and not Path(self.datastore).is_dir():  # before a model loads
            raise ValueError(f"datastore {self.datastore}: no such answer store folder")

    def looks_up(self, proposer: Proposer) -> bool:
        """Whether greedy trees get looked-up branches (prompt lookup, the datastore): not with
        --no-lookup, nor beside --proposer none, which decodes plainly (and builds no index)."""
        return not self.no_lookup and proposer.name != NO_PROPOSER
