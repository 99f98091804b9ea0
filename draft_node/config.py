"""The drafter's configuration, read from and written to the public checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from protocol.messages import MAX_BLOCK_SIZE

FULL = "full_attention"
SLIDING = "sliding_attention"
# The two public checkpoint formats, by their config's `architectures`. DFlash2 adds a grouped
# dynamic convolution around every sublayer and a candidate selector (see model.py).
DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# RoPE variants the drafter computes (through transformers' own frequency functions): fixed
# frequencies, so context keys cached at one step stay right at every later step.
ROPE_SCALINGS = {  # type -> the fields it needs
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Frequencies that change with the sequence length: cached context keys would go stale.
ROPE_BY_LENGTH = ("dynamic", "longrope")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be loaded as it is; the message names what is wrong."""


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    layer_types: tuple[str, ...] = field(default=())
    sliding_window: int | None = None
    # A scaled RoPE's parameters (`rope_type` one of ROPE_SCALINGS, `factor`, ...); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int | None = None
    architecture: str = DFLASH
    # Whether block rows see only earlier block rows: the config's `is_causal` (or
    # `dflash_config.causal`); None keeps DFlash's rule, causal in sliding layers only.
    is_causal: bool | None = None
    # DFlash2 only (0 elsewhere): the convolution's taps and channels per dynamic group, the
    # selector's codebook rank and candidates per position, and the vocabulary its codebooks span.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    vocab_size: int = 0
    input_embedding_scale: float = 1.0  # multiplies the block's embeddings
    # Applied to the selector's top-k logits (the target's own head scaling, then a tanh cap; 0: none).
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_hidden_layers)
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            problems.append(f"unknown layer types {bad}")
        if SLIDING in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need a positive sliding_window")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window must be positive, got {self.sliding_window}")
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
        problems += [
            f"{name} must be at least 1, got {getattr(self, name)}" for name in sizes if getattr(self, name) < 1
        ]
        if min(self.num_attention_heads, self.num_key_value_heads) >= 1:
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 2 or self.head_dim % 2:  # RoPE turns channels in pairs
            problems.append(f"head_dim must be even and at least 2, got {self.head_dim}")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:  # what the wire carries: a bigger one hung the start
            problems.append(f"block_size must be in 2..{MAX_BLOCK_SIZE}, got {self.block_size}")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} name a layer twice")
        out_of_range = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if out_of_range:
            problems.append(f"target_layer_ids {out_of_range} outside the target's {self.num_target_layers} layers")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_SCALINGS:
            problems.append(f"rope_scaling {self.rope_scaling} is none of {', '.join(ROPE_SCALINGS)}")
        if self.architecture not in (DFLASH, DFLASH2):
            problems.append(f"architecture {self.architecture!r} is neither {DFLASH} nor {DFLASH2}")
        if self.architecture == DFLASH2:
            problems += self._dflash2_problems()
        if problems:
            raise CheckpointError("bad drafter config: " + "; ".join(problems))

    def _dflash2_problems(self) -> list[str]:
        problems = [f"{DFLASH2} needs a positive {k}" for k in (*DFLASH2_KEYS, "vocab_size") if getattr(self, k) < 1]
        if self.conv_group_size > 0 and self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size > 0:
            problems.append(f"selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})")
        if self.output_multiplier <= 0:
            problems.append(f"output_multiplier must be positive, got {self.output_multiplier}")
        return problems

    @property
    def dflash2(self) -> bool:
        return self.architecture == DFLASH2

    def causal(self, layer_type: str) -> bool:
        """Whether a layer's block rows see only the block rows at or before their own."""
        return self.is_causal if self.is_causal is not None else layer_type == SLIDING

    @property
    def feature_width(self) -> int:
        """Width of one context-feature row: the tapped layers' outputs side by side."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_json(self) -> dict[str, Any]:
        """The public layout: Qwen3-style fields plus a `dflash_config` section."""
        body = asdict(self)
        dflash = {k: body.pop(k) for k in ("target_layer_ids", "block_size", "mask_token_id")}
        dflash["target_layer_ids"] = list(dflash["target_layer_ids"])
        extra = {k: body.pop(k) for k in (*DFLASH2_KEYS, "input_embedding_scale", "output_multiplier")}
        softcap, vocab = body.pop("final_logit_softcapping"), body.pop("vocab_size")
        if self.dflash2:  # where the published DFlash2 configs keep them
            dflash.update(extra)
            if softcap:
                dflash["final_logit_softcapping"] = softcap
            body["vocab_size"] = vocab
        body["layer_types"] = list(body["layer_types"])
        for optional in ("rope_scaling", "max_position_embeddings", "is_causal"):
            if body[optional] is None:
                del body[optional]
        body.update(
            architectures=[body.pop("architecture")],
            model_type="qwen3",
            attention_bias=False,
            hidden_act="silu",
            dflash_config=dflash,
        )
        return body

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Each field as the type it is, or CheckpointError naming it: int() and bool() read
        "18142" as five taps and "false" as true, and a string factor went into arithmetic (an
        audit)."""
        fields = _Fields(raw)
        if raw.get("attention_bias"):
            raise CheckpointError("attention_bias=true drafters are not supported")
        architecture = (raw.get("architectures") or [DFLASH])[0]
        if architecture not in (DFLASH, DFLASH2):
            raise CheckpointError(f"config.json describes a {architecture!r}, not a {DFLASH} or {DFLASH2} drafter")
        is_causal = raw.get("is_causal", fields.dflash.get("causal"))
        if is_causal is not None and not isinstance(is_causal, bool):
            raise CheckpointError(f"is_causal must be true or false, got {is_causal!r}")
        rope_theta, rope_scaling = read_rope(raw)
        hidden, heads = fields.whole("hidden_size"), fields.whole("num_attention_heads")
        taps, layer_types = fields.pick("target_layer_ids"), raw.get("layer_types") or []
        if not isinstance(taps, list):
            raise CheckpointError(f"target_layer_ids must be a list of layer ids, got {taps!r}")
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise CheckpointError(f"layer_types must be a list of names, got {layer_types!r}")
        window, positions = raw.get("sliding_window"), raw.get("max_position_embeddings")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=fields.whole("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=fields.whole("num_key_value_heads", heads),
            head_dim=fields.whole("head_dim", hidden // heads if heads > 0 else 0),
            intermediate_size=fields.whole("intermediate_size"),
            target_layer_ids=tuple(_integer("target_layer_ids", i) for i in taps),
            block_size=fields.whole("block_size"),
            mask_token_id=fields.whole("mask_token_id"),
            num_target_layers=fields.whole("num_target_layers"),
            rms_norm_eps=_real("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            layer_types=tuple(layer_types),
            sliding_window=None if window is None else _integer("sliding_window", window),
            rope_scaling=rope_scaling,
            max_position_embeddings=None if positions is None else _integer("max_position_embeddings", positions),
            architecture=architecture,
            is_causal=is_causal,
            **(_dflash2_fields(fields) if architecture == DFLASH2 else {}),
        )


class _Fields:
    """A config.json's fields, `dflash_config`'s first and the top level's as the fallback."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise CheckpointError(f"config.json must hold a JSON object, not a {type(raw).__name__}")
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointError(f"dflash_config must be a JSON object, not a {type(dflash).__name__}")
        self.raw, self.dflash = raw, dflash

    def pick(self, name: str, default: Any = None) -> Any:
        """The field, or `default` where one is given (else a field missing is refused)."""
        for place in (self.dflash, self.raw):
            if name in place:
                return place[name]
        if default is None:
            raise CheckpointError(f"config.json has no '{name}' (looked in dflash_config and at the top level)")
        return default

    def whole(self, name: str, default: int | None = None) -> int:
        return _integer(name, self.pick(name, default))


def _dflash2_fields(fields: _Fields) -> dict[str, Any]:
    missing = [k for k in DFLASH2_KEYS if k not in fields.dflash]
    if missing:
        raise CheckpointError(f"a {DFLASH2} config needs dflash_config.{', '.join(missing)}")
    return {k: _integer(k, fields.dflash[k]) for k in DFLASH2_KEYS} | {
        "vocab_size": fields.whole("vocab_size"),
        "input_embedding_scale": _real("input_embedding_scale", fields.dflash.get("input_embedding_scale", 1.0)),
        "output_multiplier": _real("output_multiplier", fields.pick("output_multiplier", 1.0) or 1.0),
        "final_logit_softcapping": _real("final_logit_softcapping", fields.pick("final_logit_softcapping", 0.0) or 0.0),
    }


def _integer(name: str, value: Any) -> int:
    """A JSON integer (true is not 1, 8.9 is not 8, "16" is not 16)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{name} must be an integer, got {value!r}")
    return value


def _real(name: str, value: Any) -> float:
    """A JSON number (true and "1e-6" are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{name} must be a number, got {value!r}")
    return float(value)


def in_dflash2(cfg: DFlashConfig, vocab_size: int, rank: int = 0, top_k: int = 0) -> DFlashConfig:
    """`cfg` in the DFlash2 format, with the published convolution and selector shapes (kernel 2,
    groups of 16 channels, rank 256, top 16; smaller where the drafter is smaller, `rank` and
    `top_k` where given). Its blocks see the rows they saw before, said explicitly where every
    layer agrees (the published configs say `is_causal`). A DFlash2 config is returned as it is."""
    if cfg.dflash2:
        return cfg
    causal = {cfg.causal(t) for t in cfg.layer_types}
    return replace(
        cfg,
        architecture=DFLASH2,
        is_causal=causal.pop() if len(causal) == 1 else cfg.is_causal,
        conv_kernel_size=2,
        conv_group_size=max(g for g in (1, 2, 4, 8, 16) if cfg.hidden_size % g == 0),
        selector_rank=rank or min(256, cfg.hidden_size),
        selector_top_k=top_k or min(16, vocab_size),
        vocab_size=vocab_size,
    )


def read_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`rope_theta` and the scaling of a config.json, from transformers 5's `rope_parameters` or the
    older `rope_theta` + `rope_scaling` (with `type` or `rope_type`); refuses what the drafter
    cannot compute."""
    scaling, parameters = raw.get("rope_scaling") or {}, raw.get("rope_parameters") or {}
    if not isinstance(scaling, dict) or not isinstance(parameters, dict):
        raise CheckpointError(f"rope_scaling and rope_parameters must be JSON objects, got {scaling!r}, {parameters!r}")
    params = {**scaling, **parameters}
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError("per-layer-type rope_parameters are not supported for drafters")
    theta = _real("rope_theta", params.pop("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return theta, None
    if kind in ROPE_BY_LENGTH:
        raise CheckpointError(
            f"rope type {kind!r} changes its frequencies with the sequence length, so cached context keys "
            f"would go stale; supported: {', '.join(ROPE_SCALINGS)}"
        )
    if kind not in ROPE_SCALINGS:
        raise CheckpointError(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0 or params.get("mrope_section"):
        raise CheckpointError("partial or multimodal rotary embeddings are not supported for drafters")
    missing = [name for name in ROPE_SCALINGS[kind] if params.get(name) is None]
    if missing:
        raise CheckpointError(f"rope type {kind!r} needs {', '.join(missing)}")
    for name in ROPE_SCALINGS[kind]:
        _real(f"rope {name}", params[name])
    return theta, {"rope_type": kind, **params}


def drafter_info(cfg: DFlashConfig, draft_vocab: list[int], ring_capacity: int, checksum: str = "") -> dict[str, Any]:
    """What a target needs to know of a drafter (the wire's DRAFTER_INFO), wherever the drafter runs;
    `checksum` names a DFlash2 drafter's codebooks."""
    return {
        "block_size": cfg.block_size,
        "hidden_size": cfg.hidden_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "feature_width": cfg.feature_width,
        "ring_capacity": ring_capacity,
        "num_target_layers": cfg.num_target_layers,
        "draft_vocab": list(draft_vocab),
        **(selector_info(cfg, checksum) if cfg.dflash2 else {}),
    }


def selector_info(cfg: DFlashConfig, checksum: str) -> dict[str, Any]:
    """What a target needs to run a DFlash2 drafter's candidate selector (DRAFTER_INFO.selector)."""
    return {
        "format": "dflash2",
        "selector": {
            "rank": cfg.selector_rank,
            "top_k": cfg.selector_top_k,
            "vocab_size": cfg.vocab_size,
            "output_multiplier": cfg.output_multiplier,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "checksum": checksum,
        },
    }


def load_config(folder: str | Path) -> DFlashConfig:
    """A checkpoint folder's config, read without torch: the draft daemon refuses a folder that is
    none before the drafter's code loads."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a drafter checkpoint: no config.json")
    return DFlashConfig.from_json(read_json(path))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not JSON: {exc}") from None
