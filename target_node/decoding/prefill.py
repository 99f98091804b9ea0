"""The prompt's forward pass, in chunks, so a daemon stays responsive during a long prompt.

One forward over a long prompt holds the daemon's only thread for as long as it takes;
chunks of a few hundred tokens cost about the same in total (the KV cache carries the
context from chunk to chunk) and leave gaps where the daemon answers pings, takes in
other clients' messages and notices a cancel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from target_node.model.target import TargetModel


def prefill(
    target: TargetModel,
    prompt: list[int],
    taps: tuple[int, ...],
    chunk: int = 0,
    between: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run `prompt` into the target's (empty) cache, `chunk` tokens at a time (0: at once),
    calling `between` after each chunk but the last. Returns the last position's final hidden
    state [1, hidden] and every position's tapped features (None without taps); None when
    `cancel` was set between chunks."""
    step = chunk if chunk > 0 else len(prompt)
    last, features = None, []
    for start in range(0, len(prompt), step):
        if start:
            if between is not None:
                between()
            if cancel is not None and cancel.is_set():
                return None
        hidden, tapped = target.forward(prompt[start : start + step], taps)
        last = hidden[-1:]
        if tapped is not None:
            features.append(tapped)
    if not features:
        return last, None
    return last, features[0] if len(features) == 1 else torch.cat(features)
