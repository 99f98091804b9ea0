"""CPU kernels whose outputs do not depend on the batch, built on the machine that runs them.

Each output element is one fixed sequence of IEEE operations over its own inputs (cpu.cpp says how),
so a row computed alone and the same row computed among others have the same bits. The target's
engine is built on them; a drafter uses their linear for speed alone. No model code here: weights
packed once (`pack`), activations in, outputs out, through `torch.ops.dflash`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import cache

import torch

from dflash_kernels.build import KernelsUnavailable, load, locked, native_bf16

__all__ = ["KernelsUnavailable", "Packed", "bf16_faster", "linear", "load", "native_bf16", "pack"]

log = logging.getLogger(__name__)

PANEL = 64  # outputs per panel of packed weights (cpu.cpp)


@dataclass
class Packed:
    """A weight matrix [N, K] in the kernels' panel layout, and the N it computes."""

    data: torch.Tensor
    n: int


def pack(*weights: torch.Tensor) -> Packed:
    """Rows of `weights` stacked into one [N, K] matrix, then packed: fp32 as [N/64, K, 64], bf16 as
    [N/64, K/2, 64, 2] (pairs of k side by side), N padded to 64 and K to even with zeros."""
    w = torch.cat([x.detach() for x in weights])
    n, k = w.shape
    np_, kp = -(-n // PANEL) * PANEL, k + (k % 2 if w.dtype == torch.bfloat16 else 0)
    full = torch.zeros(np_, kp, dtype=w.dtype, device=w.device)
    full[:n, :k] = w
    if w.dtype == torch.bfloat16:
        data = full.view(np_ // PANEL, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        data = full.view(np_ // PANEL, PANEL, kp).permute(0, 2, 1).contiguous()
    return Packed(data, n)


def linear(
    x: torch.Tensor,
    weight: Packed,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x @ W.T + bias) + residual, fp32 [M, N], for fp32 rows x [M, K] (`out` may be `residual`)."""
    load()
    if out is None:
        out = torch.empty(x.shape[0], weight.n, device=x.device)
    torch.ops.dflash.linear(x, weight.data, weight.n, bias, residual, out)
    return out


@cache
def bf16_faster(hidden: int = 1024, outputs: int = 4096) -> bool:
    """Whether a one-row engine matmul runs faster in bf16 than in fp32 on this machine (False where
    the kernels cannot be built). Measured once per machine, at the first load, and kept beside the
    kernels: a choice remeasured by every process flips with the load of the moment (on a busy
    2-core machine 1 in 8 did), and two daemons in different dtypes give different outputs. Delete
    the file to measure again."""
    try:
        folder = load()
    except KernelsUnavailable:
        return False
    record = folder / f"bf16_faster-{hidden}x{outputs}.json"
    with locked(folder):
        try:
            return bool(json.loads(record.read_text())["bf16_faster"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        seconds = _one_row_seconds(hidden, outputs)
        faster = seconds["bfloat16"] < seconds["float32"]
        record.write_text(json.dumps({"bf16_faster": faster, "seconds": seconds}))
    log.info(
        "measured once for this machine: a one-row matmul takes %s s; bf16 is %s",
        seconds,
        "faster" if faster else "not faster",
    )
    return faster


def _one_row_seconds(hidden: int, outputs: int) -> dict[str, float]:
    """The best of many timings per dtype, taken in turns so a burst of load hits both alike."""
    weight = torch.randn(outputs, hidden, generator=torch.Generator().manual_seed(0))
    x, out = torch.randn(1, hidden), torch.empty(1, outputs)
    packed = {str(dtype).removeprefix("torch."): pack(weight.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(packed, float("inf"))
    for turn in range(21):
        for name, weights in packed.items():
            began = time.perf_counter()
            for _ in range(4):
                linear(x, weights, out=out)
            if turn:  # the first turn warms the caches and the thread pool
                best[name] = min(best[name], time.perf_counter() - began)
    return best
