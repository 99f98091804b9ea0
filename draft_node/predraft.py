"""Pre-drafts: the next block for each outcome of a verify the target has not finished.

While the target verifies block `[x_p, d_1 .. d_k]`, the drafter would sit idle. The target
names the outcomes it finds likeliest (j drafts accepted, then bonus token b) and sends their
known tokens `[x_p, d_1 .. d_j, b]` embedded; each is drafted as the block
`[x_p, d_1 .. d_j, b, MASK ...]` over the context the drafter holds now (positions before p:
the features of the rows under verification do not exist yet). Slots after b are the next
step's drafts. When the target's next propose names the outcome that happened, its drafts are
ready; any other propose drafts afresh. The target verifies whatever it gets, so a pre-draft
can cost acceptance but never exactness.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_kernels.row_blocks import row_independence
from draft_node.kv_cache import DraftKVCache
from draft_node.model import Context
from protocol.messages import MAX_PREDRAFT_OUTCOMES


@dataclass
class Predrafts:
    """One session's pre-drafts: drafted over the context [.., base), one (hidden, gate) per
    outcome, holding the drafts after its `known` tokens."""

    base: int
    known: list[int]
    drafted: list[tuple[torch.Tensor, torch.Tensor | None]]

    def take(
        self, outcome: int, start: int, position: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Outcome `outcome`'s drafts (at most `rows`) for a propose of feature rows [start,
        position), if they were drafted over the context those rows continue and for a block at
        that position; None otherwise (a miss)."""
        if start != self.base or not 0 <= outcome < len(self.drafted):
            return None
        if position != self.base + self.known[outcome] - 1:  # its bonus sits where the block starts
            return None
        hidden, gate = self.drafted[outcome]
        return hidden[:rows], None if gate is None else gate[:rows]

    @classmethod
    def from_rows(
        cls, base: int, known: list[int], block_size: int, hidden: torch.Tensor, gate: torch.Tensor | None
    ) -> Predrafts:
        """The pre-drafts back from `joined`'s rows (how the target holds what the daemon sent);
        ValueError if the rows do not add up to the outcomes named."""
        sizes = [block_size - k for k in known]
        if hidden.shape[0] != sum(sizes) or (gate is not None and gate.shape[0] != sum(sizes)):
            raise ValueError(f"{hidden.shape[0]} pre-drafted rows for outcomes of {sizes} rows")
        if not sizes:  # none drafted (none fit the budget): every outcome a miss
            return cls(base, [], [])
        gates = gate.split(sizes) if gate is not None else [None] * len(sizes)
        return cls(base, list(known), list(zip(hidden.split(sizes), gates, strict=True)))

    def joined(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every outcome's drafts in one run of rows, in the order named (what the daemon sends)."""
        hidden = torch.cat([h for h, _ in self.drafted])
        gates = [g for _, g in self.drafted]
        return hidden, None if gates[0] is None else torch.cat(gates)


# The subsets of (passes, blocks, rows) a pass's price is fit on, blocks before rows and passes: where
# every pass read the same context, or was one block, two terms are one, and priced by rows or passes a
# short session's blocks, or a pre-draft's, came free (reviews).
PRICE_TERMS = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,))


