"""The DFlash block-diffusion drafter, readable top to bottom.

The drafter owns no embedding table and no LM head: the target embeds the noise block
`[last_tok, MASK, ...]` and projects the returned hidden states itself. What the drafter
adds is context: features tapped from the target's layers are fused into one row per
committed position and injected as extra keys/values into every layer's attention.
Those context keys/values depend only on the row and its position, so they are computed
once per committed position (see kv_cache.py); the noise block is recomputed each step.

DFlash2 wraps each attention and MLP in a grouped dynamic causal convolution over the block's
rows (GroupedConv) and adds a candidate selector whose codebooks turn the target's top-k per
position into one coherent chain (CandidateSelector; the walk runs where the logits are).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dflash_kernels
from dflash_kernels.row_blocks import Linear, in_row_blocks
from draft_node import kernel_path
from draft_node.config import SLIDING, DFlashConfig, drafter_info


class RMSNorm(nn.Module):
    _weight32: torch.Tensor | None = None
    _weight32_from: tuple[int, int] = (-1, -1)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.is_grad_enabled() and dflash_kernels.runs_on(x.device):
            return self._on_kernels(x)
        return in_row_blocks(self._normalize, x)

    def _on_kernels(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 rows through the kernels' norm: one op where torch's takes eight."""
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.dflash.rmsnorm(x, self.weight32(), self.eps, False, out)
        return out

    def weight32(self) -> torch.Tensor:
        """The weight in fp32, as the kernels read it, copied again after a load or an optimizer changed it."""
        weight, version = self.weight, (self.weight.data_ptr(), self.weight._version)
        if self._weight32_from != version:
            self._weight32, self._weight32_from = weight.detach().float().contiguous(), version
        return self._weight32

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the Qwen3 reference, so bf16 drafters match trained numerics.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary:
    """The drafter's rotary frequencies: plain RoPE from theta, or a scaled variant (linear, YaRN,
    Llama 3) whose frequencies and attention factor transformers' own RoPE functions compute.
    Computed once: a draft step rotates a handful of rows, where building them cost more."""

    def __init__(self, cfg: DFlashConfig) -> None:
        with torch.device("cpu"):  # real numbers even while a checkpoint's skeleton is built on meta
            self.inv_freq, self.scale = inverse_frequencies(cfg.head_dim, cfg.rope_theta), 1.0
        if cfg.rope_scaling is not None:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            config = Qwen3Config(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_position_embeddings or _scaled_length(cfg.rope_scaling),
                rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta},
            )
            with torch.device("cpu"):  # real numbers even while a checkpoint's skeleton is built on meta
                inv_freq, scale = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](config, torch.device("cpu"))
            self.inv_freq, self.scale = inv_freq.float(), float(scale)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.cos_sin(positions))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, 1, head_dim] at `positions` [rows], for every tensor rotated there."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return cos_sin(positions, self.inv_freq, self.scale)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate_by(x, *cos_sin)


def _scaled_length(scaling: dict) -> int:
    """The context a scaled RoPE was stretched to, where the config does not state it."""
    return int(scaling.get("original_max_position_embeddings", 32768) * scaling["factor"])


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE's frequencies [head_dim / 2]."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) / half))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotate-half cos and sin [rows, 1, head_dim] at `positions` [rows], scaled by `scale` (YaRN)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] rotated by `cos_sin`'s angles, computed in fp32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attention_mask(
    layer_type: str,
    window: int | None,
    ctx_positions: torch.Tensor,
    row_positions: torch.Tensor,
    row_anchors: torch.Tensor,
    causal: bool | None = None,
) -> torch.Tensor:
    """Which keys each block row may see: [..., rows, context + rows], True = visible.

    Keys are the context slots (at `ctx_positions`; negative marks an empty slot) followed by
    the block rows themselves. A row at position p in the block whose slot 0 sits at anchor a
    sees the context before a, and the rows of its own block: all of them, or those at or
    before p where the block is `causal` (by default: in sliding layers). Sliding layers also
    drop context older than the window. One block at inference, many anchors per sequence in
    training: the same rule.
    """
    ctx = ctx_positions[..., None, :]
    pos, anchor = row_positions[..., :, None], row_anchors[..., :, None]
    sees_ctx = (ctx >= 0) & (ctx < anchor)
    sees_row = anchor == row_anchors[..., None, :]
    if layer_type == SLIDING:
        sees_ctx = sees_ctx & (ctx > pos - window)
    if (layer_type == SLIDING) if causal is None else causal:
        sees_row = sees_row & (row_positions[..., None, :] <= pos)
    return torch.cat([sees_ctx, sees_row], -1)


class GroupedConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around one sublayer, over a block's rows.

    Its kernel is a learned base plus a delta computed from the sublayer's (normed) input row,
    one delta per group of `group` adjacent channels. Side 0 convolves the sublayer's input,
    side 1 its output, both with the deltas of the input row:
    out[t, c] = sum over taps j <= t (within the block) of (base[j, c] + delta[t, j, c // group]) * x[t - j, c].
    """

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, R, hidden], R a whole number of blocks: (x convolved by side 0, side 1's deltas)."""
        deltas = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self.convolve(x, self.base_kernel[0], deltas[..., 0, :, :], block), deltas[..., 1, :, :]

    def finish(self, y: torch.Tensor, deltas: torch.Tensor, block: int) -> torch.Tensor:
        return self.convolve(y, self.base_kernel[1], deltas, block)

    def convolve(self, x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor, block: int) -> torch.Tensor:
        s, rows, hidden = x.shape
        blocks = x.view(s, rows // block, block, hidden)
        kernel = base[None, None] + deltas.repeat_interleave(self.group, -1)  # [S, R, taps, hidden]
        kernel = kernel.view(s, rows // block, block, self.taps, hidden)
        out = blocks * kernel[..., 0, :]
        for j in range(1, min(self.taps, block)):  # tap j reads row t - j; the block's first j rows see zeros
            out = out + F.pad(blocks[:, :, :-j], (0, 0, j, 0)) * kernel[..., j, :]
        return out.reshape(s, rows, hidden)


class CandidateSelector(nn.Module):
    """DFlash2's codebooks: a drafted token's score given its predecessor adds
    <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[token]> to its logit.
    The drafter computes the projection (its `gate`); the walk needs the target's logits and runs
    beside them (target_node/drafting/selector.py)."""

    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.hidden_projection = Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))


@dataclass
class Context:
    """A run of sequences whose context keys/values share one layout: per layer, buffers
    [sequences, kv_heads, >= C+R, head_dim] whose first C slots hold the context at `positions`
    ([C] or [sequences, C]; negative: an empty slot), the next R free for the block rows' own."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor

    @property
    def sequences(self) -> int:
        return self.buffers[0][0].shape[0]


LayerContext = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]  # one layer's keys, values, C, mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head.

    q [S, R, heads, d], k/v [S, kv_heads, L, d], mask [S, R, L] additive in k's dtype -> [S, R, heads * d].
    Each kv head serves its group's rows in one call, so K/V are read where they lie. Queries meet
    keys in the keys' dtype (a bf16 context ring under fp32 activations); the rows leave in q's.
    """
    s, rows, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.view(s, rows, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, group * rows, d)
    out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask.repeat(1, group, 1)[:, None])
    return out.view(s, kv_heads, group, rows, d).permute(0, 3, 1, 2, 4).reshape(s, rows, heads * d).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary = Rotary(cfg)
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(
        self, x: torch.Tensor, positions: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [rows, kv_heads, head_dim] for rows x [rows, hidden] at their
        positions (`angles`: their `Rotary.cos_sin`, where the caller has them)."""
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        return self.rotary.apply(k, angles or self.rotary.cos_sin(positions)), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, contexts: list[LayerContext]) -> torch.Tensor:
        """Block rows x [S, R, hidden] at positions [S, R] attend over their context and block rows.

        `contexts` split the S sequences into runs, in order, each with its own buffers
        [S_run, kv_heads, >= C+R, head_dim] whose first C slots hold that run's context; the rows'
        own keys/values are written into the next R, so attention reads one contiguous run with
        no concatenation. The projections see every run's rows at once (they are row-wise);
        attention reads each run where its keys lie.
        """
        s, rows, _ = x.shape
        flat, where = x.reshape(s * rows, -1), positions.reshape(-1)
        angles = self.rotary.cos_sin(where)
        q = self.rotary.apply(self.q_norm(self.q_proj(flat).view(-1, self.heads, self.head_dim)), angles)
        k, v = self.keys_values(flat, where, angles)
        q = q.view(s, rows, self.heads, -1)
        k, v = k.view(s, rows, self.kv_heads, -1), v.view(s, rows, self.kv_heads, -1)
        out, first = [], 0
        for k_buf, v_buf, ctx_len, mask in contexts:
            run, end = slice(first, first + k_buf.shape[0]), ctx_len + rows
            k_buf[:, :, ctx_len:end] = k[run].transpose(1, 2)
            v_buf[:, :, ctx_len:end] = v[run].transpose(1, 2)
            out.append(attend(q[run], k_buf[:, :, :end], v_buf[:, :, :end], mask))
            first = run.stop
        return self.o_proj(out[0] if len(out) == 1 else torch.cat(out))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type, self.block = layer_type, cfg.block_size
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2:
            self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, contexts: list[LayerContext]) -> torch.Tensor:
        """Rows x [S, R, hidden]: R is a whole number of blocks, each block's rows in order."""
        attend = lambda u: self.self_attn(u, positions, contexts)  # noqa: E731
        x = x + self.sublayer(attend, self.input_layernorm(x), getattr(self, "attention_conv", None))
        return x + self.sublayer(self.mlp, self.post_attention_layernorm(x), getattr(self, "mlp_conv", None))

    def sublayer(self, run, u: torch.Tensor, conv: GroupedConv | None) -> torch.Tensor:
        if conv is None:
            return run(u)
        u, deltas = conv.prepare(u, self.block)
        return conv.finish(run(u), deltas, self.block)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2:
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank)
        self.draft_vocab: list[int] = []  # token ids it proposes from; [] = the whole vocabulary

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def inference_dtype(self) -> torch.dtype:
        """What inference computes in: fp32 on the CPU kernels, whose linear takes and gives fp32
        (rounding a bf16 drafter's activations to bf16 itself) and whose norm reads fp32, so bf16
        activations there only added a conversion around each operation, a third of a draft step;
        elsewhere the weights' dtype. A context ring and the block hidden states stay in the
        weights' dtype either way."""
        return torch.float32 if dflash_kernels.runs_on(self.device) else self.dtype

    def activation_dtype(self) -> torch.dtype:
        return self.dtype if torch.is_grad_enabled() else self.inference_dtype

    def describe(self, ring_capacity: int) -> dict:
        """What a target needs to know of this drafter (the wire's DRAFTER_INFO)."""
        return drafter_info(self.config, self.draft_vocab, ring_capacity, self.codebook_checksum())

    def codebook_checksum(self) -> str:
        """DFlash2: a digest of the selector's codebooks, taken once ("" for DFlash)."""
        if not self.config.dflash2:
            return ""
        if getattr(self, "_checksum", None) is None:
            digest = hashlib.sha256()
            for book in self.codebooks():
                digest.update(book.detach().float().cpu().numpy().tobytes())
            self._checksum = digest.hexdigest()[:32]
        return self._checksum

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2: the selector's (predecessor, successor) codebooks [vocab, rank]."""
        selector = self.candidate_selector
        return selector.predecessor_codebook.detach(), selector.successor_codebook.detach()

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """DFlash2: the selector's projection [rows, rank] of block hidden states (the final-normed
        rows the target projects through its head), sent with them."""
        return self.candidate_selector.hidden_projection(hidden)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [C, kv_heads, head_dim] for feature rows [C, feature_width].

        The fused context goes straight into k_proj/v_proj, not through input_layernorm:
        that is how the public checkpoints were trained. `scale` (training only) multiplies
        the features before fc; exporting folds it into fc.weight.
        """
        if scale is None and kernel_path.serves(self):
            return kernel_path.context_kv(self, features, positions)
        features = features.to(self.activation_dtype())
        ctx = self.hidden_norm(self.fc(features if scale is None else features * scale))
        return [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]

    def run_blocks(
        self,
        noise: torch.Tensor,
        row_positions: torch.Tensor,
        row_anchors: torch.Tensor,
        contexts: list[Context],
    ) -> torch.Tensor:
        """Hidden states [S, R, hidden] of block rows (noise embeddings [S, R, hidden]).

        `contexts` hold the S sequences' context keys/values, in order: one run of sequences
        that share a context layout each (training's batch), or one per sequence (a draft daemon's
        sessions, each in its own ring). Every row-wise operation runs over all S at once.
        """
        if kernel_path.serves(self):
            hidden = kernel_path.run_blocks(self, noise, row_positions, row_anchors, contexts)
            if hidden is not None:
                return hidden.to(self.dtype)
        cfg = self.config
        x = noise.to(self.activation_dtype())
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        per_layer: list[list[LayerContext]] = [[] for _ in self.layers]
        first = 0
        for context in contexts:
            run = slice(first, first + context.sequences)
            # Additive float masks: SDPA converts a bool mask on every call otherwise.
            masks = {
                t: torch.zeros((), dtype=context.buffers[0][0].dtype, device=x.device)
                .masked_fill(
                    ~attention_mask(
                        t, cfg.sliding_window, context.positions, row_positions[run], row_anchors[run], cfg.causal(t)
                    ),
                    float("-inf"),
                )
                .expand(context.sequences, -1, -1)
                for t in set(cfg.layer_types)
            }
            ctx_len = context.positions.shape[-1]
            for into, layer, (k, v) in zip(per_layer, self.layers, context.buffers, strict=True):
                into.append((k, v, ctx_len, masks[layer.layer_type]))
            first = run.stop
        for layer, layer_contexts in zip(self.layers, per_layer, strict=True):
            x = layer(x, row_positions, layer_contexts)
        hidden = self.norm(x)
        return hidden if torch.is_grad_enabled() else hidden.to(self.dtype)

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
        block = noise.shape[0]
        rows = torch.arange(position, position + block, device=noise.device)[None]
        context = Context([(k[None], v[None]) for k, v in kv_buffers], ctx_positions)
        return self.run_blocks(noise[None], rows, torch.full_like(rows, position), [context])[0]

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

    def forward_anchors(
        self, features: torch.Tensor, anchors: torch.Tensor, noise: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training: a block at every anchor of every sequence, in one pass.

        features [S, T, feature_width] are the context rows at positions 0..T-1 of each sequence,
        anchors [S, N] the blocks' slot-0 positions, noise [S, N, B, hidden] their embeddings.
        Returns block hidden states [S, N, B, hidden], each equal to `forward` of that block alone.
        """
        s, span, _ = features.shape
        n, block = noise.shape[1], noise.shape[2]
        ctx_positions = torch.arange(span, device=self.device)
        rows = (anchors[:, :, None] + torch.arange(block, device=self.device)).reshape(s, n * block)
        buffers = []
        for k, v in self.context_kv(features.reshape(s * span, -1), ctx_positions.repeat(s), scale):
            shape = (s, k.shape[1], span + n * block, k.shape[2])
            k_buf, v_buf = k.new_empty(shape), v.new_empty(shape)
            k_buf[:, :, :span] = k.view(s, span, *k.shape[1:]).transpose(1, 2)
            v_buf[:, :, :span] = v.view(s, span, *v.shape[1:]).transpose(1, 2)
            buffers.append((k_buf, v_buf))
        row_anchors = anchors.repeat_interleave(block, 1)
        context = Context(buffers, ctx_positions)
        hidden = self.run_blocks(noise.reshape(s, n * block, -1), rows, row_anchors, [context])
        return hidden.view(s, n, block, -1)
