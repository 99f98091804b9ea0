"""Batch invariance in torch: every row computed by the same operations whatever rows run beside it.

The CPU kernels are row-independent by construction (cpu.cpp). Elsewhere torch picks a matmul's
or a norm's kernel by the row count, so row-wise operations run on blocks of exactly `BLOCK` rows,
the last padded: one shape, whatever the batch holds. The target's engine runs whole forwards in
such blocks (target_node/engine/torch_ops.py); a drafter runs its linears and norms through
`in_row_blocks` inside `row_independence` (draft_node/model.py). One block size for both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

import dflash_kernels

BLOCK = 64  # rows per torch call where row-wise operations run in fixed blocks
_row_block: ContextVar[int] = ContextVar("row_block", default=0)


class Linear(nn.Linear):
    """nn.Linear, except that inference on the CPU runs the CPU kernels' linear: a draft step has a
    handful of rows, where their matmul over weights packed once beats torch's several times. The
    packed copy follows the weight (repacked when an optimizer or a load changes it); training,
    other devices and machines without a compiler keep torch's."""

    _packed: dflash_kernels.Packed | None = None
    _packed_from: tuple[int, int] = (-1, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not dflash_kernels.runs_on(x.device):
            return in_row_blocks(lambda rows: F.linear(rows, self.weight, self.bias), x)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        bias = None if self.bias is None else self.bias.detach().float()
        return dflash_kernels.linear(rows, self.packed(), bias).view(*x.shape[:-1], -1).to(x.dtype)

    def packed(self) -> dflash_kernels.Packed:
        """The weight in the kernels' layout, packed again after a load or an optimizer changed it."""
        weight = self.weight
        if self._packed_from != (weight.data_ptr(), weight._version):
            self._packed, self._packed_from = dflash_kernels.pack(weight.detach()), (weight.data_ptr(), weight._version)
        return self._packed


def row_independence(device: torch.device) -> AbstractContextManager:
    """What inference runs inside so that every row is computed by the same operations whatever
    rows run beside it (a draft daemon's pass of many sessions). On the CPU kernels, nothing: their
    linear is row-independent by construction, and the rest is element-wise, row-wise or per
    sequence. Elsewhere torch picks a matmul's or a norm's kernel by the row count, so they run on
    blocks of exactly BLOCK rows, the last padded: one shape, whatever the pass holds."""
    if dflash_kernels.runs_on(device):
        return nullcontext()
    return _fixed_row_blocks()


@contextmanager
def _fixed_row_blocks():
    token = _row_block.set(BLOCK)
    try:
        yield
    finally:
        _row_block.reset(token)


def in_row_blocks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over x's rows, in blocks of the current fixed size (padded with zero rows), or all at once."""
    block = _row_block.get()
    if not block:
        return fn(x)
    rows = x.reshape(-1, x.shape[-1])
    padded = F.pad(rows, (0, 0, 0, -rows.shape[0] % block))
    out = torch.cat([fn(chunk) for chunk in padded.split(block)])[: rows.shape[0]]
    return out.view(*x.shape[:-1], out.shape[-1])
