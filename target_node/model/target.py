"""The target adapter: any transformers causal LM behind the few calls the loop needs.

It runs tokens at the next positions, rolls its KV cache back to what was committed, and
turns final hidden states into the target's choices (greedy) or distributions (sampling).
Two paths run the tokens: the engine (engine/: static cache, prepacked weights, batch-invariant
kernels, so a verify row has the bits of the plain step) wherever it serves the model, and the
model's own transformers forward (transformers_path.py) everywhere else. What drafting needs on
top (taps, the feature ring, projecting draft states through the head) lives in `drafting.py`,
owned by the proposer that drafts.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from basics.errors import first_line
from dflash_kernels import argmax, bf16_faster, bf16_numerics, computes_bf16, native_bf16, runs_on
from dflash_kernels import load as load_kernels
from dflash_kernels.build import cpu_flags, cpu_name
from protocol import FLOAT_DTYPES
from target_node.engine.engine import PREFER_DEVICE, Engine, engine_for
from target_node.model.cache_policy import CachePolicy
from target_node.model.default_model import model_folder
from target_node.model.greedy_head import ScreenedArgmaxHead
from target_node.model.recurrent import align_time_step_limits
from target_node.model.support import ModelLoadError, check_config, check_structure, probe
from target_node.model.transformers_path import TransformersPath

# Where configs state the positions a model was built for, by family.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length")

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A request that needs more positions than the model has."""


@cache
def device_label(device: torch.device) -> str:
    """A device as its numerics go: a GPU's name, or a CPU's with how it computes bf16."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    flags = cpu_flags().split()
    bf16 = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "no native bf16"
    return f"{cpu_name()} ({bf16})"


def inexact(target: TargetModel) -> str:
    """Why a target that is not `exact` is refused for serving."""
    return (
        f"{target.name} in {str(target.model.dtype).removeprefix('torch.')}: the batch-invariant engine does not "
        "serve it here, and off the engine only float32 is exact: use --dtype float32 or auto"
    )


class TargetModel:
    def __init__(
        self,
        model,
        tokenizer=None,
        cache_policy: str | None = None,
        engine: bool | str | None = None,
        slots: int = 1,
    ) -> None:
        """`model`: a transformers causal LM; `cache_policy`: how recurrent layers roll back
        (`replay`, the default, or `capture`: see recurrent.py); `engine`: None runs the engine
        where it serves the model, False never, True or its ops by name (`Engine`'s `ops`) always
        or refuse (True: the ops of the model's device, a GPU's too, where None declines one),
        PREFER_DEVICE the device's ops where they serve the model, else none;
        `slots`: sequences the engine's cache holds at once (the transformers path: one)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        # What cannot be served is refused here, not mid-request; the rollback policy is chosen
        # from the layers of the model's own cache.
        decoder = check_structure(model)
        align_time_step_limits(model)
        fallback = TransformersPath(model, cache_policy)
        self.eos_ids = self._eos_ids()
        self.head = model.get_output_embeddings()
        fallback.tap_offset = probe(model, decoder, fallback.new_cache(), self._scaled_head)
        self.engine: Engine | None = None
        if engine is not False:
            # The cache grows by doubling, never past the positions the model holds.
            if engine is None or engine == PREFER_DEVICE:
                self.engine = engine_for(model, slots, self.max_positions, "device" if engine else "auto")
            else:
                self.engine = Engine(model, slots, self.max_positions, engine if isinstance(engine, str) else "device")
        self.path: Engine | TransformersPath = self.engine or fallback
        self.greedy_head = self._screened_head_if_faster() if self.engine is None else None

    @property
    def name(self) -> str:
        """The model's folder name: what the answer store, the stats reply and the datastore call it.
        Whatever way the folder was written: `--model .` was served as "dflash-split", and its
        answers recorded under "" (an audit)."""
        given = str(self.config.name_or_path)
        return Path(os.path.abspath(given)).name if given else ""

    @property
    def policy(self) -> Engine | CachePolicy:
        """How the cache gives back what a verify ran: the engine's static cache, or the transformers
        path's policy for its cache layers (`name`, and `tree`: whether any rows can be kept)."""
        return self.path if self.engine is not None else self.path.policy

    @property
    def cache(self) -> DynamicCache | None:
        """The transformers path's DynamicCache (None before a forward, and on the engine)."""
        return getattr(self.path, "cache", None) if self.engine is None else None

    @property
    def fast_bf16(self) -> bool:
        """Whether bf16 matmuls beat fp32 ones here (for heads that need not be exact: drafts)."""
        return self.greedy_head is not None or (self.engine is not None and native_bf16())

    def _screened_head_if_faster(self) -> ScreenedArgmaxHead | None:
        """On CPU in fp32 the head dominates a verify step, and a bf16 screen halves it where the
        CPU has native bf16 dot products; where it has not (AVX2), the screen is slower than the
        plain head. So it is measured here, on a verify-sized batch, and kept only if faster. On
        a GPU, or for a model already in reduced precision, the plain head is the right tool."""
        weight = self.head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        screened = ScreenedArgmaxHead(weight)
        rows = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0))

        def best_of(fn) -> float:
            times = []
            for _ in range(3):
                began = time.perf_counter()
                fn(rows)
                times.append(time.perf_counter() - began)
            return min(times)

        plain = best_of(lambda h: self.logits(h).argmax(-1))
        return screened if best_of(screened) < plain else None

    @classmethod
    def load(
        cls,
        folder: str | Path,
        device: str = "cpu",
        dtype: torch.dtype | str = "auto",
        cache_policy: str | None = None,
        engine: bool | None = None,
        slots: int = 1,
    ) -> TargetModel:
        """`slots`: sequences decoded at once (the engine's; the transformers path holds one).
        `dtype` "auto": bfloat16 where the device has native bf16 (CUDA; CPUs with AVX512-BF16 or
        AMX, where the engine's bf16 step measures faster) and the engine serves the model, so the
        output is exact; float32 elsewhere."""
        folder = model_folder(folder)
        auto = dtype == "auto"
        if auto:
            dtype = torch.bfloat16 if prefer_bf16(device) else torch.float32
        elif isinstance(dtype, str):
            if dtype not in FLOAT_DTYPES:  # getattr(torch, "nonsense") raised an AttributeError (an audit)
                raise ValueError(f"a target's dtype is auto or one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
            dtype = getattr(torch, dtype)
        model = load_causal_lm(folder, dtype).to(device)
        # A folder without tokenizer files still serves token-id requests.
        has_tokenizer = any(
            (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        tokenizer = AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
        target = cls(model, tokenizer, cache_policy, engine, slots)
        if auto and target.engine is None and dtype != torch.float32:
            # Off the engine, a verify row is not the plain step's bits: bf16 would not be exact. The
            # folder's own weights, read again: model.float() kept bf16's rounding of an fp32
            # checkpoint, and its output differed from the model's (an audit).
            log.info("the engine does not serve %s: float32, where the transformers path is exact in practice", folder)
            del target, model
            target = cls(load_causal_lm(folder, torch.float32).to(device), tokenizer, cache_policy, engine, slots)
        log.info(
            "target %s: %s, %s",
            folder.name,
            target.model.dtype,
            f"engine ({target.policy.name})" if target.engine else f"transformers path ({target.policy.name})",
        )
        return target

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def numerics(self) -> str:
        """What its greedy answers' bits depend on beyond the weights: dtype, path and device. bf16
        answers made on one CPU differed from another's at near-ties (7 of 24 sampled, an audit):
        the answer store keeps this beside each answer (`made_by`)."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        path = "engine" if self.engine is not None else "transformers path"
        if self.engine is not None and self.model.dtype == torch.bfloat16 and runs_on(self.device):
            path += f" ({bf16_numerics(load_kernels())} matmuls)"  # AMX, AVX-512 BF16 and FMAs differ
        return f"{dtype} {path} on {device_label(self.device)}"

    @property
    def exact(self) -> bool:
        """Whether speculation gives the plain output bit for bit here: on the engine, or in float32
        off it (in practice: its verify rows are not the plain step's bits, but fp32 ties are rare)."""
        return self.engine is not None or self.model.dtype == torch.float32

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def info(self) -> dict:
        """What a drafter needs to know of this target (the wire's TARGET_INFO)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.config.num_hidden_layers,
            "vocab_size": self.vocab_size,
        }

    @property
    def max_positions(self) -> int | None:
        """Positions the model was built for (None when its config does not say, as state-space
        models' do not: they have no position limit)."""
        text = self.config.get_text_config(decoder=True)
        for name in POSITION_FIELDS:
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, before any work, a request that would run past the model's positions."""
        limit = self.max_positions
        if limit is not None and prompt_tokens + max_new_tokens > limit:
            raise ContextLengthError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) is "
                f"{prompt_tokens + max_new_tokens} positions; this model holds {limit}"
            )

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    # --- running and rolling back -------------------------------------------

    @property
    def slots(self) -> int:
        """Sequences this target decodes at once: the engine's slots, or one."""
        return self.path.slots

    @property
    def length(self) -> int:
        """Positions slot 0's KV cache holds."""
        return self.length_of(0)

    def length_of(self, slot: int) -> int:
        return self.path.length(slot)

    def reset(self, slot: int = 0, expect: int = 0) -> None:
        """A new sequence in `slot`: an empty KV cache, with room for `expect` positions where the
        cache is preallocated (the engine's), so a long prompt's chunks do not grow it one by one."""
        if self.engine is not None:
            self.engine.reset(slot, expect)
        else:
            self.path.reset(slot)

    def cached_rows(self, slot: int, positions: int) -> torch.Tensor:
        """A copy of the slot's first KV rows, for a later request to start from (the engine's only:
        its rows are the same bits whichever forward computed them)."""
        if self.engine is None:
            raise NotImplementedError("only the engine's cache hands its rows to later requests")
        return self.engine.cache.read(slot, positions)

    def load_rows(self, slot: int, rows: torch.Tensor) -> None:
        """Start the slot from rows `cached_rows` gave: they are its first positions."""
        if self.engine is None:
            raise NotImplementedError("only the engine's cache takes rows from earlier requests")
        self.engine.cache.load(slot, rows)

    def forward(
        self, tokens: list[int], taps: tuple[int, ...] = (), parents: list[int] | None = None, slot: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens at the slot's next positions: final hidden states [k, hidden], and the tapped
        layers' outputs [k, len(taps) * hidden] when `taps` names any.

        With `parents` (of tokens 1.., indices into `tokens`), the tokens form a tree: each sits at
        the first one's position plus its depth and sees the committed context and its own
        ancestors only. The LM head is left to the caller (`greedy` or `logits`), which needs far
        less of it than the full logits of every row. The cache keeps all k rows until `rollback`
        or `keep`.
        """
        return self.forward_batch([(slot, tokens, parents)], taps)[0]

    def forward_batch(
        self, parts: list[tuple[int, list[int], list[int] | None]], taps: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several sequences' tokens, (slot, tokens, parents) each, in one forward on the engine (one
        after another on the transformers path): per part, what `forward` would return for it."""
        return self.path.step_batch(parts, taps)

    def prefill_features(self, token_lists: list[list[int]], taps: tuple[int, ...]) -> list[torch.Tensor]:
        """Tap features of whole sequences, for training data: on the engine, one slot each in one
        batched forward (the bits serving computes); on the transformers path, one right-padded
        forward (its rounding may differ from a forward alone). Leaves the slots empty."""
        if self.engine is None:
            return self.path.features_batch(token_lists, taps)
        for slot, tokens in enumerate(token_lists):
            self.reset(slot, len(tokens))
        results = self.forward_batch([(slot, tokens, None) for slot, tokens in enumerate(token_lists)], taps)
        for slot in range(len(token_lists)):
            self.reset(slot)
        return [features for _, features in results]

    @property
    def prefill_slots(self) -> int:
        """Sequences `prefill_features` takes at once: the engine's slots; any number off it."""
        return self.slots if self.engine is not None else 1 << 20

    def rollback(self, length: int, slot: int = 0) -> None:
        """Keep the first `length` positions of the slot's KV cache, dropping what was run after them."""
        self.path.rollback(length, slot)

    def keep(self, start: int, rows: list[int], slot: int = 0) -> None:
        """After a forward from `start`, keep only its rows `rows` (ascending offsets, 0 first),
        moved to positions start, start + 1, ...: a tree step's accepted path."""
        self.path.keep(start, rows, slot)

    # --- the head --------------------------------------------------------------

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """The target's greedy choice after each row: the argmax of its fp32 logits."""
        if self.greedy_head is not None:
            return self.greedy_head(hidden)
        if self.engine is not None and not self._logits_transformed:
            chosen = self.engine.greedy(hidden)
            if chosen is not None:
                return chosen
        return argmax(self.logits(hidden)).tolist()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits [k, vocab], for sampling (on the engine, each row by the same dot products
        whatever rows come with it)."""
        if self.engine is not None:
            return self.scale_logits(self.engine.head(hidden))
        return self._scaled_head(hidden)

    def _scaled_head(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        return self.scale_logits(self.head(hidden.to(device=weight.device, dtype=weight.dtype)).float())

    # The config fields `scale_logits` applies, whichever a family sets.
    LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "final_logit_softcapping")

    @property
    def _logits_transformed(self) -> bool:
        """Whether `scale_logits` changes the head's logits: rounding after a scale or a cap may tie
        logits that differ, and the first of them is the argmax, which only the whole head finds."""
        return any(getattr(self.config, name, None) for name in self.LOGIT_TRANSFORMS)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What some families apply after the LM head (`LOGIT_TRANSFORMS`); none of it moves the argmax."""
        scale = getattr(self.config, "logit_scale", None)  # Cohere-style
        if scale:
            logits = logits * scale
        divide = getattr(self.config, "logits_scaling", None)  # Granite-style
        if divide:
            logits = logits / divide
        multiplier = getattr(self.config, "lm_head_multiplier", None)  # Falcon-H1
        if multiplier:
            logits = logits * multiplier
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma-style
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(ids)

    # --- text ------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer; send token ids")
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        return self.encode_text("\n".join(m["content"] for m in messages))

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer; send token ids")
        return list(self.tokenizer(text)["input_ids"])


def prefer_bf16(device: str | torch.device) -> bool:
    """bf16 where the device computes it natively: CUDA, or a CPU with AVX512-BF16 or AMX where the
    engine's bf16 matmul also measures faster than its fp32 one here and now."""
    return computes_bf16(device) and (torch.device(device).type != "cpu" or bf16_faster())


def load_causal_lm(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The folder's causal LM, or ModelLoadError (UnsupportedModel) saying in one line why not: a
    broken config, unreadable weights, or weights that lack tensors, which transformers fills
    with random values and only warns of (such a model served nonsense, an audit)."""
    unreadable = (OSError, ValueError, KeyError, TypeError, SafetensorError)
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # whatever transformers and its validators raise for a config they refuse
        if isinstance(exc, MemoryError):
            raise
        raise ModelLoadError(f"{folder}: its config.json does not load: {first_line(exc)}") from exc
    check_config(config, folder.name)
    # Into a log file or a pipe, transformers' bar of weights loaded was one long line of carriage
    # returns in every start's log (an audit); a terminal still shows it.
    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except unreadable as exc:
        raise ModelLoadError(f"{folder} does not load as a causal LM: {first_line(exc)}") from exc
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelLoadError(f"{folder}: its weights lack {len(missing)} tensors the model needs ({shown})")
    return model
