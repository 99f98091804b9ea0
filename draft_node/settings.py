"""What a draft daemon allows: one object, one field per flag.

Each field carries its default and its help (`basics.settings_fields.setting`); the daemon's
command line is built from them (`launch.common.add_settings`), and the limits table in
docs/serving.md is tested against them.
"""

from __future__ import annotations

from dataclasses import dataclass

from basics.settings_fields import refuse_unfinite, setting
from protocol.messages import KEEPALIVE_S, MAX_RING_CAPACITY


@dataclass(frozen=True)
class DraftSettings:
    ring_capacity: int = setting(4096, "context positions kept per session", limit=False)
    max_sessions: int = setting(64, "sessions held at once, over all targets")
    max_sessions_per_peer: int = setting(
        32,
        "sessions one peer may hold: under CURVE one target (its key), which needs one per request it runs at "
        "once (its --max-batch); without CURVE one connection, and a target's slots each have their own",
    )
    idle_timeout: float = setting(600.0, "seconds before an idle session is evicted", unit="s")
    reclaim_after: float = setting(
        30.0,
        "when all sessions are taken, a session idle this many seconds may be evicted if its target has said "
        "nothing for as long, first of targets holding more than their fair share (live targets ping every "
        f"{KEEPALIVE_S:g} s, so keep this well above that)",
        unit="s",
        limit=False,
    )
    # A burst of whole-ring resends in one pass held every session's activations at once (4 GB for
    # 32 resends of 4,096 rows, and 2.6x the time): passes are bounded in feature rows.
    max_pass_rows: int = setting(
        1024,
        "feature rows one drafting pass takes at most: proposes that arrive together are drafted in one pass up "
        "to this, so a burst of whole-ring resends costs what drafting them one by one does",
    )
    # The shipped SmolLM2 drafter holds 1,536 bytes a position in bf16: 256 MB is ~170K positions.
    keep_mb: float = setting(
        256.0,
        "MB of prefixes' context keys and values kept for targets' prefix caches (`keep`), over all peers; when "
        "full, the peer keeping the most loses its least recently used first: a target's later request with that "
        "prefix sends none of its feature rows (0: off)",
    )

    def __post_init__(self) -> None:
        refuse_unfinite(self)
        if self.ring_capacity > MAX_RING_CAPACITY:  # every target would refuse the drafter (fit_problems)
            raise ValueError(f"ring_capacity must be at most {MAX_RING_CAPACITY}, got {self.ring_capacity}")
        for name in ("ring_capacity", "max_sessions", "max_sessions_per_peer", "max_pass_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.idle_timeout <= 0 or self.reclaim_after < 0 or self.keep_mb < 0:
            raise ValueError("idle_timeout must be > 0 s, reclaim_after >= 0 s and keep_mb >= 0")
