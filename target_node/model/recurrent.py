"""Rolling back recurrent layers: linear attention and state-space (Mamba-style) layers.

Such a layer folds every position it runs into one fixed-size state (a short convolution
window and a recurrent matrix), so the tail of a verify cannot be cut off: the state at the
accepted length has to be had some other way. Two ways, chosen per target:

- `capture`, what serving engines do: while a verify runs, each recurrent mixer takes its
  tokens one at a time and the state after every position is copied aside; rollback puts
  back the one at the accepted length. No second forward, but the mixers give up their
  chunked kernels for the width of a verify.
- `replay`: only the state before the verify is copied; after acceptance it is put back and
  the accepted tokens run through the decoder again (the attention layers having dropped
  the whole verify first). Nothing about the model's insides is assumed, but a step that
  rejects a draft pays a second, shorter forward.

Capture falls back to replay wherever it holds no state for the length asked: forwards
longer than `CAPTURE_LIMIT` (prefills) are never captured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from target_node.engine.check import agrees
from target_node.model.policies import CAPTURE, REPLAY
from target_node.model.support import UnsupportedModel

CAPTURE_LIMIT = 64


def align_time_step_limits(model: nn.Module) -> None:
    """Give each state-space mixer the step-size limit its config states. transformers 5's Nemotron-H
    mixer clamps its step sizes at `time_step_min` in the chunked scan but not in its one-token step
    (its config's `time_step_limit`, (0, inf), clamps nothing): a row run alone differed from the same
    row run in a prefill or a verify by up to 0.2%, so training's prefilled features were not the rows
    served, nor a verify's logits a plain step's (an audit). Where a mixer already has its config's
    limit (Mamba 2, Falcon-H1), nothing changes. A config that states none (Zamba2, whose mixers clamp
    as Nemotron-H's did) gets the one limit the one-token step honours too: none, (0, inf) (a review)."""
    stated = getattr(model.config.get_text_config(decoder=True), "time_step_limit", None) or (0.0, float("inf"))
    for module in model.modules():
        if isinstance(getattr(module, "time_step_limit", None), tuple | list):
            module.time_step_limit = tuple(stated)


@dataclass
class LayerState:
    """One recurrent cache layer's state, copied out."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    started: dict[int, bool]

    @classmethod
    def save(cls, layer: LinearAttentionCacheLayerMixin) -> LayerState:
        return cls(_copy(layer.conv_states), _copy(layer.recurrent_states), dict(layer.has_previous_state))

    def load(self, layer: LinearAttentionCacheLayerMixin) -> None:
        # Copies go in, so a saved state stays valid however often it is loaded.
        layer.conv_states.update(_copy(self.conv))
        layer.recurrent_states.update(_copy(self.recurrent))
        layer.has_previous_state.update(self.started)


def _copy(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if t is None else t.clone() for i, t in states.items()}


def recurrent_layers(cache: DynamicCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


class RecurrentRollback:
    """The recurrent layers' share of a target's rollback (one request at a time)."""

    def __init__(self, model: nn.Module, new_cache: Callable[[], DynamicCache], mode: str) -> None:
        """`model`: the causal LM, whose `get_decoder()` fills caches made by `new_cache`."""
        if mode not in (CAPTURE, REPLAY):
            raise ValueError(f"unknown recurrent rollback {mode!r}; choose {CAPTURE} or {REPLAY}")
        self.mode, self.decoder, self.new_cache = mode, model.get_decoder(), new_cache
        self.layers = recurrent_layers(new_cache())
        self.cache: DynamicCache | None = None  # the cache of the last prepared forward
        self.before: list[LayerState] = []  # each recurrent layer's state at that forward's start
        self.after: dict[int, list[LayerState]] = {}  # per layer: its state after each position (capture)
        self.ids: torch.Tensor | None = None  # that forward's input ids (replay)
        self.armed = False  # capture the forward now running
        self.decoder.register_forward_pre_hook(self._note_ids, with_kwargs=True)
        if mode == CAPTURE:
            for index, mixer in self._find_mixers().items():
                _step_tokens(mixer, self, index)
            self._check_capture()

    def prepare(self, cache: DynamicCache, count: int) -> None:
        """Before `count` tokens run: keep what a rollback into them needs."""
        self.cache, self.ids = cache, None
        self.before = [LayerState.save(cache.layers[i]) for i in self.layers]
        self.after = {i: [] for i in self.layers}
        self.armed = self.mode == CAPTURE and 1 < count <= CAPTURE_LIMIT

    def _note_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("cache") is self.cache and self.ids is None:
            self.ids = kwargs.get("input_ids")

    def state_at(self, offset: int) -> list[LayerState] | None:
        """Every recurrent layer's state `offset` positions into the last forward, where kept."""
        self.armed = False  # that forward is over
        if offset == 0:
            return self.before
        if all(len(self.after[i]) >= offset for i in self.layers):
            return [self.after[i][offset - 1] for i in self.layers]
        return None

    def load(self, cache: DynamicCache, states: list[LayerState]) -> None:
        for i, state in zip(self.layers, states, strict=True):
            state.load(cache.layers[i])

    def replay(self, cache: DynamicCache, count: int) -> None:
        """Run the last forward's first `count` tokens again, on a cache put back to its start."""
        if self.ids is None:
            raise RuntimeError("replay needs the input ids of the last forward; it was not run with input_ids=")
        self.armed = False
        with torch.inference_mode():
            self.decoder(input_ids=self.ids[:, :count], cache=cache, use_cache=True)

    # --- capture: the recurrent mixers run a verify one token at a time ---------

    def _find_mixers(self) -> dict[int, nn.Module]:
        """The module writing each recurrent cache layer: the innermost module whose forward is
        running when the layer's state is written, seen by running two tokens once."""
        found: dict[int, nn.Module] = {}
        probe = self.new_cache()

        def spy(index: int, write: Callable) -> Callable:
            def wrapped(*args, **kwargs):
                frame = sys._getframe(1)
                while frame is not None:
                    owner = frame.f_locals.get("self")
                    if frame.f_code.co_name == "forward" and isinstance(owner, nn.Module):
                        found.setdefault(index, owner)
                        break
                    frame = frame.f_back
                return write(*args, **kwargs)

            return wrapped

        for i in self.layers:
            layer = probe.layers[i]
            layer.update_recurrent_state = spy(i, layer.update_recurrent_state)
            layer.update_conv_state = spy(i, layer.update_conv_state)
        self._run([[1, 2]], probe)
        missing = sorted(set(self.layers) - set(found))
        if missing:
            raise UnsupportedModel(f"no module was seen writing the recurrent state of layers {missing}")
        return found

    def _check_capture(self) -> None:
        """Refuse capture where running the mixers token by token does not reproduce the model."""
        ids = [[3, 1, 4, 1, 5, 9]]
        whole = self._run(ids, self.new_cache())
        probe = self.new_cache()
        self.prepare(probe, len(ids[0]))
        stepped = self._run(ids, probe)
        captured = self.state_at(len(ids[0])) is not None
        self.cache = None
        if not captured or not agrees(stepped, whole, next(self.decoder.parameters()).dtype):
            raise UnsupportedModel(
                "this model's recurrent mixers do not reproduce it when run token by token; use --cache-policy replay"
            )

    def _run(self, ids: list[list[int]], cache: DynamicCache) -> torch.Tensor:
        device = next(self.decoder.parameters()).device
        with torch.inference_mode():
            return self.decoder(
                input_ids=torch.tensor(ids, device=device), cache=cache, use_cache=True
            ).last_hidden_state


def _step_tokens(mixer: nn.Module, owner: RecurrentRollback, index: int) -> None:
    """Make `mixer` (writing cache layer `index`) run an armed forward token by token and keep
    the layer's state after each. Installed once per mixer; a later owner replaces an earlier."""
    inner = getattr(mixer, "_dflash_inner_forward", None) or mixer.forward
    mixer._dflash_inner_forward = inner

    def forward(*args, **kwargs):
        cache = kwargs.get("cache")
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        count = hidden.shape[1]
        if not owner.armed or cache is not owner.cache or count == 1:
            return inner(*args, **kwargs)
        outs = []
        for j in range(count):
            outs.append(inner(*(_row(a, j, count) for a in args), **{k: _row(v, j, count) for k, v in kwargs.items()}))
            owner.after[index].append(LayerState.save(cache.layers[index]))
        return torch.cat(outs, 1)

    mixer.forward = forward


def _row(value, j: int, count: int):
    """Position j of a per-position tensor argument [batch, positions, ...]; anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == count:
        return value[:, j : j + 1]
    return value
