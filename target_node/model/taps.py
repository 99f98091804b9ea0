"""Which hidden states a drafter reads: the one rule both serving and training use.

A DFlash drafter taps the OUTPUT of target decoder layer `l` for each `l` in its
`target_layer_ids`: Hugging Face's `hidden_states[l + 1]` (index 0 is the embeddings),
before the final norm, concatenated along the feature axis in list order. Getting this
offset wrong silently collapses acceptance. A few families (Mamba2) leave the embeddings
out of the tuple, so layer l sits at `l + 0`: the target measures its model's offset when
it loads (`support.probe`). The tuple's last entry is the final-norm output, and "layer L-1"
reads that in every family, as the reference implementation and the engine do (distillation's
teacher is that tap through the head); drafters tap inner layers. (At offset 0, `L-1 + 0` was
the last layer's un-normed output: Mamba 2's teacher read it, an audit.)
"""

from __future__ import annotations

import torch


def tap_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...], offset: int = 1) -> torch.Tensor:
    """[..., len(layer_ids) * hidden] from a model's `output_hidden_states` tuple (an entry per decoder
    layer and one more: the embeddings first, or the final norm's output last)."""
    last = len(hidden_states) - 2  # the last decoder layer: the final norm's output, whatever the offset
    return torch.cat([hidden_states[-1 if layer == last else layer + offset] for layer in layer_ids], -1)
