"""Frames <-> Message, with every check done on both the send and receive side.

A message is `[header, tensor_frame_0, ...]`: a bounded msgpack map followed
by one raw frame per tensor, in the order the header lists them. Decoding
treats every byte as hostile and only ever raises ProtocolError.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from .errors import ErrorCode, ProtocolError, describe
from .fields import is_int
from .messages import (
    MAX_ERROR_MESSAGE_LEN,
    PROTOCOL_VERSION,
    REQUEST_ID,
    RESERVED_KEYS,
)
from .tensors import (
    TensorSpec,
    as_bytes,
    frame_to_tensor,
    tensor_to_frame,
    wire_dtype_of,
)
from .validate import schema_for, validate

if TYPE_CHECKING:
    import torch

# Large enough for a long prompt or a list of prompt token ids from a client.
MAX_HEADER_BYTES = 1024 * 1024
MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 8
# Bounds handed to msgpack so a tiny header cannot claim huge containers.
MAX_HEADER_STR = MAX_HEADER_BYTES
MAX_HEADER_ARRAY = 1 << 17
MAX_HEADER_MAP = 1024


@dataclass
class Message:
    """A decoded (or about-to-be-encoded) message.

    `tensors` maps name -> (spec, raw bytes); the bytes may alias the zmq
    frame, so call `tensor()` to get an owned torch tensor.
    """

    type: str
    id: int
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, tuple[TensorSpec, memoryview]] = field(default_factory=dict)
    # Who sent it, as the transport knows the sender (never on the wire): a CURVE client's
    # public key, or the connection's routing id. Sessions and queues belong to a peer.
    peer: str = ""
    # When it was read (time.monotonic(); never on the wire): the transport stamps its read, else it
    # is the decode's. A request that arrived during a daemon's step waits in the server's hold, and
    # its queue time, and a pre-draft's budget, count from here.
    received: float = field(default_factory=time.monotonic)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def tensor(
        self,
        name: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if name not in self.tensors:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{self.type}: no tensor {name!r}; has {sorted(self.tensors)}",
                request_id=self.id,
            )
        spec, data = self.tensors[name]
        return frame_to_tensor(data, spec.dtype, spec.shape, device, dtype)

    def raise_if_error(self) -> None:
        """Turn an `error` reply into the ProtocolError the peer raised."""
        if self.type == "error":
            raise ProtocolError(
                ErrorCode(self.fields["code"]),
                self.fields["message"],
                request_id=self.id,
                remote=True,
            )

    def expect(self, *types: str) -> Message:
        """Raise on an error reply or on any type not in `types`."""
        self.raise_if_error()
        if self.type not in types:
            raise ProtocolError(
                ErrorCode.UNKNOWN_TYPE,
                f"expected a reply of type {list(types)}, got {self.type!r}",
                request_id=self.id,
            )
        return self


def encode(
    type: str,
    id: int,
    fields: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Any] | None = None,
    wire_dtype: str = "float32",
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> list[bytes | memoryview]:
    """Build frames for `socket.send_multipart(frames, copy=False)`.

    `tensors` values are a tensor or `(tensor, wire_dtype)`. Floating tensors
    default to `wire_dtype`; integer tensors keep their own dtype. The header
    passes the same validation as `decode`, so bad input raises here.
    """
    try:
        return _encode(type, id, dict(fields or {}), tensors or {}, wire_dtype, max_frame_bytes)
    except ProtocolError as exc:
        if exc.request_id is None:
            exc.request_id = _readable_id(id)
        raise


def _encode(
    type: str,
    id: int,
    fields: dict[str, Any],
    tensors: Mapping[str, Any],
    wire_dtype: str,
    max_frame_bytes: int,
) -> list[bytes | memoryview]:
    schema_for(type)
    REQUEST_ID.check(f"{type}.id", id)
    frames: list[bytes | memoryview] = []
    specs: list[TensorSpec] = []
    for name, value in tensors.items():
        tensor, dtype = value if isinstance(value, tuple) else (value, None)
        dtype, shape, data = tensor_to_frame(tensor, dtype or _default_dtype(tensor, wire_dtype))
        spec = TensorSpec(name, dtype, shape, data.nbytes)
        spec.validate()
        specs.append(spec)
        frames.append(data)
    normalised = validate(type, fields, specs, [f.nbytes for f in frames], max_frame_bytes)
    header = {
        "v": PROTOCOL_VERSION,
        "type": type,
        "id": id,
        **normalised,
        "tensors": [s.to_wire() for s in specs],
    }
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{type}: header cannot be packed: {exc}") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{type}: header is {len(packed)} bytes, limit {MAX_HEADER_BYTES}",
        )
    return [packed, *frames]


def _default_dtype(tensor: Any, wire_dtype: str) -> str:
    """Floats travel in the negotiated dtype; ints keep their own."""
    if not hasattr(tensor, "is_floating_point"):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"expected a torch.Tensor, got {describe(tensor)}")
    if tensor.is_floating_point():
        return wire_dtype
    own = wire_dtype_of(tensor)
    if own is None:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{tensor.dtype} has no wire dtype; pass (tensor, 'int32'|'int64')",
        )
    return own


def encode_error(id: int | None, code: ErrorCode | str, message: str) -> list[bytes | memoryview]:
    """An `error` reply; `id` None (request unreadable) is sent as 0.

    Long messages are truncated rather than failing in an error path.
    """
    code = ErrorCode(code)
    if len(message) > MAX_ERROR_MESSAGE_LEN:
        message = message[: MAX_ERROR_MESSAGE_LEN - 3] + "..."
    rid = _readable_id(id)
    return encode("error", rid or 0, {"code": code.value, "message": message})


def decode(frames: Sequence[Any], *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse and fully validate one message; raises only ProtocolError."""
    try:
        return _decode(frames, max_frame_bytes)
    except ProtocolError:
        raise
    except Exception as exc:  # a bug here must still reach the peer as a code
        raise ProtocolError(ErrorCode.INTERNAL, f"decoder failed: {type(exc).__name__}: {exc}") from exc


