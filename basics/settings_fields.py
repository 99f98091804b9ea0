"""A daemon's settings fields: one object per daemon, one field per flag, each with its default
and its help, from which the command line (`launch.common.add_settings`) and the docs' limits
tables come. `setting` is the one way such a field is declared, the target daemon's and the draft
daemon's alike.
"""

from __future__ import annotations

import math
from dataclasses import field, fields
from typing import Any


def setting(default: Any, help: str, unit: str = "", limit: bool = True) -> Any:
    """A field with its help; `unit` says how the docs write its default ("ms", "s", "bytes"), and
    `limit` whether the docs' limits table lists it."""
    return field(default=default, metadata={"help": help, "unit": unit, "limit": limit})


def refuse_unfinite(settings: object) -> None:
    """A settings object's numbers are finite: NaN passed every `x < 0` check (a NaN --idle-timeout
    never evicted) and inf failed deep inside the first use (a NaN or inf --keep-mb, after the
    model loaded: an audit)."""
    for f in fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
