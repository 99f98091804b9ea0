"""The fp32 argmax of the LM head, computed mostly in bf16.

On CPU the LM head (vocab x hidden) is most of what a verify step adds over a plain step.
Greedy decoding needs only the argmax of each row, so: screen all logits in bf16 (about 2x
less memory traffic and native bf16 dot products), keep every token whose fp32 logit could
still be the largest under a proven error bound, and recompute just those in fp32.

Error bound, per token j and row h (u = 2**-8, bf16's unit roundoff; n = hidden size):
rounding w and h to bf16 perturbs each product by at most (2u + u^2)|w_i h_i|; fp32
accumulation of n terms adds at most n 2**-24 sum|w_i h_i|; rounding the result to bf16
adds u|l|; the fp32 reference has its own accumulation error of the same n 2**-24 size.
So |screen_j - fp32_j| <= (2u + u^2 + 2n 2**-23) sum_i |w_ji h_i| + 2u |screen_j|, and
sum_i |w_ji h_i| <= ||w_j|| ||h|| (Cauchy-Schwarz). A token whose screened logit plus its
bound is below the best screened-logit-minus-bound cannot be the fp32 argmax.

The candidates' fp32 logits come from a gathered matmul; its summation order may differ
from a full fp32 matmul's in the last bits, so two tokens within ~1e-5 of each other may
be ordered differently than a full matmul would order them. That is the same float noise
that already separates a batched verify from a one-token step.
"""

from __future__ import annotations

import torch

U = 2.0**-8


class ScreenedArgmaxHead:
    def __init__(self, weight: torch.Tensor, max_candidates: int = 2048) -> None:
        self.weight = weight.detach().float()
        self.screen = self.weight.to(torch.bfloat16)
        self.row_norm = self.weight.norm(dim=1)
        self.delta = 2 * U + U * U + 2 * self.weight.shape[1] * 2.0**-23
        self.max_candidates = max_candidates
        self.stats = {"rows": 0, "candidates": 0, "fallbacks": 0}

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> list[int]:
        h = hidden.float()
        screened = (h.to(torch.bfloat16) @ self.screen.T).float()
        bound = self.delta * h.norm(dim=1, keepdim=True) * self.row_norm[None, :] + 2 * U * screened.abs()
        floor = (screened - bound).max(dim=1, keepdim=True).values
        candidates = screened + bound >= floor
        out = []
        for row, mask in zip(h, candidates, strict=True):
            idx = mask.nonzero().squeeze(1)
            self.stats["rows"] += 1
            self.stats["candidates"] += idx.numel()
            if idx.numel() > self.max_candidates:  # a flat distribution: screening saves nothing
                self.stats["fallbacks"] += 1
                out.append(int((self.weight @ row).argmax()))
                continue
            exact = self.weight[idx] @ row
            out.append(int(idx[exact.argmax()]))
        return out