@dataclass
class PassCost:
    """What a pre-draft costs this daemon: ms ~ per pass x passes + per block x blocks + per row x
    the context rows its blocks read, every price >= 0, fit over its recent passes (one-block
    proposes and pre-drafts of many blocks, over short contexts and long). A pre-draft that
    outlasts the verify delays the propose behind it, hit or miss (a drafter of 8 layers
    pre-drafting 8 outcomes made every chain step wait 18-31 ms where a fresh draft took 17), so
    the daemon drafts only the likeliest outcomes that fit the time the target gives it. Priced
    by blocks alone, a session of 4,000 rows pre-drafted 16 outcomes in 559 ms for a budget of 35
    (an audit); with a free sign, a negative price for passes let a spent budget fit them all (a
    review). No pass is priced below a recorded one no larger than it."""

    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (blocks, ms, context rows read, passes)

    def record(self, blocks: int, ms: float, rows: int = 0, passes: int = 1) -> None:
        self.recent.append((blocks, ms, rows, passes))

    def model(self) -> Callable[[int, int, int], float]:
        """The expected ms of `blocks` blocks reading `rows` context rows in all, in `passes`
        passes; 0 before any pass (optimistic: try it)."""
        if not self.recent:
            return lambda blocks, rows, passes: 0.0
        data = np.array(self.recent, dtype=np.float64)
        ms, terms = data[:, 1], data[:, [3, 0, 2]]  # passes, blocks, rows
        if (np.ptp(terms, axis=0) == 0).all():  # one size seen so far: in proportion, the larger way
            mean, blocks, rows = float(ms.mean()), terms[0, 1], terms[0, 2]
            return lambda b, r, p: mean * max(b / blocks, r / rows if rows else 0.0)
        scale = np.where(terms.max(axis=0) > 0, terms.max(axis=0), 1.0)
        best, prices = float("inf"), None
        for chosen in PRICE_TERMS:  # the closest fit with no negative price and no two terms alike
            design = terms[:, chosen] / scale[list(chosen)]
            if np.linalg.matrix_rank(design, tol=1e-6) < len(chosen):
                continue
            coef = np.linalg.lstsq(design, ms, rcond=None)[0]
            residual = float(((design @ coef - ms) ** 2).sum())
            if (coef >= 0).all() and residual < best - 1e-9 * max(1.0, float(ms @ ms)):
                best, prices = residual, np.zeros(3)
                prices[list(chosen)] = coef / scale[list(chosen)]
        if prices is None:
            mean = float(ms.mean())
            return lambda b, r, p: mean
        per_pass, per_block, per_row = (float(x) for x in prices)

        def cost(b: int, r: int, p: int) -> float:
            # At least what a recorded pass no larger in any term cost (none such: no floor).
            smaller = ms[(terms <= np.array([p, b, r])).all(axis=1)]
            return max(float(smaller.min()) if smaller.size else 0.0, per_pass * p + per_block * b + per_row * r)

        return cost

    def estimate(self, blocks: int, rows: int = 0, passes: int = 1) -> float:
        return self.model()(blocks, rows, passes)

    def fitting(self, named: int, budget_ms: float, context: int = 0, per_pass: int = MAX_PREDRAFT_OUTCOMES) -> int:
        """How many of `named` outcomes (likeliest first), each a block reading `context` rows, in
        passes of `per_pass` outcomes (`outcomes_per_pass`), are drafted within `budget_ms`; all
        where the budget is 0 (none given)."""
        if budget_ms <= 0:
            return named
        cost = self.model()
        return max(
            (n for n in range(named + 1) if n == 0 or cost(n, n * context, -(-n // per_pass)) <= budget_ms + 1e-9),
            default=0,
        )


def check_outcomes(known: list[int], head_rows: int, block_size: int) -> None:
    """Refuse what no target sends: too many outcomes, a head that leaves no slot to draft, or
    row counts that do not add up to the rows sent. Raises ValueError naming the problem."""
    if not 1 <= len(known) <= MAX_PREDRAFT_OUTCOMES:
        raise ValueError(f"{len(known)} outcomes: name 1 to {MAX_PREDRAFT_OUTCOMES}")
    if any(not 2 <= k <= block_size - 1 for k in known):
        raise ValueError(
            f"known rows {known}: each 2 (last_tok and the bonus) to {block_size - 1} (one slot left to draft)"
        )
    if sum(known) != head_rows:
        raise ValueError(f"known rows add up to {sum(known)}, but {head_rows} head rows came")


@torch.inference_mode()
def predraft(cache: DraftKVCache, heads: torch.Tensor, known: list[int], mask: torch.Tensor) -> Predrafts:
    """Draft every outcome over `cache`'s context as it is (which it leaves unchanged): `heads`
    [sum(known), hidden] are the outcomes' known tokens embedded, one run of `known[i]` rows
    each, `mask` [1, hidden] the mask token's embedding. The outcomes share the context, so each
    reads a copy of it with room for its own block's keys and values, in passes of
    `outcomes_per_pass`. Each outcome's rows are its own whatever its pass (row_independence)."""
    drafter = cache.drafter
    block = drafter.config.block_size
    check_outcomes(known, heads.shape[0], block)
    per_pass = outcomes_per_pass(cache)
    drafted: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for first in range(0, len(known), per_pass):
        group = known[first : first + per_pass]
        rows_before = sum(known[:first])
        drafted += _predraft_pass(cache, heads[rows_before : rows_before + sum(group)], group, mask)
    return Predrafts(cache.length, list(known), drafted)


COPY_RINGS = 4  # a pre-draft's copies of its session's context hold at most this many rings' rows


def outcomes_per_pass(cache: DraftKVCache) -> int:
    """How many outcomes one pass drafts: their copies of the context within COPY_RINGS rings (16
    in one pass held 17.6 rings at a full ring, an audit; one a pass cost 2.7-9x the time, a review)."""
    return max(1, COPY_RINGS * (cache.capacity + cache.drafter.config.block_size) // cache.block_reads)


def _predraft_pass(
    cache: DraftKVCache, heads: torch.Tensor, known: list[int], mask: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    drafter = cache.drafter
    block = drafter.config.block_size
    count, anchor = len(known), cache.length
    noise = torch.stack([torch.cat([head, mask.expand(block - head.shape[0], -1)]) for head in heads.split(known)])
    shared = cache.context()
    live = shared.positions.shape[0]
    buffers = []
    for k, v in shared.buffers:
        copies = (
            k.new_empty((count, k.shape[1], live + block, k.shape[3])),
            v.new_empty((count, v.shape[1], live + block, v.shape[3])),
        )
        copies[0][:, :, :live], copies[1][:, :, :live] = k[:, :, :live], v[:, :, :live]
        buffers.append(copies)
    rows = anchor + torch.arange(block, device=drafter.device).expand(count, -1)
    with row_independence(drafter.device):
        hidden = drafter.run_blocks(noise, rows, torch.full_like(rows, anchor), [Context(buffers, shared.positions)])
        drafts = [hidden[i, k:] for i, k in enumerate(known)]  # the slots after each outcome's b
        gates = drafter.gate(torch.cat(drafts)).split([block - k for k in known]) if drafter.config.dflash2 else None
    return [(h, None if gates is None else g) for h, g in zip(drafts, gates or drafts, strict=True)]