def _decode(frames: Sequence[Any], max_frame_bytes: int) -> Message:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"expected a non-empty list of frames, got {describe(frames)}",
        )
    views = [as_bytes(f) for f in frames]
    head = views[0]
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"header frame is {head.nbytes} bytes, limit {MAX_HEADER_BYTES}",
        )
    header = _unpack(head)
    request_id = _readable_id(header.get("id"))
    try:
        return _check(header, views[1:], max_frame_bytes)
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    except Exception as exc:  # a bug here must still reach the peer, at the id it can match
        raise ProtocolError(
            ErrorCode.INTERNAL, f"decoder failed: {type(exc).__name__}: {exc}", request_id=request_id
        ) from exc


def _check(header: dict[str, Any], payload: list[memoryview], max_frame_bytes: int) -> Message:
    version = header.get("v")
    if not (is_int(version) and version == PROTOCOL_VERSION):
        sent = version if is_int(version) else describe(version)
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version mismatch: peer sent v={sent}, this side speaks v={PROTOCOL_VERSION}",
        )
    type = header.get("type")
    schema_for(type)
    if "id" not in header:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{type}: missing required field 'id'")
    REQUEST_ID.check(f"{type}.id", header["id"])
    if len(payload) > MAX_TENSORS:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{type}: {len(payload)} tensor frames, limit {MAX_TENSORS}",
        )
    raw_specs = header.get("tensors")
    if not isinstance(raw_specs, list):
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{type}: header key 'tensors' must be a list, got {describe(raw_specs)}",
        )
    if len(raw_specs) > MAX_TENSORS:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{type}: {len(raw_specs)} tensors, limit {MAX_TENSORS}",
        )
    if len(raw_specs) != len(payload):
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{type}: header lists {len(raw_specs)} tensor(s) but {len(payload)} tensor frame(s) follow",
        )
    try:
        specs = [TensorSpec.from_wire(s) for s in raw_specs]
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{type}: {exc.message}") from None
    fields = {k: v for k, v in header.items() if k not in RESERVED_KEYS}
    normalised = validate(type, fields, specs, [p.nbytes for p in payload], max_frame_bytes)
    return Message(
        type=type,
        id=header["id"],
        fields=normalised,
        tensors={s.name: (s, p) for s, p in zip(specs, payload, strict=True)},
    )


def _readable_id(value: object) -> int | None:
    """The request id if it is a valid one, so error replies can echo it."""
    if is_int(value) and REQUEST_ID.lo <= value <= REQUEST_ID.hi:
        return value
    return None


def _str_keyed(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """A map as the README has it: str keys, each once (msgpack itself keeps the last of a
    repeated key and lets bin keys through)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise ValueError(f"map keys must be str, got {describe(key)}")
        if key in out:
            raise ValueError(f"map key {describe(key)} appears twice")
        out[key] = value
    return out


def _no_ext(code: int, data: bytes) -> None:
    raise ValueError(f"ext types are forbidden, got ext {code}")


def _unpack(head: memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_STR,
            max_bin_len=MAX_HEADER_STR,
            max_array_len=MAX_HEADER_ARRAY,
            max_map_len=MAX_HEADER_MAP,
            max_ext_len=0,
            object_pairs_hook=_str_keyed,
            ext_hook=_no_ext,
        )
    except Exception as exc:  # msgpack raises a zoo of types on bad input
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"header is not valid msgpack: {type(exc).__name__}: {exc}",
        ) from exc
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"header must be a msgpack map, got {describe(header)}")
    return header
