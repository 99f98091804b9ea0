"""The engine's operations in torch, for devices the CPU kernels do not run on (CUDA).

Same signatures and the same arithmetic contract as dflash_kernels/cpu.cpp, reached another way. On a
GPU the engine runs every forward in blocks of exactly `BLOCK` rows (the last one padded with
rows that write only to a scratch slot), so every matmul, norm and reduction runs at one shape,
and a row's bits depend on its own inputs only as far as a kernel launched at a fixed shape
computes every row by the same instructions (as cuBLAS and torch's reductions do; the GPU run
checks it bit for bit). Attention reads each row's key list in chunks of `CHUNK` list positions,
combined in order with a running max (a chunk past a row's list changes nothing), so where a
row's keys sit, contiguous or gathered, never changes its arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_kernels import Packed
from dflash_kernels.row_blocks import BLOCK  # rows per forward block: the drafter's blocks too

CHUNK = 128  # key-list positions per attention chunk


def prepare(weight: torch.Tensor, *more: torch.Tensor) -> Packed:
    """Weights as they are ([N, K], stacked): cuBLAS needs no packing."""
    w = torch.cat([weight.detach(), *(m.detach() for m in more)]).contiguous()
    return Packed(w, w.shape[0])


class TorchOps:
    block = BLOCK

    def linear(self, x: Tensor, w: Tensor, n: int, bias: Tensor | None, residual: Tensor | None, out: Tensor) -> None:
        y = F.linear(x.to(w.dtype), w).float()
        if bias is not None:
            y = y + bias
        if residual is not None:
            y = residual + y
        out.copy_(y)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float, plus_one: bool, out: Tensor) -> None:
        scale = 1.0 + weight if plus_one else weight
        out.copy_(scale * (x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))))

    def silu_mul(self, gu: Tensor, out: Tensor) -> None:
        gate, up = gu.chunk(2, -1)
        out.copy_(gate / (1.0 + torch.exp(-gate)) * up)

    def rope_store(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        kc: Tensor,
        vc: Tensor,
        slots: Tensor,
        index: Tensor,
        hq: int,
        hkv: int,
        q_norm: Tensor | None,
        k_norm: Tensor | None,
        eps: float,
    ) -> None:
        m, d = qkv.shape[0], kc.shape[3]
        heads = qkv[:, : (hq + hkv) * d].view(m, hq + hkv, d)
        if q_norm is not None:
            self.rmsnorm(heads[:, :hq].clone(), q_norm, eps, False, heads[:, :hq])
        if k_norm is not None:
            self.rmsnorm(heads[:, hq:].clone(), k_norm, eps, False, heads[:, hq:])
        half = d // 2
        a, b = heads[..., :half].clone(), heads[..., half:].clone()
        c, s = cos[:, None], sin[:, None]
        heads[..., :half] = a * c[..., :half] - b * s[..., :half]
        heads[..., half:] = b * c[..., half:] + a * s[..., half:]
        slot, at = slots.long(), index.long()
        kc[slot, :, at] = heads[:, hq:].to(kc.dtype)
        vc[slot, :, at] = qkv[:, (hq + hkv) * d :].view(m, hkv, d).to(vc.dtype)

    def attention(
        self,
        qkv: Tensor,
        kc: Tensor,
        vc: Tensor,
        slots: Tensor,
        lo: Tensor,
        hi: Tensor,
        extra: Tensor,
        count: Tensor,
        hq: int,
        scale: float,
        out: Tensor,
    ) -> None:
        m = qkv.shape[0]
        hkv, d = kc.shape[1], kc.shape[3]
        group = hq // hkv
        q = qkv[:, : hq * d].view(m, hkv, group, d)
        lo, span = lo.long(), (hi - lo).long()
        total = span + count.long()
        extra = extra.long() if extra.shape[1] else torch.zeros(m, 1, dtype=torch.long, device=qkv.device)
        best = torch.full((m, hkv, group), float("-inf"), device=qkv.device)
        mass = torch.zeros(m, hkv, group, device=qkv.device)
        acc = torch.zeros(m, hkv, group, d, device=qkv.device)
        slot = slots.long()[:, None]
        steps = torch.arange(CHUNK, device=qkv.device)
        for start in range(0, int(total.max()), CHUNK):
            j = start + steps[None]  # [1, CHUNK] list positions
            gathered = extra.gather(1, (j - span[:, None]).clamp(0, extra.shape[1] - 1))
            keys = torch.where(j < span[:, None], lo[:, None] + j, gathered)
            valid = j < total[:, None]
            keys = torch.where(valid, keys, torch.zeros_like(keys))
            k = kc[slot, :, keys].permute(0, 2, 1, 3).float()  # [m, hkv, CHUNK, d]
            v = vc[slot, :, keys].permute(0, 2, 1, 3).float()
            scores = torch.einsum("mhgd,mhcd->mhgc", q, k) * scale
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            top = torch.maximum(best, scores.amax(-1))
            p = torch.exp(scores - top[..., None])
            keep = torch.exp(best - top)
            mass = mass * keep + p.sum(-1)
            acc = acc * keep[..., None] + torch.einsum("mhgc,mhcd->mhgd", p, v)
            best = top
        out.copy_((acc / mass[..., None]).reshape(m, hq * d))
