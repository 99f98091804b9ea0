"""The schema: every message type, its fields, tensors and replies, in one place.

Changing anything here that a peer can observe means bumping
PROTOCOL_VERSION; peers refuse other versions outright instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ErrorCode, ProtocolError
from .fields import Bool, Float, Int, Json, List, Maybe, Str, Struct
from .sampling import SamplingParams
from .tensors import FLOAT_DTYPES, TensorSpec

PROTOCOL_VERSION = 8

# Header keys owned by the envelope; no message may use them as field names.
RESERVED_KEYS = ("v", "type", "id", "tensors")

MAX_SESSION_LEN = 128
MAX_ERROR_MESSAGE_LEN = 2048


@dataclass(frozen=True)
class TensorRule:
    """What a message requires of one named tensor.

    `min_shape` gives the smallest allowed size of each dim; its length is the
    required rank. Sizes that depend on the model (hidden size, block size)
    are the daemon's to check, as CONFIG_MISMATCH.
    """

    name: str
    dtypes: tuple[str, ...]
    min_shape: tuple[int, ...]
    optional: bool = False  # a message may leave it out


CrossCheck = Callable[[Mapping[str, Any], Mapping[str, TensorSpec]], None]


@dataclass(frozen=True)
class Schema:
    fields: Struct = field(default_factory=Struct)
    tensors: tuple[TensorRule, ...] = ()
    replies: tuple[str, ...] = ()
    check: CrossCheck | None = None


def _check_generate(fields: Mapping[str, Any], tensors: Mapping[str, TensorSpec]) -> None:
    given = [k for k in ("messages", "prompt", "token_ids") if fields[k]]
    if len(given) != 1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"generate: give exactly one of 'messages', 'prompt' or 'token_ids' (got {given or 'none'})",
        )
    if 0 < fields["heartbeat_s"] < MIN_HEARTBEAT_S or fields["heartbeat_s"] > MAX_HEARTBEAT_S:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"generate: heartbeat_s is 0 (none) or in [{MIN_HEARTBEAT_S}, {MAX_HEARTBEAT_S:g}] s, "
            f"got {fields['heartbeat_s']}",
        )


def _check_propose(fields: Mapping[str, Any], tensors: Mapping[str, TensorSpec]) -> None:
    """Feature rows [start, start+rows) must end exactly where the block starts: the drafter
    needs every context row up to it."""
    end = fields["start"] + tensors["features"].shape[0]
    if end != fields["position"]:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"propose: feature rows cover [{fields['start']}, {end}) but the block starts at "
            f"{fields['position']}; send rows [{fields['start']}, {fields['position']})",
        )


def _check_predraft(fields: Mapping[str, Any], tensors: Mapping[str, TensorSpec]) -> None:
    """The outcomes' known rows must add up to the head rows sent."""
    if sum(fields["known"]) != tensors["heads"].shape[0]:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"predraft: known rows add up to {sum(fields['known'])} but heads holds {tensors['heads'].shape[0]} rows",
        )


REQUEST_ID = Int(0, 2**63 - 1)
SESSION = Str(1, MAX_SESSION_LEN)
# Token positions: int32, far past any model's context, and far from int64 overflow when a
# block or a run of rows is added to one.
MAX_POSITION = 2**31 - 1
POSITION = Int(0, MAX_POSITION)
COUNT = Int(1)
MAX_CODEBOOK_ROWS = 1 << 14  # rows per `codebook` reply: 16 MiB per codebook at rank 256 in fp32
MAX_PREDRAFT_OUTCOMES = 16  # outcomes one `predraft` names at most: each costs the draft daemon a block
MAX_REPLY_TOKENS = 1 << 16  # token ids one `chunk` or `done` carries: a daemon's new-token limit stays within it
FLOAT_DTYPE = Str(choices=FLOAT_DTYPES)
FLOAT_DTYPE_LIST = List(FLOAT_DTYPE, 1, len(FLOAT_DTYPES) * 2)

TARGET_INFO = Struct({"hidden_size": COUNT, "num_hidden_layers": COUNT, "vocab_size": COUNT})
# Drafter checkpoint formats: DFlash, and DFlash2 (a convolution in the drafter, and a candidate
# selector the target runs over its logits with the drafter's codebooks).
FORMATS = ("dflash", "dflash2")
FORMAT_LIST = List(Str(choices=FORMATS), 1, len(FORMATS))
SELECTOR_INFO = Struct(
    {
        "rank": COUNT,
        "top_k": COUNT,
        "vocab_size": COUNT,
        "output_multiplier": Float(0.0),
        "final_logit_softcapping": Float(0.0),
        # Names the codebooks' contents: a target that holds them (from any daemon) need not fetch them again.
        "checksum": Str(1, 64),
    }
)
DRAFTER_INFO = Struct(
    {
        "block_size": COUNT,
        "hidden_size": COUNT,
        "target_layer_ids": List(Int(0), 1, 256),
        "mask_token_id": Int(0),
        "feature_width": COUNT,
        "ring_capacity": COUNT,
        "num_target_layers": COUNT,
    },
    # Token ids the drafter's proposals are restricted to (its training vocabulary, most
    # frequent first); empty means the whole vocabulary. Projecting onto fewer rows of the
    # target's LM head is most of the cost of a draft on the target side.
    optional={
        "draft_vocab": (List(Int(0, 2**31 - 1), 0, 1 << 17), []),
        "format": (Str(choices=FORMATS), "dflash"),
        "selector": (Maybe(SELECTOR_INFO), None),  # dflash2 only
    },
)


