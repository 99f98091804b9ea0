"""The DFlash block-diffusion drafter, readable top to bottom.

The drafter owns no embedding table and no LM head: the target embeds the noise block
`[last_tok, MASK, ...]` and projects the returned hidden states itself. What the drafter
adds is context: features tapped from the target's layers are fused into one row per
committed position and injected as extra keys/values into every layer's attention.
Those context keys/values depend only on the row and its position, so they are computed
once per committed position (see kv_cache.py); the noise block is recomputed each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draft_node.config import SLIDING, DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the Qwen3 reference, so bf16 drafters match trained numerics.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half rotary embedding of x [..., rows, heads, head_dim] at absolute positions."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [rows, kv_heads, head_dim] for rows x at their positions."""
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        return rope(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        ctx_len: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block rows x [B, hidden] attend over [context rows, block rows] under mask [B, C+B].

        k_buf/v_buf [kv_heads, >= C+B, head_dim] hold the context keys/values in their first
        C slots; the block's own keys/values are written into the next B, so attention reads
        one contiguous run with no concatenation.
        """
        block = x.shape[0]
        q = rope(self.q_norm(self.q_proj(x).view(block, self.heads, self.head_dim)), positions, self.theta)
        blk_k, blk_v = self.keys_values(x, positions)
        k_buf[:, ctx_len : ctx_len + block] = blk_k.transpose(0, 1)
        v_buf[:, ctx_len : ctx_len + block] = blk_v.transpose(0, 1)
        k, v = k_buf[:, : ctx_len + block], v_buf[:, : ctx_len + block]
        # GQA without copying K/V per query head: each kv head serves its group's rows at once.
        group = self.heads // self.kv_heads
        q = (
            q.view(block, self.kv_heads, group, self.head_dim)
            .permute(1, 2, 0, 3)
            .reshape(self.kv_heads, -1, self.head_dim)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(group, 1))
        out = out.view(self.kv_heads, group, block, self.head_dim).permute(2, 0, 1, 3)
        return self.o_proj(out.reshape(block, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, k_buf, v_buf, ctx_len, mask) -> torch.Tensor:  # noqa: ANN001
        x = x + self.self_attn(self.input_layernorm(x), positions, k_buf, v_buf, ctx_len, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.draft_vocab: list[int] = []  # token ids it proposes from; [] = the whole vocabulary

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values for feature rows [C, feature_width] at their positions.

        The fused context goes straight into k_proj/v_proj, not through input_layernorm:
        that is how the public checkpoints were trained.
        """
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        return [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]

    def block_mask(self, layer_type: str, ctx_positions: torch.Tensor, position: int, block: int) -> torch.Tensor:
        """Which keys each block row may see. Context slots with a negative position are empty."""
        rows = position + torch.arange(block, device=ctx_positions.device)
        live = (ctx_positions >= 0) & (ctx_positions < position)
        if layer_type == SLIDING:
            window = self.config.sliding_window
            ctx = live[None, :] & (ctx_positions[None, :] > rows[:, None] - window)
            blk = torch.ones(block, block, dtype=torch.bool, device=rows.device).tril()
        else:
            ctx = live[None, :].expand(block, -1)
            blk = torch.ones(block, block, dtype=torch.bool, device=rows.device)
        return torch.cat([ctx, blk], 1)

    def forward_block(
        self,
        noise: torch.Tensor,
        position: int,
        kv_buffers: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Block hidden states [B, hidden] for noise embeddings [B, hidden] whose slot 0 sits at `position`.

        kv_buffers: per layer, [kv_heads, >= C+B, head_dim] keys and values whose first C slots
        hold the context at `ctx_positions` [C] (negative: an empty slot).
        """
        x = noise.to(self.dtype)
        block, ctx_len = x.shape[0], ctx_positions.shape[0]
        positions = torch.arange(position, position + block, device=x.device)
        # Additive float masks: SDPA converts a bool mask on every call otherwise.
        masks = {
            t: torch.zeros((), dtype=x.dtype, device=x.device).masked_fill(
                ~self.block_mask(t, ctx_positions, position, block), float("-inf")
            )
            for t in set(self.config.layer_types)
        }
        for layer, (k, v) in zip(self.layers, kv_buffers, strict=True):
            x = layer(x, positions, k, v, ctx_len, masks[layer.layer_type])
        return self.norm(x)

    @torch.inference_mode()
    def forward(
        self, features: torch.Tensor, ctx_positions: torch.Tensor, noise: torch.Tensor, position: int
    ) -> torch.Tensor:
        """Recompute path: context K/V from scratch for every row given. Slow, simple, the reference."""
        ctx_positions = ctx_positions.to(self.device)
        ctx_len, block = features.shape[0], noise.shape[0]
        buffers = []
        for k, v in self.context_kv(features.to(self.device), ctx_positions):
            shape = (k.shape[1], ctx_len + block, k.shape[2])
            k_buf, v_buf = k.new_empty(shape), v.new_empty(shape)
            k_buf[:, :ctx_len], v_buf[:, :ctx_len] = k.transpose(0, 1), v.transpose(0, 1)
            buffers.append((k_buf, v_buf))
        return self.forward_block(noise, position, buffers, ctx_positions)
