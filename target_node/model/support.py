"""What the target adapter needs of a causal LM, checked when the target loads.

The adapter runs the model's decoder stack on one token sequence with a cache it owns, taps
decoder layers' outputs, and applies the LM head itself. A model that cannot be served that
way is refused here, with the reason, rather than failing in the middle of a request. What
can only be seen by running it is seen on two tokens: the decoder fills the cache it is
given, returns one hidden state per layer, and the model's own logits are its head applied
to the decoder's output (so no post-processing of the head goes unnoticed).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from target_node.engine.check import agrees


class UnsupportedModel(ValueError):
    """A model the target adapter cannot serve; the message says why."""


class ModelLoadError(ValueError):
    """A model folder that does not load as it is (broken config, weights missing or unreadable)."""


def check_config(config, name: str) -> None:
    """What its config says alone, before any weights load."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model; the target must be a decoder-only causal LM")


def check_structure(model: nn.Module) -> nn.Module:
    """What can be seen without running it; returns the decoder stack."""
    name = type(model).__name__
    check_config(model.config, name)
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise UnsupportedModel(f"{name} has no LM head (get_output_embeddings)")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModel(f"{name}: LM heads with a bias are not supported")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise UnsupportedModel(f"{name} exposes no decoder stack apart from its head (get_decoder)")
    return decoder


@torch.inference_mode()
def probe(model: nn.Module, decoder: nn.Module, cache: DynamicCache, head_logits) -> int:
    """Run two tokens; returns where the hidden-states tuple holds decoder layer 0's output (1 when
    index 0 is the embeddings, 0 in families that leave them out). `head_logits` maps final
    hidden states to logits the way the adapter does."""
    name = type(model).__name__
    layers = _decoder_layers(decoder, model.config)
    first: list[torch.Tensor] = []
    hook = layers[0].register_forward_hook(lambda m, a, out: first.append(out[0] if isinstance(out, tuple) else out))
    ids = torch.tensor([[1, 2]], device=next(model.parameters()).device)
    try:
        out = decoder(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    finally:
        hook.remove()
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None or hidden.shape[-1] != model.get_output_embeddings().weight.shape[-1]:
        raise UnsupportedModel(f"{name}'s decoder does not return the final hidden states (last_hidden_state)")
    if not _filled(cache, ids.shape[1]):
        raise UnsupportedModel(f"{name}'s decoder does not fill the cache it is given (cache=)")
    states = out.hidden_states or ()
    if len(states) != len(layers) + 1:
        raise UnsupportedModel(f"{name} returns {len(states)} hidden states for {len(layers)} layers")
    offset = next((k for k in (1, 0) if torch.equal(states[k], first[0])), 1 if len(layers) == 1 else None)
    if offset is None:
        raise UnsupportedModel(f"{name}'s hidden states do not hold its decoder layers' outputs")
    theirs = model(input_ids=ids, use_cache=False).logits[0]
    if not agrees(head_logits(hidden[0]), theirs, model.get_output_embeddings().weight.dtype):
        raise UnsupportedModel(
            f"{name}'s logits are not its LM head applied to the decoder output, up to the scalings this "
            "project knows (logit_scale, logits_scaling, lm_head_multiplier, final_logit_softcapping)"
        )
    return offset


def _decoder_layers(decoder: nn.Module, config) -> nn.ModuleList:
    count = config.get_text_config(decoder=True).num_hidden_layers
    for child in decoder.children():
        if isinstance(child, nn.ModuleList) and len(child) == count:
            return child
    raise UnsupportedModel(f"{type(decoder).__name__} holds no list of its {count} decoder layers")


def _filled(cache: DynamicCache, count: int) -> bool:
    attention = [layer for layer in cache.layers if isinstance(layer, CacheLayerMixin)]
    if attention:
        return cache.get_seq_length() == count
    return all(
        all(layer.has_previous_state.values())
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    )
