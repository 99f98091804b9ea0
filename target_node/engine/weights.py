"""The decoder's weights, read from its transformers modules and laid out once for the kernels.

The engine does not define an architecture of its own: it reads the one the transformers
modules implement (pre-norm decoder layers with RMSNorm, rotary attention with optional q/k
norms and biases, a gated SiLU MLP), from the modules themselves, and refuses anything else
by name so the caller can keep the transformers path for it. What it changes is the layout:
q, k and v become one matrix, gate and up another, each packed in panels of 64 outputs for the
kernels' outer-product form (`pack`). The modules keep their own weights, so the transformers
forward still runs (the load check, tests, training); the packed copy is the engine's.

Which layers slide, and how far, comes from the model's own cache layers (the same source the
rollback policies use): a sliding layer is full attention with a window on the key list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from dflash_kernels import Packed, pack

# Rotary variants whose frequencies do not change with the sequence (a cached key stays valid).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class EngineUnsupported(ValueError):
    """A model the engine does not serve (the transformers path does); the message says why."""


@dataclass
class LayerWeights:
    norm_attn: torch.Tensor  # [hidden] fp32
    qkv: Packed  # (hq + 2 hkv) d outputs
    qkv_bias: torch.Tensor | None  # [(hq + 2 hkv) d] fp32
    q_norm: torch.Tensor | None  # [d] fp32 (Qwen3)
    k_norm: torch.Tensor | None
    o: Packed
    o_bias: torch.Tensor | None
    norm_mlp: torch.Tensor
    gate_up: Packed  # 2 I outputs: gate, then up
    gate_up_bias: torch.Tensor | None
    down: Packed
    down_bias: torch.Tensor | None
    window: int | None  # sliding window (keys with position > p - window), None for full attention


@dataclass
class DecoderWeights:
    embed: nn.Embedding
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: Packed
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    rotary: nn.Module  # the model's own rotary embedding: cos/sin by position


def _bias(*modules: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in modules):
        return None
    return torch.cat(
        [
            m.bias.detach().float() if m.bias is not None else torch.zeros(m.weight.shape[0], device=m.weight.device)
            for m in modules
        ]
    )


def _norm(module: nn.Module, what: str) -> torch.Tensor:
    if type(module).__name__ not in NORMS:
        raise EngineUnsupported(f"{what} is a {type(module).__name__}, not an RMSNorm the engine computes")
    return module.weight.detach().float().contiguous()


def read_decoder(model: nn.Module, prepare: Callable[..., Packed] = pack) -> DecoderWeights:
    """The decoder's weights laid out by `prepare` (the CPU kernels' `pack`, or as they are for torch's
    matmuls), or EngineUnsupported with the reason."""
    config = model.config
    decoder = getattr(model, "model", None)
    name = type(model).__name__
    if decoder is None or not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise EngineUnsupported(f"{name} is not a decoder of embed_tokens, layers, norm and rotary_emb")
    dtype = model.get_output_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise EngineUnsupported(f"the engine runs float32 and bfloat16 weights, not {dtype}")
    if getattr(config, "hidden_act", None) != "silu":
        raise EngineUnsupported(f"{name}'s MLP activation is {getattr(config, 'hidden_act', None)!r}, not silu")
    rotary = decoder.rotary_emb
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE:
        raise EngineUnsupported(f"rotary type {rotary.rope_type!r} changes with the sequence length")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0 or rotary.inv_freq.numel() * 2 != head_dim:
        raise EngineUnsupported("partial rotary embeddings are not served by the engine")
    cache_layers = DynamicCache(config=config).layers
    layers = []
    for i, layer in enumerate(decoder.layers):
        layers.append(_read_layer(layer, i, cache_layers[i] if i < len(cache_layers) else None, prepare))
    attn = decoder.layers[0].self_attn
    return DecoderWeights(
        embed=decoder.embed_tokens,
        layers=layers,
        norm=_norm(decoder.norm, "the final norm"),
        head=prepare(model.get_output_embeddings().weight),
        eps=float(decoder.norm.variance_epsilon),
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        scaling=float(attn.scaling),
        rotary=rotary,
    )


def _read_layer(layer: nn.Module, index: int, cache_layer, prepare) -> LayerWeights:
    where = f"layer {index}"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in linears):
        raise EngineUnsupported(f"{where} has no self_attn with q/k/v/o projections")
    if mlp is None or not all(
        isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
    ):
        raise EngineUnsupported(f"{where}'s MLP is not a gated gate/up/down MLP")
    extra = {n for n, _ in layer.named_children()} - {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    if extra:
        raise EngineUnsupported(f"{where} has modules the engine does not compute: {sorted(extra)}")
    extra = {n for n, _ in attn.named_children()} - {*linears, "q_norm", "k_norm"}
    if extra:
        raise EngineUnsupported(f"{where}'s attention has modules the engine does not compute: {sorted(extra)}")
    if type(cache_layer) is DynamicSlidingWindowLayer:
        window = int(cache_layer.sliding_window)
    elif type(cache_layer) is DynamicLayer:
        window = None
    else:
        raise EngineUnsupported(f"{where}'s cache layer is a {type(cache_layer).__name__}, not attention")
    q, k, v, o = (getattr(attn, n) for n in linears)
    return LayerWeights(
        norm_attn=_norm(layer.input_layernorm, f"{where}'s input norm"),
        qkv=prepare(q.weight, k.weight, v.weight),
        qkv_bias=_bias(q, k, v),
        q_norm=_norm(attn.q_norm, f"{where}'s q norm") if hasattr(attn, "q_norm") else None,
        k_norm=_norm(attn.k_norm, f"{where}'s k norm") if hasattr(attn, "k_norm") else None,
        o=prepare(o.weight),
        o_bias=_bias(o),
        norm_mlp=_norm(layer.post_attention_layernorm, f"{where}'s MLP norm"),
        gate_up=prepare(mlp.gate_proj.weight, mlp.up_proj.weight),
        gate_up_bias=_bias(mlp.gate_proj, mlp.up_proj),
        down=prepare(mlp.down_proj.weight),
        down_bias=_bias(mlp.down_proj),
        window=window,
    )
