"""A draft step on the CPU kernels: each drafter layer computed as the engine computes a target layer.

A draft step has a handful of rows, and in torch each layer was some 60 small operations (masks,
rotary, views, SDPA and its conversions) around seven matmuls: on a CPU they cost more than the
matmuls, and more again after a target step has streamed its weights through the caches. Here a
layer is a dozen kernel calls: its norm; q, k and v into one row buffer; the q/k norms and rotary,
with the block's keys and values written into its context buffers (`rope_store`); attention over
each row's visible keys (the engine's `attention`, no mask built); o_proj onto the residual; the
MLP's norm, gate and up, SiLU x up, and down onto the residual.

Its numbers are not torch's path's (attention in fp32 over the bf16 keys, where SDPA computes in
bf16), but every row is computed by the same operations whatever rows run beside it, as the
kernels' linear is: sessions drafted in one pass keep the bits each gets alone. Drafts need not
be exact; the target verifies them. Inference only, for DFlash layers of full bidirectional
attention whose block rows share one anchor per sequence; everything else takes torch's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dflash_kernels
from draft_node.config import FULL


def serves(drafter) -> bool:
    """Whether `drafter` (a DFlashDrafter) infers on the kernels here and now."""
    cfg = drafter.config
    return (
        not torch.is_grad_enabled()
        and not cfg.dflash2
        and all(t == FULL and not cfg.causal(t) for t in cfg.layer_types)
        and dflash_kernels.runs_on(drafter.device)
    )


def _angles(drafter, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows [rows, head_dim] at `positions`: every layer's rotary is the config's."""
    cos, sin = drafter.layers[0].self_attn.rotary.cos_sin(positions)
    return cos.reshape(positions.shape[0], -1).contiguous(), sin.reshape(positions.shape[0], -1).contiguous()


def _int32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32)


