"""What a generate request asks of this target, read and checked before it takes a slot: its
prompt as token ids, the answer it may run to, and how it decodes. A request that cannot start is
refused here (ProtocolError, ContextLengthError), answered with its error, and costs no slot."""

from __future__ import annotations

from protocol import ErrorCode, Message, ProtocolError
from protocol.sampling import SamplingParams
from target_node.decoding.options import DecodeOptions
from target_node.drafting.datastore import Datastore
from target_node.model.target import ContextLengthError, TargetModel
from target_node.serving.settings import ServiceSettings


def prompt_ids(target: TargetModel, msg: Message) -> list[int]:
    """The prompt as the target's token ids, from chat messages, text or ids, each in its vocabulary."""
    try:
        if msg["messages"]:
            ids = target.encode_chat(msg["messages"])
        elif msg["prompt"]:
            ids = target.encode_text(msg["prompt"])
        else:
            ids = list(msg["token_ids"])
    except Exception as exc:  # the tokenizer or chat template refused this input
        raise ProtocolError(ErrorCode.BAD_FIELD, f"the prompt cannot be tokenized: {exc}") from exc
    vocab = target.vocab_size  # read once, not once per token
    top = max(max(ids, default=0), max(msg["hints"], default=0))  # in C: a 65,536-id prompt in ~1 ms
    bad = [t for t in (*ids, *msg["hints"]) if t >= vocab] if top >= vocab else []
    if bad:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"token ids {bad[:5]} are outside the vocabulary ({vocab})")
    if not ids:
        raise ProtocolError(ErrorCode.BAD_FIELD, "the prompt is empty")
    if msg["stop"] and target.tokenizer is None:
        raise ProtocolError(ErrorCode.BAD_FIELD, "stop strings need a tokenizer; this target has none")
    return ids


def answer_budget(target: TargetModel, settings: ServiceSettings, msg: Message, prompt_tokens: int) -> int:
    """The request's max_new_tokens, where it asks (`fit_context`) cut to the positions its
    prompt leaves and to this daemon's own limit: a prompt that leaves none is still over the
    model's length."""
    budget, limit = msg["max_new_tokens"], target.max_positions
    if msg["fit_context"]:
        budget = min(budget, settings.max_new_tokens_limit)
        if limit is not None and prompt_tokens >= limit:  # said so: the client set no max_new_tokens
            why = f"the prompt ({prompt_tokens} tokens) fills the model's {limit} positions, leaving none to answer"
            raise ContextLengthError(why)
        if limit is not None:
            budget = min(budget, limit - prompt_tokens)
    target.check_length(prompt_tokens, budget)
    return budget


def decode_options(
    msg: Message,
    max_new_tokens: int,
    settings: ServiceSettings,
    adaptive: bool,
    lookup: bool,
    datastore: Datastore | None,
) -> DecodeOptions:
    """A generate request's options under this daemon's limits and settings: `adaptive`, whether
    its governor decides; `lookup`, whether it looks its guesses up (in `datastore` too, where one
    is built)."""
    if max_new_tokens > settings.max_new_tokens_limit:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"max_new_tokens {max_new_tokens} exceeds this daemon's limit {settings.max_new_tokens_limit}",
        )
    try:
        sampling = SamplingParams.from_dict(msg["sampling"])
    except (TypeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"sampling: {exc}") from exc
    return DecodeOptions(
        max_new_tokens,
        stop_strings=tuple(msg["stop"]),
        hint_tokens=tuple(msg["hints"]),
        sampling=sampling,
        adaptive=adaptive,
        tree_nodes=settings.tree_nodes,
        lookup=lookup,
        datastore=datastore,
        prefill_chunk=settings.prefill_chunk,
    )
