"""Errors as the OpenAI API words them: `{"error": {message, type, param, code}}` with an HTTP status.

Every failure a client can cause or meet ends here, so clients written for OpenAI (the
official one raises BadRequestError, RateLimitError, ... from the status) read ours as theirs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from protocol import ErrorCode

ECHO_CHARS = 200  # of a client's value quoted in an error: a 300k-key logit_bias came back as 3.8 MB (an audit)


def echoed(value: object) -> str:
    """A client's value as an error message quotes it: its repr, cut short."""
    return _cut(repr(value))


# The daemon's error codes that mean the request itself was wrong (HTTP 400).
CLIENT_FAULTS = {ErrorCode.BAD_FIELD, ErrorCode.BAD_TENSOR, ErrorCode.TOO_LARGE, ErrorCode.MALFORMED}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A client's text echoed back (a model name, a parameter) may hold lone surrogates, which
        # JSON allows and UTF-8 cannot carry: escaped, or the error itself became a bare 500.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, background: BackgroundTask | None = None) -> JSONResponse:
        """`background`: what runs once the answer has gone (a cancel that waits for the daemon)."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers, background=background)


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unreachable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable_error", code="target_unreachable")


def misspoke(message: str) -> APIError:
    """502 for a target daemon whose replies this front end cannot read (another protocol version)."""
    return APIError(
        502, f"the target daemon's reply could not be read: {message}", type_="server_error", code="upstream_protocol"
    )


def cancelled_by_daemon(heartbeat_s: float) -> APIError:
    """503 for an answer the target daemon ended unasked: it heard no heartbeat for three of them
    (a stream its client stopped reading, which holds the heartbeats up), or it lost the request."""
    return APIError(
        503,
        f"the target daemon ended this request before its answer was complete (no heartbeat for 3 x "
        f"{heartbeat_s:g} s: a stream not read for that long is given up); the answer so far is incomplete",
        type_="service_unavailable_error",
        code="target_request_cancelled",
    )


def shutting_down() -> APIError:
    """503 for an answer this server ended because it shuts down (frontend/drain.py): retry."""
    return APIError(
        503,
        "this server is shutting down: the answer so far is incomplete; retry",
        type_="service_unavailable_error",
        code="server_shutting_down",
    )


def unauthorized(key_given: bool) -> APIError:
    why = "Incorrect API key provided" if key_given else "No API key provided: send Authorization: Bearer KEY"
    return APIError(401, why, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int, declared: int | None = None) -> APIError:
    """413 for a request body over the front end's limit (`--max-body-size`)."""
    size = f" ({declared} bytes)" if declared is not None else ""
    return APIError(
        413, f"the request body{size} is over this server's limit of {limit} bytes", code="request_too_large"
    )


def too_many_open(message: str) -> APIError:
    """429 for a request past the sockets (or files) the front end may hold: retry."""
    return APIError(429, message, type_="rate_limit_error", code="rate_limit_exceeded")


def bodies_over_budget(budget: int) -> APIError:
    """429 for a body that would pass the bytes the front end gives the bodies arriving at once."""
    return too_many_open(f"the request bodies arriving now fill this server's {budget} bytes for them; retry later")


def body_too_slow(deadline_s: float) -> APIError:
    """408 for a request body that did not arrive whole within the front end's deadline."""
    return APIError(
        408, f"the request body did not arrive within {deadline_s:g} s; send it whole", code="request_timeout"
    )


