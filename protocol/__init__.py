"""Wire format between the target process and the draft daemon.

Knows frames, headers and tensors; knows nothing of models. See README.md
for the byte-level description a peer in another language needs.
"""

from .codec import (
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    Message,
    decode,
    encode,
    encode_error,
)
from .errors import ErrorCode, ProtocolError
from .messages import (
    MAX_ERROR_MESSAGE_LEN,
    MAX_SESSION_LEN,
    PROTOCOL_VERSION,
    SCHEMAS,
    Schema,
    TensorRule,
)
from .tensors import (
    FLOAT_DTYPES,
    ITEMSIZE,
    WIRE_DTYPES,
    TensorSpec,
    frame_to_tensor,
    tensor_to_frame,
    wire_dtype_of,
)

__all__ = [
    "FLOAT_DTYPES",
    "ITEMSIZE",
    "MAX_ERROR_MESSAGE_LEN",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_SESSION_LEN",
    "MAX_TENSORS",
    "PROTOCOL_VERSION",
    "SCHEMAS",
    "WIRE_DTYPES",
    "ErrorCode",
    "Message",
    "ProtocolError",
    "Schema",
    "TensorRule",
    "TensorSpec",
    "decode",
    "encode",
    "encode_error",
    "frame_to_tensor",
    "tensor_to_frame",
    "wire_dtype_of",
]