def context_kv(drafter, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DFlashDrafter.context_kv on the kernels: per layer, rotated keys and values [n, kv_heads, head_dim]."""
    rows = features.shape[0]
    ctx = drafter.hidden_norm(dflash_kernels.linear(features.float().contiguous(), drafter.fc.packed()))
    cos, sin = _angles(drafter, positions)
    first, at = _int32([0] * rows), _int32(range(rows))
    kv = []
    for layer in drafter.layers:
        attn = layer.self_attn
        width = attn.kv_heads * attn.head_dim
        rows_kv = torch.empty(rows, 2 * width)
        dflash_kernels.linear(ctx, attn.k_proj.packed(), out=rows_kv[:, :width])
        dflash_kernels.linear(ctx, attn.v_proj.packed(), out=rows_kv[:, width:])
        k, v = torch.empty(1, attn.kv_heads, rows, attn.head_dim), torch.empty(1, attn.kv_heads, rows, attn.head_dim)
        torch.ops.dflash.rope_store(
            rows_kv, cos, sin, k, v, first, at, 0, attn.kv_heads, None, attn.k_norm.weight32(), attn.k_norm.eps
        )
        kv.append((k[0].transpose(0, 1), v[0].transpose(0, 1)))
    return kv


@dataclass
class _Run:
    """Where one Context's rows read and write: rows [start, stop) of the pass, each row's sequence
    within the run (`slot`) and the buffer index of its own key (`index`), and its visible keys:
    buffer indices [lo, hi), then `count` of `extra`."""

    start: int
    stop: int
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    slot: torch.Tensor
    index: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    extra: torch.Tensor
    count: torch.Tensor


def _runs(contexts: list, row_anchors: torch.Tensor, rows: int) -> list[_Run] | None:
    """Each context's rows and keys; None where a sequence's rows do not share one anchor (training's
    many blocks per sequence) or its buffers are not laid out as the kernels read them."""
    runs, first = [], 0
    for context in contexts:
        seqs, width = context.sequences, context.positions.shape[-1]
        anchors = row_anchors[first : first + seqs]
        if not bool((anchors == anchors[:, :1]).all()):
            return None
        if any(not (k.is_contiguous() and v.is_contiguous()) or k.shape[2] < width + rows for k, v in context.buffers):
            return None
        held = context.positions.expand(seqs, width)
        visible = (held >= 0) & (held < anchors[:, :1])
        start, stop = first * rows, (first + seqs) * rows
        slot = _int32(torch.arange(seqs).repeat_interleave(rows))
        index = _int32((width + torch.arange(rows)).repeat(seqs))
        many = seqs * rows
        if bool(visible.all()):  # the usual step: every slot of the context, then the block's rows
            lo, hi = torch.zeros(many, dtype=torch.int32), torch.full((many,), width + rows, dtype=torch.int32)
            extra, count = torch.empty(many, 0, dtype=torch.int32), torch.zeros(many, dtype=torch.int32)
        else:  # holes (a ring wrapped and then rolled back): each sequence's valid slots, listed
            lists = [torch.cat([visible[s].nonzero()[:, 0], width + torch.arange(rows)]) for s in range(seqs)]
            longest = max(len(keys) for keys in lists)
            extra = torch.zeros(seqs, longest, dtype=torch.int32)
            for s, keys in enumerate(lists):
                extra[s, : len(keys)] = keys
            extra = extra.repeat_interleave(rows, 0).contiguous()
            count = _int32([len(keys) for keys in lists for _ in range(rows)])
            lo = hi = torch.zeros(many, dtype=torch.int32)
        runs.append(_Run(start, stop, list(context.buffers), slot, index, lo, hi, extra, count))
        first += seqs
    return runs


def run_blocks(
    drafter, noise: torch.Tensor, row_positions: torch.Tensor, row_anchors: torch.Tensor, contexts: list
) -> torch.Tensor | None:
    """DFlashDrafter.run_blocks on the kernels: hidden states [S, R, hidden] in fp32, or None where
    these blocks are not its to draft (`_runs`)."""
    seqs, rows, hidden = noise.shape
    runs = _runs(contexts, row_anchors, rows)
    if runs is None:
        return None
    x = noise.reshape(seqs * rows, hidden).to(torch.float32, copy=True)
    if drafter.config.input_embedding_scale != 1.0:
        x.mul_(drafter.config.input_embedding_scale)
    cos, sin = _angles(drafter, row_positions.reshape(-1))
    for i, layer in enumerate(drafter.layers):
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, dim = attn.heads, attn.kv_heads, attn.head_dim
        h = layer.input_layernorm(x)
        qkv = torch.empty(x.shape[0], (heads + 2 * kv_heads) * dim)
        dflash_kernels.linear(h, attn.q_proj.packed(), out=qkv[:, : heads * dim])
        dflash_kernels.linear(h, attn.k_proj.packed(), out=qkv[:, heads * dim : (heads + kv_heads) * dim])
        dflash_kernels.linear(h, attn.v_proj.packed(), out=qkv[:, (heads + kv_heads) * dim :])
        out = torch.empty(x.shape[0], heads * dim)
        for run in runs:
            k, v = run.buffers[i]
            part = slice(run.start, run.stop)
            torch.ops.dflash.rope_store(
                qkv[part], cos[part], sin[part], k, v, run.slot, run.index, heads, kv_heads,
                attn.q_norm.weight32(), attn.k_norm.weight32(), attn.q_norm.eps,
            )  # fmt: skip
            torch.ops.dflash.attention(
                qkv[part], k, v, run.slot, run.lo, run.hi, run.extra, run.count, heads, dim**-0.5, out[part]
            )
        dflash_kernels.linear(out, attn.o_proj.packed(), residual=x, out=x)
        h = layer.post_attention_layernorm(x)
        inner = mlp.gate_proj.weight.shape[0]
        gate_up = torch.empty(x.shape[0], 2 * inner)
        dflash_kernels.linear(h, mlp.gate_proj.packed(), out=gate_up[:, :inner])
        dflash_kernels.linear(h, mlp.up_proj.packed(), out=gate_up[:, inner:])
        act = torch.empty(x.shape[0], inner)
        torch.ops.dflash.silu_mul(gate_up, act)
        dflash_kernels.linear(act, mlp.down_proj.packed(), residual=x, out=x)
    return drafter.norm(x).view(seqs, rows, hidden)