def from_daemon(code: str, message: str, prompt_param: str, limit_param: str = "max_tokens") -> APIError:
    """The target daemon's `error` reply, as the status an HTTP client expects, naming the
    parameters the request used: `limit_param` is the one that set its answer's length."""
    if code == ErrorCode.BUSY.value:
        return APIError(429, message, type_="rate_limit_error", code="rate_limit_exceeded")
    if code == ErrorCode.CONTEXT_LENGTH.value:  # in the request's words: its max_tokens
        message = message.replace("max_new_tokens", limit_param)
        return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    if code == ErrorCode.UNKNOWN_REQUEST.value:  # the daemon restarted under it: retrying may serve it
        return APIError(503, f"the target daemon lost the request: {message}", type_="service_unavailable_error",
                        code="target_request_lost")  # fmt: skip
    if code in {c.value for c in CLIENT_FAULTS}:
        if "max_new_tokens" in message:  # the daemon's limit, in the request's words
            return invalid(message.replace("max_new_tokens", limit_param), limit_param)
        if message.startswith("token ids "):  # a prompt of ids the vocabulary does not hold
            return invalid(message, prompt_param)
        return invalid(message)
    return APIError(500, f"the target daemon failed: {message}", type_="server_error", code=code)


# The daemon's generate fields by the request parameter that sets each (None: the prompt's own name).
PARAMS = {"max_new_tokens": "max_tokens", "stop": "stop", "messages": "messages", "token_ids": None, "prompt": None}
WIRE_FIELD = re.compile(r"generate\.(?:sampling\.)?(\w+)((?:\[\d+\])?(?:\.\w+)*): (.*)", re.DOTALL)


def from_protocol(message: str, prompt_param: str) -> APIError:
    """A request the wire's limits refuse, worded with the parameter that set the field: the
    protocol's own names (`generate.max_new_tokens`) read as an internal error (an audit)."""
    found = WIRE_FIELD.fullmatch(message)
    if found is None and "header cannot be packed" in message and "surrogates" in message:  # a lone surrogate
        why = message.partition("header cannot be packed: ")[2]
        return invalid(f"the request holds text that is not valid Unicode: {why}")
    if found is None:  # the header as a whole: too large is the prompt's doing
        too_large = message.startswith("generate: header is ")
        return invalid(message.removeprefix("generate: "), prompt_param if too_large else None)
    field, index, why = found.groups()
    param = PARAMS.get(field, field) or prompt_param  # sampling's fields are the parameters' own names
    return invalid(f"{param}{index or ''}: {why}", param)


def from_validation(errors: Sequence[dict]) -> APIError:
    """pydantic's (or FastAPI's) complaint about a request body, naming the parameter."""
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    first = _furthest(errors)
    loc = first.get("loc", ())
    if first.get("type") == "extra_forbidden" and loc:  # the last part is the client's own key, whatever it reads
        param = _cut(".".join([*_param_parts(loc[:-1]), str(loc[-1])]))
        return invalid(f"unrecognized request argument supplied: {param}", param, "unknown_parameter")
    param = _param(loc)
    # A value that fits no member of a union gets one complaint per member: say them together.
    reasons = list(dict.fromkeys(e.get("msg", "invalid value") for e in errors if _param(e.get("loc", ())) == param))
    message = " or ".join(reasons)
    if param is None:
        return invalid(f"the request body must be a JSON object (Content-Type: application/json): {message}")
    return invalid(f"{param}: {message}", param)


def _furthest(errors: Sequence[dict]) -> dict:
    """The first error, or the deepest of those within its parameter: the union member the value
    got furthest in says what is wrong with it. A message's list of parts holding an image read
    "messages.0.content: Input should be a valid string", the str member's word (an audit)."""
    root = _param_parts(errors[0].get("loc", ()))
    if not root:
        return errors[0]
    within = [e for e in errors if _param_parts(e.get("loc", ()))[: len(root)] == root]
    return max(within, key=lambda e: len(_param_parts(e.get("loc", ()))))


def _param(loc: Sequence) -> str | None:
    """`messages.0.content` from pydantic's location, without its "body" root and union member
    tags, cut to ECHO_CHARS (a key is the client's: an 8 MiB one came back twice, an audit)."""
    return _cut(".".join(_param_parts(loc))) or None


def _param_parts(loc: Sequence) -> list[str]:
    return [str(p) for p in loc if p != "body" and not _is_union_tag(p)]


def _cut(text: str) -> str:
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})
