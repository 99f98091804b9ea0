"""OpenAI request bodies: what is accepted, refused with the parameter named, and sent on to the daemon.

Types are strict (a string is not a number, a bool is not an int), unknown parameters are
refused rather than ignored, and OpenAI parameters this server does not implement are
accepted only at their neutral value, so no request is quietly answered as something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from frontend.errors import APIError, echoed, invalid
from protocol.messages import MAX_MESSAGES, MAX_PROMPT_TOKENS, MAX_STOP
from protocol.sampling import MAX_TEMPERATURE, SEED_LIMIT, SamplingParams

STRICT = ConfigDict(extra="forbid", strict=True)


def null_is_false(value: Any) -> Any:
    """OpenAI types its flags `boolean | null`, null meaning the default (false)."""
    return False if value is None else value


def at_most(limit: int, what: str) -> Callable[[Any, ValidationInfo], Any]:
    """A before-validator: a list longer than the daemon takes is refused before its items are
    validated one by one (500,000 empty messages, 8 MB, held the event loop and every other
    request 2.6 s, and the front end's memory grew by 540 MB: an audit)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list):  # a prompt's token lists in a list too
            longest = max([len(value), *(len(v) for v in value[:limit] if isinstance(v, list))])
            if longest > limit:
                raise invalid(
                    f"{info.field_name}: at most {limit} {what} are supported (got {longest})", info.field_name
                )
        return value

    return check


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False

    _null_is_false = field_validator("include_usage", mode="before")(null_is_false)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    # What an assistant message of OpenAI's carries beside its text, with the values that say
    # nothing: a client sends back the message it was given (the SDK's messages.append(choice.message),
    # with refusal and tool_calls null), and this server's own answers must be taken back.
    NEUTRAL: ClassVar[tuple[str, ...]] = ("refusal", "tool_calls", "function_call", "audio", "annotations")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted; chat templates have no place for it
    refusal: Any = None
    tool_calls: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    def check_supported(self, at: int) -> None:
        for name in self.NEUTRAL:
            value = getattr(self, name)
            if not is_neutral(value, ([],)):
                raise invalid(
                    f"messages[{at}].{name}={echoed(value)} is not supported by this server",
                    f"messages.{at}.{name}",
                    "unsupported_parameter",
                )

    def to_daemon(self) -> dict[str, str]:
        content = self.content or ""
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)  # as vLLM: parts' words stay apart
        # Chat templates know the system role; OpenAI's newer name for it is developer.
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class GenerationRequest(BaseModel):
    """What both endpoints share: sampling, stops, streaming, and the parameters they refuse."""

    model_config = STRICT
    # OpenAI parameters this server does not implement, with the values that ask for nothing (or None).
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "n": (1,),
        "presence_penalty": (0,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
        "store": (False,),
        "metadata": ({},),
        "service_tier": ("auto", "default"),
    }

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # NaN was refused as "less than or equal to 2" (an audit): say it is no number.
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # not OpenAI's; as vLLM, for clients that want it (-1, 0: off)
    seed: int | None = Field(None, ge=-SEED_LIMIT, lt=SEED_LIMIT)  # OpenAI's: any int64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    _null_is_false = field_validator("stream", mode="before")(null_is_false)
    _stop_bound = field_validator("stop", mode="before")(at_most(MAX_STOP, "stop sequences"))

    def check_supported(self) -> None:
        """Refuse what this server would otherwise answer differently from what was asked."""
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if not is_neutral(value, neutral):
                code = "unsupported_value" if name == "n" else "unsupported_parameter"
                raise invalid(f"{name}={echoed(value)} is not supported by this server", name, code)
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if any(not s for s in self.stop_list):
            raise invalid("stop sequences must not be empty", "stop")

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> dict:
        """The daemon's sampling options, built (so checked) as the daemon reads them. OpenAI's
        default temperature is 1; send 0 for greedy (exactly the target's own output)."""
        options = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=None if self.seed is None else self.seed % SEED_LIMIT,  # any int64 seed, modulo 2^63
        )
        return options.to_dict()

    @property
    def limit_param(self) -> str:
        """The parameter that sets the answer's length, for errors to name it."""
        return "max_tokens"

    def common_fields(self, max_tokens: int | None, default_max_tokens: int) -> dict:
        """The daemon's generate fields that do not depend on the endpoint. A request that names no
        limit gets the default, cut to the room its prompt leaves in the model's context (as
        OpenAI's API does), where one that names a limit the prompt leaves no room for is refused."""
        fit = {"fit_context": True} if max_tokens is None else {}  # sent only when asked: see protocol/README.md
        return {
            **fit,
            "max_new_tokens": max_tokens or default_max_tokens,
            "stop": self.stop_list,
            "stream": self.stream,
            "sampling": self.sampling(),
        }


class ChatCompletionRequest(GenerationRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.NEUTRAL,
        "logprobs": (False,),
        "top_logprobs": (0,),
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "response_format": ({"type": "text"},),
        "parallel_tool_calls": (False, True),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    _messages_bound = field_validator("messages", mode="before")(at_most(MAX_MESSAGES, "messages"))
    prompt_param: ClassVar[str] = "messages"

    @property
    def limit_param(self) -> str:
        """The parameter that set the answer's length (it wins over max_tokens, as in vLLM)."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        for at, message in enumerate(self.messages):
            message.check_supported(at)

    def to_daemon(self, default_max_tokens: int) -> dict:
        limit = self.max_completion_tokens or self.max_tokens
        return {**self.common_fields(limit, default_max_tokens), "messages": [m.to_daemon() for m in self.messages]}


class CompletionRequest(GenerationRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.NEUTRAL,
        "logprobs": (),  # 0 asks for the chosen token's logprob (OpenAI, vLLM): not offered here
        "echo": (False,),
        "best_of": (1,),
        "suffix": ("",),
    }
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16  # OpenAI's default for this endpoint

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    _prompt_bound = field_validator("prompt", mode="before")(at_most(MAX_PROMPT_TOKENS, "token ids"))
    prompt_param: ClassVar[str] = "prompt"

    def to_daemon(self, default_max_tokens: int) -> dict:
        fields = self.common_fields(self.max_tokens, self.DEFAULT_MAX_TOKENS)
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # one prompt as a list of token lists (OpenAI's array of arrays)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return {**fields, "token_ids": list(prompt)}
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            raise invalid("one prompt per request is supported", "prompt", "unsupported_value")
        if isinstance(prompt, list):
            if len(prompt) > 1:
                raise invalid("one prompt per request is supported", "prompt", "unsupported_value")
            prompt = prompt[0] if prompt else ""
        if not prompt:
            raise invalid("the prompt is empty", "prompt")
        return {**fields, "prompt": prompt}


def is_neutral(value: Any, neutral: tuple) -> bool:
    """None, or equal to a neutral value (a bool is not taken for 0 or 1)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"the model {echoed(requested)} does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )
