"""Numbers that must agree up to rounding, and the engine's check against the transformers model.

The engine computes the architecture the transformers modules define (weights.py reads it from
them); this is where that claim is tested when a model loads, so a model the engine would compute
differently keeps the transformers path instead of serving wrong output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from target_node.engine.weights import EngineUnsupported


class LayerByLayer(Protocol):
    """What the check needs of an engine (which calls it while it loads): one layer run alone."""

    device: torch.device
    dtype: torch.dtype

    def layer_alone(self, i: int, tokens: list[int], given: torch.Tensor) -> torch.Tensor: ...


def agrees(ours: torch.Tensor, theirs: torch.Tensor, precision: torch.dtype, scale: float | None = None) -> bool:
    """Whether two computations of the same numbers, by a model in `precision`, agree up to
    rounding: a thousandth of the largest entry (or of `scale`, the size of what the numbers were
    computed from, where that is larger) in fp32, a few hundredths in half precision. A missing
    step or a misplaced row is off by far more."""
    share = 1e-3 if precision == torch.float32 else 3e-2
    size = max(float(theirs.float().abs().max()), scale or 0.0)
    return bool((ours.float() - theirs.float()).abs().max() <= share * size)


@torch.inference_mode()
def check_against(engine: LayerByLayer, model: nn.Module) -> None:
    """The engine must compute the model the transformers modules define. On a few tokens, each
    layer is given the input the transformers forward gave it, and its output must agree with
    theirs up to rounding (so one layer's rounding, not the drift of a whole bf16 stack, is what
    is measured); a missing op or a wrong one is off by the values' size, and refused."""
    ids = [1, 7, 3, 11, 5, 2, 9, 4]
    decoder = model.get_decoder()
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            given = kwargs.get("hidden_states", args[0] if args else None)
            seen[i] = (given[0], out[0] if isinstance(out, tuple) else out)

        return hook

    hooks = [layer.register_forward_hook(capture(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)]
    try:
        final = decoder(input_ids=torch.tensor([ids], device=engine.device)).last_hidden_state[0]
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(seen)
    for i in range(layers):
        given, theirs = seen[i]
        ours = engine.layer_alone(i, ids, given.float())
        # A layer that adds to a large residual is rounded at the residual's size.
        if not agrees(ours, theirs, engine.dtype, scale=float(given.float().abs().max())):
            raise EngineUnsupported(f"layer {i}'s output differs from the transformers layer beyond rounding")
    if not agrees(engine.final_norm(seen[layers - 1][1].float()), final, engine.dtype):
        raise EngineUnsupported("the final norm differs from the transformers model's beyond rounding")
