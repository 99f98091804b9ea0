"""Tensor frames: how a tensor's bytes and its description travel.

The bytes go in their own zmq frame so neither side pays for msgpack copying
megabytes of activations; the header only carries a small `TensorSpec`.
torch is imported inside the functions so peers that only route or inspect
messages do not need it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ErrorCode, ProtocolError, describe
from .fields import is_int

if TYPE_CHECKING:
    import torch

# Wire dtype -> bytes per element. Multi-byte values are little-endian. Each name is also
# the name of the torch dtype it travels as (torch.float32, torch.bfloat16, ...).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
}
WIRE_DTYPES: tuple[str, ...] = tuple(ITEMSIZE)
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
MAX_RANK = 4
MAX_DIM = 2**31 - 1
MAX_NAME_LEN = 64
# The largest magnitude a float row on the wire may hold where its receiver computes with it (each
# peer checks what it takes in). Hidden states and features sit far below it; past it a row's squares
# overflow fp32 in a norm: finite rows of 3e38 turned a target's softmax NaN, and left NaN keys and
# values in a drafter session's context, which then drafted NaN until reset (audits).
MAX_MAGNITUDE = 1e15


def moderate(rows: torch.Tensor, bound: float = MAX_MAGNITUDE) -> bool:
    """Every value finite and within `bound` (NaN fails the comparison too)."""
    return rows.numel() == 0 or bool(rows.abs().amax() <= bound)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_TENSOR, message)


@dataclass(frozen=True)
class TensorSpec:
    """Header entry describing one tensor frame."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, raw: object) -> TensorSpec:
        """Validate an untrusted header entry; every defect is BAD_TENSOR."""
        if not isinstance(raw, dict):
            raise _bad(f"tensor spec: expected map, got {describe(raw)}")
        keys = {"name", "dtype", "shape", "nbytes"}
        if set(raw) != keys:
            missing = sorted(keys - set(raw))
            extra = sorted(map(str, set(raw) - keys))
            raise _bad(f"tensor spec: expected keys {sorted(keys)}, missing {missing}, unexpected {extra}")
        name, shape = raw["name"], raw["shape"]
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LEN:
            raise _bad(f"tensor spec name: expected str of 1..{MAX_NAME_LEN} chars, got {describe(name)}")
        if not isinstance(shape, list):
            raise _bad(f"tensor {name!r}: shape must be a list, got {describe(shape)}")
        spec = cls(name, raw["dtype"], tuple(shape), raw["nbytes"])
        spec.validate()
        return spec

    def validate(self) -> None:
        """Check dtype, shape and the nbytes == prod(shape) * itemsize rule."""
        where = f"tensor {self.name!r}"
        if not isinstance(self.dtype, str) or self.dtype not in ITEMSIZE:
            raise _bad(f"{where}: dtype must be one of {list(WIRE_DTYPES)}, got {describe(self.dtype)}")
        shape = self.shape
        if len(shape) > MAX_RANK:
            raise _bad(f"{where}: rank must be <= {MAX_RANK}, got shape {list(shape)}")
        for dim in shape:
            if not is_int(dim) or not 0 <= dim <= MAX_DIM:
                raise _bad(
                    f"{where}: shape entries must be ints in [0, {MAX_DIM}], got {describe(dim)} in shape {list(shape)}"
                )
        if not is_int(self.nbytes):
            raise _bad(f"{where}: nbytes must be int, got {describe(self.nbytes)}")
        expected = math.prod(shape) * ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            raise _bad(
                f"{where}: nbytes {self.nbytes} != prod(shape {list(shape)}) * "
                f"{ITEMSIZE[self.dtype]} ({self.dtype}) = {expected}"
            )


def torch_dtype(wire_dtype: str) -> torch.dtype:
    """The torch dtype a wire dtype name stands for (the names are the same)."""
    import torch

    if wire_dtype not in ITEMSIZE:
        raise _bad(f"dtype must be one of {list(WIRE_DTYPES)}, got {describe(wire_dtype)}")
    return getattr(torch, wire_dtype)


def wire_dtype_of(t: torch.Tensor) -> str | None:
    """The wire name of a tensor's own dtype, or None if it has none."""
    name = str(t.dtype).removeprefix("torch.")
    return name if name in ITEMSIZE else None


def tensor_to_frame(t: torch.Tensor, wire_dtype: str) -> tuple[str, tuple[int, ...], memoryview]:
    """Cast to the wire dtype on CPU, contiguous, and expose its bytes.

    The only copy is the cast/transfer itself: a CPU tensor already in the
    wire dtype and contiguous is shared, not copied. With
    `send_multipart(copy=False)` the caller must therefore not modify the
    tensor in place until zmq has sent it.
    """
    import torch

    target = torch_dtype(wire_dtype)
    t = t.detach().to(device="cpu", dtype=target).contiguous()
    if target == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; same 2-byte layout
    arr = t.numpy().reshape(-1)
    return wire_dtype, tuple(t.shape), arr.view("uint8").data


def frame_to_tensor(
    buf: Any,
    dtype: str,
    shape: tuple[int, ...] | list[int],
    device: torch.device | str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rebuild a tensor from frame bytes.

    Received zmq frames are read-only; the bytes are copied exactly once (by the
    cast/transfer when there is one) so the caller owns a normal, writable tensor.
    """
    import torch

    wire = torch_dtype(dtype)
    shape = tuple(shape)
    view = as_bytes(buf)
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if view.nbytes != expected:
        raise _bad(f"frame holds {view.nbytes} bytes, but {dtype} {list(shape)} needs {expected}")
    final_dtype = wire if out_dtype is None else out_dtype
    final_device = torch.device("cpu") if device is None else torch.device(device)
    if expected == 0:
        return torch.empty(shape, dtype=final_dtype, device=final_device)
    with warnings.catch_warnings():
        # The read-only view never escapes: it is copied below into memory torch allocated.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=wire).reshape(shape)
    if final_device.type == "cpu" and final_dtype == wire:
        # clone, not bytearray: torch's allocator aligns the copy, and MKL only gives
        # bit-reproducible results on aligned memory (remote drafts must equal local ones).
        return flat.clone()
    return flat.to(device=final_device, dtype=final_dtype)


def as_bytes(frame: Any) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or zmq.Frame."""
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq
    source = buffer if buffer is not None else frame
    try:
        view = memoryview(source)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"frame must be bytes, memoryview or zmq.Frame, got {type(frame).__name__} ({exc})",
        ) from None
    return view
