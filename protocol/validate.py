"""Schema checks shared by encode and decode.

Running the very same checks on both sides means a sender's bug raises
where it was made instead of as an error reply from the peer.
"""

from __future__ import annotations

from typing import Any

from .errors import ErrorCode, ProtocolError, describe
from .messages import SCHEMAS, Schema
from .tensors import TensorSpec


def schema_for(type: Any) -> Schema:
    if not isinstance(type, str) or type not in SCHEMAS:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {describe(type)}; known: {sorted(SCHEMAS)}",
        )
    return SCHEMAS[type]


def validate(
    type: str,
    fields: dict[str, Any],
    specs: list[TensorSpec],
    lengths: list[int],
    max_frame_bytes: int,
) -> dict[str, Any]:
    """Fields, then tensor frames, then cross-checks; returns normalised fields.

    `type` must already have passed `schema_for`.
    """
    schema = SCHEMAS[type]
    normalised = schema.fields.check(type, fields)
    for spec, length in zip(specs, lengths, strict=True):
        for size, what in ((length, "frame"), (spec.nbytes, "declared nbytes")):
            if size > max_frame_bytes:
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"{type}: tensor {spec.name!r} {what} is {size} bytes, limit {max_frame_bytes}",
                )
        if length != spec.nbytes:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{type}: tensor {spec.name!r} frame is {length} bytes, spec says nbytes={spec.nbytes}",
            )
    by_name = _check_tensors(type, schema, specs)
    if schema.check is not None:
        schema.check(normalised, by_name)
    return normalised


def _check_tensors(type: str, schema: Schema, specs: list[TensorSpec]) -> dict[str, TensorSpec]:
    by_name: dict[str, TensorSpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{type}: tensor {spec.name!r} appears twice")
        by_name[spec.name] = spec
    wanted = {rule.name for rule in schema.tensors if not rule.optional}
    allowed = {rule.name for rule in schema.tensors}
    if not wanted <= set(by_name) <= allowed:
        optional = f" (and optionally {sorted(allowed - wanted)})" if allowed != wanted else ""
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{type}: expected tensors {sorted(wanted)}{optional}, got {sorted(by_name)}",
        )
    for rule in schema.tensors:
        spec = by_name.get(rule.name)
        if spec is None:
            continue
        where = f"{type}: tensor {rule.name!r}"
        if spec.dtype not in rule.dtypes:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{where}: dtype must be one of {list(rule.dtypes)}, got {spec.dtype!r}",
            )
        if len(spec.shape) != len(rule.min_shape) or any(
            dim < lo for dim, lo in zip(spec.shape, rule.min_shape, strict=True)
        ):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{where}: expected rank {len(rule.min_shape)} with dims >= "
                f"{list(rule.min_shape)}, got shape {list(spec.shape)}",
            )
    return by_name
