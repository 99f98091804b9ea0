"""Which hidden states a drafter reads: the one rule both serving and training use.

A DFlash drafter taps the OUTPUT of target decoder layer `l` for each `l` in its
`target_layer_ids`: Hugging Face's `hidden_states[l + 1]` (index 0 is the embeddings),
before the final norm, concatenated along the feature axis in list order. Getting this
offset wrong silently collapses acceptance.
"""

from __future__ import annotations

import torch


def tap_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[..., len(layer_ids) * hidden] from a model's `output_hidden_states` tuple."""
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], -1)