# What a drafter may ask of a target's memory and time, whatever its daemon claims. DFlash blocks
# are 8-16 tokens and selectors keep 16 candidates at rank 256; a block of 2**40 or a top-k of the
# whole vocabulary failed every request's step (tensors of that size), a ring of 2**40 positions
# every request's start, so such a drafter is a misfit: refused, and the target drafts without it.
MAX_BLOCK_SIZE = 128
MAX_RING_CAPACITY = 1 << 20
MAX_SELECTOR_TOP_K = 256
MAX_SELECTOR_RANK = 4096
MAX_OUTPUT_MULTIPLIER = 1e4


def fit_problems(drafter: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    """Why a drafter (DRAFTER_INFO) cannot serve a target (TARGET_INFO); [] when it fits.

    Both peers run this same check on the same wire structs: the draft daemon on `hello`,
    the target on `hello_ok` and for a drafter in its own process.
    """
    problems = []
    if drafter["hidden_size"] != target["hidden_size"]:
        problems.append(f"hidden size: target {target['hidden_size']}, drafter {drafter['hidden_size']}")
    if drafter["num_target_layers"] != target["num_hidden_layers"]:
        problems.append(
            f"layer count: target has {target['num_hidden_layers']}, "
            f"drafter was built for {drafter['num_target_layers']}"
        )
    taps = drafter["target_layer_ids"]
    outside = [layer for layer in taps if not 0 <= layer < target["num_hidden_layers"]]
    if outside:
        problems.append(f"drafter taps layers {outside}, the target has layers 0..{target['num_hidden_layers'] - 1}")
    if drafter["feature_width"] != len(taps) * target["hidden_size"]:
        problems.append(f"feature width {drafter['feature_width']} != {len(taps)} taps x {target['hidden_size']}")
    if not 0 <= drafter["mask_token_id"] < target["vocab_size"]:
        problems.append(
            f"mask_token_id {drafter['mask_token_id']} is outside the target's embedding table "
            f"({target['vocab_size']} rows); this drafter was built for a different vocabulary"
        )
    vocab = drafter.get("draft_vocab") or []
    if vocab and max(vocab) >= target["vocab_size"]:
        problems.append("the drafter's draft vocabulary has ids outside the target's vocabulary")
    if len(set(vocab)) != len(vocab):  # a token listed twice would be drawn twice as often as q says
        problems.append("the drafter's draft vocabulary lists a token more than once")
    if not 2 <= drafter["block_size"] <= MAX_BLOCK_SIZE:
        problems.append(f"block size {drafter['block_size']} is outside 2..{MAX_BLOCK_SIZE}")
    if drafter["ring_capacity"] > MAX_RING_CAPACITY:
        problems.append(f"ring capacity {drafter['ring_capacity']} is over {MAX_RING_CAPACITY} positions")
    selector = drafter.get("selector")
    if drafter.get("format", "dflash") == "dflash2" and not selector:
        problems.append("a dflash2 drafter must describe its selector")
    if selector and selector["vocab_size"] != target["vocab_size"]:
        problems.append(
            f"the selector's codebooks cover {selector['vocab_size']} tokens, the target's vocabulary "
            f"{target['vocab_size']}"
        )
    if selector and (
        selector["top_k"] > MAX_SELECTOR_TOP_K
        or selector["rank"] > MAX_SELECTOR_RANK
        or not 0 < selector["output_multiplier"] <= MAX_OUTPUT_MULTIPLIER
    ):
        problems.append(
            f"the selector's top_k {selector['top_k']}, rank {selector['rank']} or output multiplier "
            f"{selector['output_multiplier']} is over {MAX_SELECTOR_TOP_K}, {MAX_SELECTOR_RANK} or "
            f"{MAX_OUTPUT_MULTIPLIER:g} (or the multiplier is not positive)"
        )
    return problems


MAX_PROMPT_CHARS = 512 * 1024
MAX_MESSAGES = 1024  # a chat's turns in one generate
MAX_PROMPT_TOKENS = 1 << 16  # a prompt given as token ids
MAX_STOP = 16  # stop strings in one generate (OpenAI's limit is 4)
# A generate request with `heartbeat_s` > 0 is cancelled when its client has sent nothing
# (heartbeats, or anything else) for this many intervals: the client is gone or stuck.
HEARTBEAT_MISSES = 3
MIN_HEARTBEAT_S = 0.05
# A promise of a beat every hour or more is no promise: it would keep a vanished client's requests
# running far past the daemon's own bound for silence (--max-silence).
MAX_HEARTBEAT_S = 3600.0
# Why a generate ended: its end of sequence, its token limit, one of its stop strings, a cancel.
FINISH_REASONS = ("eos", "length", "stop", "cancelled")
# A target pings the draft daemon at least this often while it holds sessions there, busy or not;
# a draft daemon takes sessions only from a peer silent much longer (--reclaim-after), so no
# newcomer, however many identities it has, evicts a live target's idle slots.
KEEPALIVE_S = 10.0
CHAT_MESSAGE = Struct({"role": Str(1, 32), "content": Str(0, MAX_PROMPT_CHARS)})
# A generate's sampling options, typed as the message is read: as a free-form map it let one queued
# request hold 64 MB of nested junk, counted as a kilobyte. Their ranges are SamplingParams' to check.
_SAMPLING_TYPES = {"temperature": Float(), "top_p": Float(), "top_k": Int(), "seed": Maybe(Int())}
SAMPLING = Struct(optional={key: (kind, SamplingParams().to_dict()[key]) for key, kind in _SAMPLING_TYPES.items()})

SESSION_ONLY = Struct({"session": SESSION})
KEPT_NAME = Str(1, MAX_SESSION_LEN)

SCHEMAS: dict[str, Schema] = {
    "hello": Schema(
        Struct(
            {"wire_dtypes": FLOAT_DTYPE_LIST, "target": TARGET_INFO},
            # The drafter formats this target can drive; a drafter of another is refused.
            optional={"client": (Str(0, 128), ""), "formats": (FORMAT_LIST, ["dflash"])},
        ),
        replies=("hello_ok",),
    ),
    "hello_ok": Schema(
        Struct(
            {
                "drafter": DRAFTER_INFO,
                "wire_dtype": FLOAT_DTYPE,
                "wire_dtypes": FLOAT_DTYPE_LIST,
            }
        )
    ),
    # `mask`: the target's embedding of the drafter's mask token, the same for every block,
    # so it travels once per session instead of block_size - 1 times per step.
    "open": Schema(SESSION_ONLY, tensors=(TensorRule("mask", FLOAT_DTYPES, (1, 1)),), replies=("ok",)),
    "reset": Schema(Struct({"session": SESSION, "position": POSITION}), replies=("ok",)),
    "close": Schema(SESSION_ONLY, replies=("ok",)),
    # A prefix's context K/V kept on the draft daemon by the target's name for it, so a later
    # session of the same peer starting with that prefix needs neither its rows on the wire nor
    # their recomputation (the target's prefix cache names its entries).
    "keep": Schema(Struct({"session": SESSION, "name": KEPT_NAME, "rows": COUNT}), replies=("kept",)),
    "restore": Schema(Struct({"session": SESSION, "name": KEPT_NAME, "rows": COUNT}), replies=("kept",)),
    # How many positions from 0 were kept (`keep`) or now start the session's context (`restore`).
    "kept": Schema(Struct({"rows": Int(0, MAX_POSITION)})),
    "propose": Schema(
        Struct(
            {"session": SESSION, "start": POSITION, "position": POSITION},
            # How many draft rows (block slots 1..rows) the target will use; 0 means all. `predraft`:
            # which outcome of the session's last `predraft` happened (its index), or -1 for none.
            optional={"rows": (Int(0), 0), "predraft": (Int(-1, MAX_PREDRAFT_OUTCOMES - 1), -1)},
        ),
        tensors=(
            TensorRule("features", FLOAT_DTYPES, (0, 1)),
            TensorRule("noise", FLOAT_DTYPES, (1, 1)),
        ),
        replies=("proposal",),
        check=_check_propose,
    ),
    # Pre-drafting (new in version 6): as its verify starts, the target names the outcomes it
    # finds likeliest, each by its known tokens [last_tok, accepted drafts, bonus] embedded
    # (`heads`: one run of `known[i]` rows per outcome), and the daemon drafts the next block of
    # each over the session's context as it ends now, at `position`, while the verify runs.
    "predraft": Schema(
        Struct(
            {"session": SESSION, "position": POSITION, "known": List(Int(2, 1 << 10), 1, MAX_PREDRAFT_OUTCOMES)},
            # The time the daemon has before the verify ends (the target's measure); 0: none given, and the
            # daemon drafts the likeliest outcomes that fit one pass (`outcomes_per_pass`).
            optional={"budget_ms": (Float(0.0), 0.0)},
        ),
        tensors=(TensorRule("heads", FLOAT_DTYPES, (2, 1)),),
        replies=("predrafts",),
        check=_check_predraft,
    ),
    # The pre-drafts themselves (version 7), sent as soon as they are drafted, so the target holds
    # them when its verify ends and a hit waits for nothing: the first `outcomes` outcomes named
    # (as many as the daemon drafts within `budget_ms`), outcome i's rows `block_size - known[i]`,
    # one run per outcome in the order named; `gate` for a dflash2 drafter.
    "predrafts": Schema(
        Struct({"draft_ms": Float(0.0), "outcomes": Int(0, MAX_PREDRAFT_OUTCOMES)}),
        tensors=(TensorRule("hidden", FLOAT_DTYPES, (0, 1)), TensorRule("gate", FLOAT_DTYPES, (0, 1), optional=True)),
    ),
    # `gate` (dflash2): the selector's projection of the same rows, [rows, selector rank].
    # `predrafted`: the drafts are the named outcome's pre-draft (possibly fewer rows than asked).
    "proposal": Schema(
        Struct({"draft_ms": Float(0.0)}, optional={"predrafted": (Bool(), False)}),
        tensors=(TensorRule("hidden", FLOAT_DTYPES, (0, 1)), TensorRule("gate", FLOAT_DTYPES, (0, 1), optional=True)),
    ),
    # A dflash2 drafter's selector codebooks, rows [start, start + rows) of each: fetched once,
    # in pieces that keep a reply small.
    "codebook": Schema(
        Struct({"start": Int(0, 2**31 - 1), "rows": Int(1, MAX_CODEBOOK_ROWS)}), replies=("codebook_ok",)
    ),
    "codebook_ok": Schema(
        tensors=(TensorRule("predecessor", FLOAT_DTYPES, (1, 1)), TensorRule("successor", FLOAT_DTYPES, (1, 1)))
    ),
    "ping": Schema(replies=("pong",)),
    # `pid` (version 8): the answering daemon's process, so that a launcher knows the daemon it
    # started from another that answers at the same address (two runs crossed: an audit).
    "pong": Schema(Struct({"time": Float(), "sessions": Int(0), "pid": Int(0)})),
    "stats": Schema(replies=("stats_ok",)),
    "stats_ok": Schema(Struct({"stats": Json()})),
    "ok": Schema(),
    # Client <-> target daemon. A generate request is answered by zero or more `chunk`
    # replies (when streaming) and one final `done`, all carrying the request's id.
    "generate": Schema(
        Struct(
            {"max_new_tokens": COUNT},
            optional={
                "messages": (List(CHAT_MESSAGE, 0, MAX_MESSAGES), []),
                "prompt": (Str(0, MAX_PROMPT_CHARS), ""),
                "token_ids": (List(Int(0, 2**31 - 1), 0, MAX_PROMPT_TOKENS), []),
                "stop": (List(Str(1, 256), 0, MAX_STOP), []),
                "hints": (List(Int(0, 2**31 - 1), 0, 1 << 14), []),
                "stream": (Bool(), True),
                "sampling": (SAMPLING, SAMPLING.check("sampling", {})),
                # The client's promise to send something (a `heartbeat`) at least this often;
                # 0: no promise, and the request runs until done or cancelled.
                "heartbeat_s": (Float(0.0), 0.0),
                # max_new_tokens as a cap: the answer ends where the model's positions do (an
                # OpenAI request that names no limit), instead of a context_length refusal.
                "fit_context": (Bool(), False),
            },
        ),
        replies=("chunk", "done"),
        check=_check_generate,
    ),
    "chunk": Schema(Struct({"text": Str(0, MAX_PROMPT_CHARS), "token_ids": List(Int(0), 0, MAX_REPLY_TOKENS)})),
    "done": Schema(
        Struct(
            {
                "text": Str(0, MAX_PROMPT_CHARS),
                "token_ids": List(Int(0), 0, MAX_REPLY_TOKENS),
                "finish_reason": Str(1, 32, FINISH_REASONS),
                "stats": Json(),
            }
        )
    ),
    # Stops the running or queued generate request whose id this message carries.
    "cancel": Schema(replies=("done",)),
    # "I am still here, waiting for the request with this id": a notice, never answered.
    "heartbeat": Schema(),
    "error": Schema(
        Struct(
            {
                "code": Str(choices=tuple(c.value for c in ErrorCode)),
                "message": Str(0, MAX_ERROR_MESSAGE_LEN),
            }
        )
    ),
}


def _self_check() -> None:
    for name, schema in SCHEMAS.items():
        clash = set(RESERVED_KEYS) & {*schema.fields.required, *schema.fields.optional}
        assert not clash, f"{name} uses reserved header keys {clash}"


_self_check()
