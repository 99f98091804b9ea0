"""A request's sampling options, validated once, for every side: the target daemon reads them from
a request, the HTTP front end checks its OpenAI fields against the same bounds, clients send them.
No torch here: how the options shape a distribution is target_node/decoding/sampling.py's job."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from protocol.fields import is_int

SEED_LIMIT = 2**63  # torch generators take 64-bit seeds; stay inside what every client's ints can carry
MAX_TEMPERATURE = 2.0  # OpenAI's bound; above it a distribution is noise, and the same bound holds everywhere
# Below this a temperature is greedy decoding: logits divided by 1e-300 overflow to inf and the
# distribution becomes NaN, while at 1e-4 sampling already picks the argmax but for exact ties.
GREEDY_BELOW = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options; temperature 0 (or anything below GREEDY_BELOW) means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature, top_p = _number("temperature", self.temperature), _number("top_p", self.top_p)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        # Clients may send 1 for 1.0; store floats so equal requests compare and serialize equal.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> SamplingParams:
        """Read a request's `sampling` map; missing keys take defaults, unknown keys are refused, not ignored."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"sampling must be a map of options, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(f"unknown sampling options {unknown}; expected some of {sorted(known)}")
        return cls(**data)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
