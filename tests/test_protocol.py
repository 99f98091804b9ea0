"""Wire-format tests: round trips, one test per validation rule, a real socket."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time

import msgpack
import pytest
import torch
import zmq
from helpers import send_until_refused, wait_until

from protocol import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    SCHEMAS,
    ErrorCode,
    ProtocolError,
    decode,
    encode,
    encode_error,
    frame_to_tensor,
    tensor_to_frame,
)
from protocol.messages import fit_problems
from protocol.sampling import SamplingParams
from protocol.transport import HELD_PER_PEER, Client, Server

HIDDEN, WIDTH, BLOCK = 8, 24, 4

DRAFTER = {
    "block_size": BLOCK,
    "hidden_size": HIDDEN,
    "target_layer_ids": [1, 5, 9],
    "mask_token_id": 151669,
    "feature_width": WIDTH,
    "ring_capacity": 4096,
    "num_target_layers": 3,
    "draft_vocab": [4, 8, 15],
}

SELECTOR = {
    "rank": 16,
    "top_k": 8,
    "vocab_size": 99,
    "output_multiplier": 1.0,
    "final_logit_softcapping": 0.0,
    "checksum": "ab12",
}

# type -> (fields, tensors); every schema entry must appear here ("...2": a second sample of one).
SAMPLES = {
    "hello": (
        {
            "wire_dtypes": ["bfloat16", "float32"],
            "target": {
                "hidden_size": HIDDEN,
                "num_hidden_layers": 12,
                "vocab_size": 99,
            },
        },
        {},
    ),
    "hello_ok": (
        {"drafter": DRAFTER, "wire_dtype": "bfloat16", "wire_dtypes": ["bfloat16"]},
        {},
    ),
    "hello_ok2": (
        {
            "drafter": {**DRAFTER, "format": "dflash2", "selector": SELECTOR},
            "wire_dtype": "float32",
            "wire_dtypes": ["float32"],
        },
        {},
    ),
    "open": ({"session": "s-1"}, {"mask": torch.randn(1, HIDDEN)}),
    "reset": ({"session": "s-1", "position": 0}, {}),
    "keep": ({"session": "s-1", "name": "a1b2-0", "rows": 12}, {}),
    "restore": ({"session": "s-1", "name": "a1b2-0", "rows": 12}, {}),
    "kept": ({"rows": 12}, {}),
    "close": ({"session": "s-1"}, {}),
    "propose": (
        {"session": "s-1", "start": 3, "position": 5},
        {"features": torch.randn(2, WIDTH), "noise": torch.randn(BLOCK, HIDDEN)},
    ),
    "proposal": ({"draft_ms": 1.25}, {"hidden": torch.randn(BLOCK, HIDDEN), "gate": torch.randn(BLOCK, 16)}),
    "proposal2": ({"draft_ms": 0.5, "predrafted": True}, {"hidden": torch.randn(3, HIDDEN)}),
    "predraft": ({"session": "s-1", "position": 5, "known": [2, 4, 3]}, {"heads": torch.randn(9, HIDDEN)}),
    "predraft2": (
        {"session": "s-1", "position": 5, "known": [2, 4, 3], "budget_ms": 12.5},
        {"heads": torch.randn(9, HIDDEN)},
    ),
    "predrafts": ({"draft_ms": 2.5, "outcomes": 3}, {"hidden": torch.randn(15, HIDDEN)}),
    "predrafts2": ({"draft_ms": 2.5, "outcomes": 3}, {"hidden": torch.randn(15, HIDDEN), "gate": torch.randn(15, 16)}),
    "codebook": ({"start": 4096, "rows": 4096}, {}),
    "codebook_ok": ({}, {"predecessor": torch.randn(4, 16), "successor": torch.randn(4, 16)}),
    "ping": ({}, {}),
    "pong": ({"time": 1700000000.5, "sessions": 2, "pid": 4242}, {}),
    "stats": ({}, {}),
    "stats_ok": ({"stats": {"steps": 10, "ms": [1.0, 2.5], "x": {"y": None}}}, {}),
    "ok": ({}, {}),
    "error": ({"code": "unknown_session", "message": "no session 's-9'"}, {}),
    "generate": (
        {
            "max_new_tokens": 32,
            "messages": [{"role": "user", "content": "hi"}],
            "prompt": "",
            "token_ids": [],
            "stop": ["\n\n"],
            "hints": [5, 6],
            "stream": False,
            "sampling": {"temperature": 0.7, "seed": 3},
            "heartbeat_s": 1.5,
            "fit_context": True,
        },
        {},
    ),
    "chunk": ({"text": "Hel", "token_ids": [9, 10]}, {}),
    "done": ({"text": "Hello", "token_ids": [9, 10, 11], "finish_reason": "eos", "stats": {"tau": 1.5}}, {}),
    "cancel": ({}, {}),
    "heartbeat": ({}, {}),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view so comparisons are bitwise (NaN, -0.0 included)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def propose_frames(rows: int = 2) -> list:
    return encode(
        "propose",
        11,
        {"session": "s", "start": 5 - rows, "position": 5},
        {"features": torch.randn(rows, WIDTH), "noise": torch.randn(BLOCK, HIDDEN)},
    )


def tamper(frames: list, edit) -> list:
    """Re-pack the header after `edit(header)`; tensor frames are kept."""
    header = msgpack.unpackb(frames[0])
    edit(header)
    return [msgpack.packb(header), *frames[1:]]


def code_of(frames: list, **kw) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        decode(frames, **kw)
    return info.value.code


# --- round trips -------------------------------------------------------------


def test_samples_cover_schema():
    assert {name.rstrip("2") for name in SAMPLES} == set(SCHEMAS)
    assert all(r in SCHEMAS for schema in SCHEMAS.values() for r in schema.replies)


@pytest.mark.parametrize("type_", sorted(SAMPLES))
def test_round_trip_every_type(type_):
    fields, tensors = SAMPLES[type_]
    sample, type_ = type_, type_.rstrip("2")
    msg = decode(encode(type_, 42, fields, tensors))
    assert (msg.type, msg.id) == (type_, 42)
    expected = dict(fields)
    if type_ == "hello":
        expected["client"] = ""  # optional field, default filled in
        expected["formats"] = ["dflash"]  # a target that says nothing drives dflash drafters
    if sample == "hello_ok":
        expected["drafter"] = {**DRAFTER, "format": "dflash", "selector": None}
    if type_ == "propose":
        expected["rows"], expected["predraft"] = 0, -1
    if sample == "proposal":
        expected["predrafted"] = False
    if sample == "predraft":
        expected["budget_ms"] = 0.0  # none given (the daemon drafts one pass)
    if type_ == "generate":
        expected["sampling"] = {**SamplingParams().to_dict(), **fields["sampling"]}  # defaults filled in
    assert msg.fields == expected
    assert set(msg.tensors) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(bits(msg.tensor(name)), bits(t))


def test_fp32_bit_exact_with_special_values():
    t = torch.tensor([[0.0, -0.0, float("inf"), float("nan")], [1e-45, -3.4e38, 1.0, 2.0]])
    noise = torch.randn(BLOCK, 4)
    msg = decode(
        encode(
            "propose",
            1,
            {"session": "s", "start": 0, "position": 2},
            {"features": t, "noise": noise},
        )
    )
    assert torch.equal(bits(msg.tensor("features")), bits(t))
    assert msg.tensor("features").dtype == torch.float32


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_half_dtypes_exact_as_cast(wire):
    src = torch.randn(BLOCK, HIDDEN, dtype=torch.float32) * 100
    msg = decode(encode("proposal", 1, {"draft_ms": 0}, {"hidden": src}, wire_dtype=wire))
    spec, _ = msg.tensors["hidden"]
    assert spec.dtype == wire and spec.nbytes == BLOCK * HIDDEN * 2
    cast = src.to(getattr(torch, wire))
    assert torch.equal(bits(msg.tensor("hidden")), bits(cast))
    widened = msg.tensor("hidden", dtype=torch.float32)
    assert torch.equal(widened, cast.float())


def test_per_tensor_dtype_override():
    frames = encode(
        "propose",
        1,
        {"session": "s", "start": 0, "position": 1},
        {"features": (torch.randn(1, 4), "bfloat16"), "noise": torch.randn(2, 4)},
        wire_dtype="float16",
    )
    msg = decode(frames)
    assert msg.tensors["features"][0].dtype == "bfloat16"
    assert msg.tensors["noise"][0].dtype == "float16"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_tensor_helpers_exact(dtype):
    t = torch.tensor([[0, -1, 2**31 - 1], [151669, 7, -(2**31)]], dtype=dtype)
    wire, shape, buf = tensor_to_frame(t, str(dtype).removeprefix("torch."))
    back = frame_to_tensor(bytes(buf), wire, shape)  # bytes: read-only, like zmq
    assert back.dtype == dtype and torch.equal(back, t)
    back[0, 0] = 5  # the result is an owned, writable tensor


def test_read_only_frames_give_owned_tensors():
    frames = [bytes(f) for f in propose_frames()]  # read-only, like zmq frames
    msg = decode(frames)
    same = msg.tensor("noise")
    wider = msg.tensor("noise", dtype=torch.float64)
    same += 1  # writable, and not aliasing the frame
    wider += 1
    assert torch.equal(msg.tensor("noise") + 1, same)
    assert torch.equal(wider, msg.tensor("noise").double() + 1)


def test_tensor_to_frame_shares_contiguous_fp32_memory():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    _, shape, buf = tensor_to_frame(t, "float32")
    t[0, 0] = 9.0
    assert shape == (2, 3) and buf.nbytes == 24
    assert torch.frombuffer(bytearray(buf), dtype=torch.float32)[0] == 9.0


def test_zero_row_features_and_noncontiguous_input():
    noise = torch.randn(HIDDEN, BLOCK).t()  # non-contiguous
    msg = decode(
        encode(
            "propose",
            3,
            {"session": "s", "start": 5, "position": 5},
            {"features": torch.empty(0, WIDTH), "noise": noise},
        )
    )
    assert msg.tensor("features").shape == (0, WIDTH)
    assert torch.equal(msg.tensor("noise"), noise)


def test_accepts_zmq_frames_and_memoryviews():
    frames = propose_frames()
    as_zmq = [zmq.Frame(bytes(f)) for f in frames]
    assert decode(as_zmq).tensor("noise").shape == (BLOCK, HIDDEN)
    assert decode([memoryview(bytes(f)) for f in frames]).id == 11


def test_error_reply_round_trip():
    msg = decode(encode_error(9, ErrorCode.UNKNOWN_SESSION, "no session 'x'"))
    with pytest.raises(ProtocolError) as info:
        msg.expect("ok")
    err = info.value
    assert err.code is ErrorCode.UNKNOWN_SESSION and err.remote
    assert err.request_id == 9 and err.message == "no session 'x'"


def test_error_reply_truncates_and_tolerates_missing_id():
    msg = decode(encode_error(None, "internal", "x" * 10_000))
    assert msg.id == 0 and len(msg["message"]) <= 2048


def test_expect_rejects_wrong_reply_type():
    msg = decode(encode("ok", 1, {}))
    assert msg.expect("ok") is msg
    with pytest.raises(ProtocolError) as info:
        msg.expect("pong")
    assert info.value.code is ErrorCode.UNKNOWN_TYPE


def test_decode_error_carries_request_id():
    frames = tamper(propose_frames(), lambda h: h.pop("session"))
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.request_id == 11 and "session" in info.value.message


def test_encode_validates_before_sending():
    with pytest.raises(ProtocolError) as info:
        encode("reset", 1, {"session": "s"})
    assert info.value.code is ErrorCode.BAD_FIELD and info.value.request_id == 1
    with pytest.raises(ProtocolError) as info:
        encode("proposal", 1, {"draft_ms": 1.0}, {"hidden": torch.zeros(2, 2, 2)})
    assert info.value.code is ErrorCode.BAD_TENSOR


# --- one test per validation rule ------------------------------------------


def test_wrong_version():
    frames = tamper(propose_frames(), lambda h: h.update(v=PROTOCOL_VERSION + 1))
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code is ErrorCode.BAD_VERSION
    assert f"v={PROTOCOL_VERSION + 1}" in info.value.message
    assert f"v={PROTOCOL_VERSION}" in info.value.message


@pytest.mark.parametrize("version", [None, True, 1.0, "1"])
def test_version_must_be_the_int(version):
    frames = tamper(propose_frames(), lambda h: h.update(v=version))
    assert code_of(frames) is ErrorCode.BAD_VERSION


def test_version_checked_before_type():
    frames = tamper(propose_frames(), lambda h: h.update(v=PROTOCOL_VERSION + 1, type="future_msg"))
    assert code_of(frames) is ErrorCode.BAD_VERSION


def test_not_msgpack():
    assert code_of([b"\xc1\xc1"]) is ErrorCode.MALFORMED
    assert code_of([msgpack.packb({"v": 1}) + b"trailing"]) is ErrorCode.MALFORMED


def test_header_not_a_map():
    assert code_of([msgpack.packb([1, "ok", 2])]) is ErrorCode.MALFORMED


def test_no_frames():
    assert code_of([]) is ErrorCode.MALFORMED


def test_header_too_large():
    header = {
        "v": 1,
        "type": "ping",
        "id": 1,
        "tensors": [],
        "pad": "x" * MAX_HEADER_BYTES,
    }
    assert code_of([msgpack.packb(header)]) is ErrorCode.TOO_LARGE


def test_unknown_type():
    frames = tamper(encode("ping", 1), lambda h: h.update(type="teleport"))
    assert code_of(frames) is ErrorCode.UNKNOWN_TYPE


def test_missing_field():
    frames = tamper(propose_frames(), lambda h: h.pop("position"))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_wrong_field_type():
    frames = tamper(propose_frames(), lambda h: h.update(position="5"))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_bool_is_not_an_int():
    frames = tamper(propose_frames(), lambda h: h.update(start=True))
    assert code_of(frames) is ErrorCode.BAD_FIELD
    frames = tamper(encode("ping", 1), lambda h: h.update(id=True))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_negative_position():
    frames = tamper(
        encode("reset", 1, {"session": "s", "position": 0}),
        lambda h: h.update(position=-1),
    )
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code is ErrorCode.BAD_FIELD and "-1" in info.value.message


@pytest.mark.parametrize("bad, said", [(-1, "int -1"), (True, "bool True"), ("7", "str"), (2**31, "int 2147483648")])
def test_a_bad_item_of_a_long_list_is_named_by_its_index(bad, said):
    """Lists are checked in bulk, item paths built only for the error: the message still names
    the item, and a good list comes back as ints."""
    ids = list(range(65536))
    assert decode(encode("generate", 1, {"max_new_tokens": 1, "token_ids": ids}))["token_ids"] == ids
    ids[40000] = bad
    frames = tamper(encode("generate", 1, {"max_new_tokens": 1, "token_ids": [1]}), lambda h: h.update(token_ids=ids))
    with pytest.raises(ProtocolError, match=rf"generate.token_ids\[40000\]: expected .*got {said}") as info:
        decode(frames)
    assert info.value.code is ErrorCode.BAD_FIELD


def test_a_bad_value_deep_in_a_free_form_map_is_named_by_its_path():
    stats = {"a": [1, 2, {"b": [0, b"raw"]}]}
    frames = tamper(encode("stats_ok", 1, {"stats": {}}), lambda h: h.update(stats=stats))
    with pytest.raises(ProtocolError, match=r"stats_ok.stats.a\[2\].b\[1\]: expected None, bool") as info:
        decode(frames)
    assert info.value.code is ErrorCode.BAD_FIELD


def test_a_value_nested_as_deep_as_msgpack_allows_is_named_not_an_internal_error():
    """repr() overflowed at ~990 levels, msgpack allows 1024: the error path raised, and the
    peer got `internal` at id 0, which it could not match to its request."""
    pack = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    head = b"\x86" + pack("v") + pack(PROTOCOL_VERSION) + pack("type") + pack("generate") + pack("id") + pack(9)
    head += pack("tensors") + b"\x90" + pack("max_new_tokens") + pack(1) + pack("prompt") + b"\x91" * 1020 + b"\xc0"
    with pytest.raises(ProtocolError) as info:
        decode([head])
    assert info.value.code is ErrorCode.BAD_FIELD and info.value.request_id == 9, info.value
    assert "generate.prompt: expected str" in info.value.message


@pytest.mark.parametrize(
    "header, why",
    [
        (b"\x82\xa1v\x07\xa1v\x07", "appears twice"),  # {"v": 7, "v": 7}: msgpack kept the last
        (b"\x81\xc4\x01v\x07", "keys must be str"),  # a bin key passed strict_map_key
        (b"\x81\xa1v\xd4\x05\x00", "ext"),  # a one-byte fixext
        (b"\x81\xa1v\xc7\x00\x05", "ext types are forbidden"),  # a zero-length ext passed max_ext_len=0
    ],
)
def test_a_header_the_readme_forbids_is_malformed(header, why):
    with pytest.raises(ProtocolError, match=why) as info:
        decode([header])
    assert info.value.code is ErrorCode.MALFORMED


def test_free_form_maps_carry_finite_floats_only_and_figures_send_nan_as_nil():
    from protocol.stats import RequestStats

    for bad in (float("nan"), float("inf")):
        frames = tamper(encode("stats_ok", 1, {"stats": {}}), lambda h, bad=bad: h.update(stats={"tau": [bad]}))
        assert code_of(frames) is ErrorCode.BAD_FIELD
    figures = RequestStats(tau=float("nan"), governor={"cost": float("inf"), "widths": [1.0, float("nan")]})
    sent = decode(encode("stats_ok", 1, {"stats": figures.to_dict()}))["stats"]
    assert sent["tau"] is None and sent["governor"] == {"cost": None, "widths": [1.0, None]}
    assert RequestStats.from_dict(sent).tau == 0.0  # nil reads as not measured


def test_a_request_line_says_when_its_proposer_drafted_no_step_and_what_did():
    """A drafter away, or refusing the target's key, was reported "proposer dflash": the steps the
    context's lookup drafted hid that it gave nothing (an audit)."""
    from protocol.stats import RequestStats

    line = RequestStats(steps=9, proposer="dflash", sources={"lookup": 7}).line()
    assert line.endswith("proposer dflash (it drafted no step; steps drafted by lookup 7)"), line
    assert RequestStats(steps=9, proposer="dflash").line().endswith("proposer dflash (it drafted no step)")
    for drafted in ({"dflash": 3, "lookup": 2}, {"predraft": 1}):
        assert RequestStats(steps=9, proposer="dflash", sources=drafted).line().endswith("proposer dflash")
    assert RequestStats(steps=9, proposer="none").line().endswith("proposer none")
    assert RequestStats(steps=0, proposer="dflash").line().endswith("proposer dflash")  # nothing decoded yet


def test_done_names_one_of_the_finish_reasons():
    done = {"text": "", "token_ids": [], "stats": {}}
    for reason in ("eos", "length", "stop", "cancelled"):
        assert decode(encode("done", 1, {**done, "finish_reason": reason}))["finish_reason"] == reason
    frames = tamper(encode("done", 1, {**done, "finish_reason": "eos"}), lambda h: h.update(finish_reason="exploded"))
    assert code_of(frames) is ErrorCode.BAD_FIELD


@pytest.mark.parametrize("heartbeat_s", [0.01, 3600.5, 1e300])
def test_a_heartbeat_promise_is_none_or_within_bounds(heartbeat_s):
    generate = encode("generate", 1, {"max_new_tokens": 1, "prompt": "x"})
    frames = tamper(generate, lambda h: h.update(heartbeat_s=heartbeat_s))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def open_frames():
    return encode("open", 1, {"session": "s"}, {"mask": torch.randn(1, HIDDEN)})


def test_unexpected_extra_field():
    frames = tamper(open_frames(), lambda h: h.update(colour="red"))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_nested_struct_is_closed():
    fields, _ = SAMPLES["hello"]
    frames = tamper(encode("hello", 1, fields), lambda h: h["target"].update(extra=1))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_unknown_wire_dtype_in_negotiation():
    fields, _ = SAMPLES["hello"]
    frames = tamper(encode("hello", 1, fields), lambda h: h.update(wire_dtypes=["float8"]))
    assert code_of(frames) is ErrorCode.BAD_FIELD


@pytest.mark.parametrize("session", ["", "x" * 129, 7, None])
def test_bad_session_id(session):
    frames = tamper(open_frames(), lambda h: h.update(session=session))
    assert code_of(frames) is ErrorCode.BAD_FIELD


@pytest.mark.parametrize("rid", [-1, 2**63, "1"])
def test_bad_request_id(rid):
    frames = tamper(encode("ping", 1), lambda h: h.update(id=rid))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_features_must_end_at_or_before_position():
    frames = tamper(propose_frames(rows=2), lambda h: h.update(start=4))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_unknown_dtype():
    def edit(h):
        h["tensors"][0]["dtype"] = "float64"

    assert code_of(tamper(propose_frames(), edit)) is ErrorCode.BAD_TENSOR


def test_nbytes_disagrees_with_shape():
    def edit(h):
        h["tensors"][0]["shape"] = [3, WIDTH]  # frame and nbytes are for 2 rows

    assert code_of(tamper(propose_frames(), edit)) is ErrorCode.BAD_TENSOR


def test_frame_length_disagrees_with_nbytes():
    frames = propose_frames()
    frames[1] = bytes(frames[1])[:-4]
    assert code_of(frames) is ErrorCode.BAD_TENSOR


def test_missing_tensor_frame():
    assert code_of(propose_frames()[:-1]) is ErrorCode.BAD_TENSOR


def test_extra_frame():
    assert code_of([*propose_frames(), b"\x00" * 8]) is ErrorCode.BAD_TENSOR


def test_wrong_tensor_name_and_rank():
    def rename(h):
        h["tensors"][1]["name"] = "noyse"

    def flatten(h):
        h["tensors"][1]["shape"] = [BLOCK * HIDDEN]

    assert code_of(tamper(propose_frames(), rename)) is ErrorCode.BAD_TENSOR
    assert code_of(tamper(propose_frames(), flatten)) is ErrorCode.BAD_TENSOR


def test_frame_too_large():
    assert code_of(propose_frames(), max_frame_bytes=64) is ErrorCode.TOO_LARGE


def test_too_many_tensors():
    frames = [msgpack.packb({"v": PROTOCOL_VERSION, "type": "ping", "id": 1, "tensors": []})]
    assert code_of(frames + [b"\x00" * 4] * 9) is ErrorCode.TOO_LARGE


def test_fuzzed_headers_only_raise_protocol_error():
    rng = random.Random(0)
    good = bytes(propose_frames()[0])
    rest = propose_frames()[1:]
    for _ in range(300):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            decode([bytes(bad), *rest])
        except ProtocolError as exc:
            assert exc.code is not ErrorCode.INTERNAL, exc


# --- a real socket pair ----------------------------------------------------


def test_dealer_router_zero_copy_round_trip():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        features = torch.randn(300, WIDTH)  # > zmq's copy threshold
        noise = torch.randn(BLOCK, HIDDEN)
        dealer.send_multipart(
            encode(
                "propose",
                5,
                {"session": "s", "start": 0, "position": 300},
                {"features": features, "noise": noise},
            ),
            copy=False,
        )
        identity, *frames = router.recv_multipart(copy=False)
        request = decode(frames)
        assert torch.equal(bits(request.tensor("features")), bits(features))
        hidden = request.tensor("noise") * 2
        reply = encode("proposal", request.id, {"draft_ms": 0.5}, {"hidden": hidden})
        router.send_multipart([identity, *reply], copy=False)
        answer = decode(dealer.recv_multipart(copy=False)).expect("proposal")
        assert answer.id == 5 and torch.equal(answer.tensor("hidden"), noise * 2)
    finally:
        dealer.close()
        router.close()
        ctx.term()


@pytest.mark.parametrize(
    "given",
    [{}, {"prompt": "a", "token_ids": [1]}, {"messages": [{"role": "user", "content": "x"}], "prompt": "b"}],
)
def test_generate_needs_exactly_one_prompt_form(given):
    frames = tamper(
        encode("generate", 1, {"max_new_tokens": 4, "prompt": "p"}), lambda h: (h.pop("prompt"), h.update(given))
    )
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_generate_stream_must_be_a_bool():
    frames = tamper(encode("generate", 1, {"max_new_tokens": 4, "prompt": "p"}), lambda h: h.update(stream=1))
    assert code_of(frames) is ErrorCode.BAD_FIELD


def test_generate_sampling_is_typed_where_it_is_read():
    """`sampling` was a free-form map: 917 KB of nested empty maps decoded to 64 MB that a queued
    request kept, counted as a kilobyte. Now only its four options pass, each of its type."""
    ask = encode("generate", 1, {"max_new_tokens": 4, "prompt": "p"})
    junk = tamper(ask, lambda h: h.update(sampling={k: [{}] * 131071 for k in "abcdefg"}))
    assert len(junk[0]) < MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match="unexpected field") as info:
        decode(junk)
    assert info.value.code is ErrorCode.BAD_FIELD
    for bad in ({"temperature": [{}] * 1000}, {"top_k": 2.5}, {"seed": "7"}, {"top_p": {"a": 1}}):
        assert code_of(tamper(ask, lambda h, bad=bad: h.update(sampling=bad))) is ErrorCode.BAD_FIELD, bad
    given = decode(tamper(ask, lambda h: h.update(sampling={"temperature": 1, "seed": 9})))
    assert given["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 9}
    assert decode(ask)["sampling"] == SamplingParams().to_dict()


def test_a_server_answers_pings_while_its_caller_computes(tmp_path):
    """While a daemon's step computes, the server's helper answers pings, holds other requests for
    next() in order, sends replies at once, and reports replies it could not deliver."""
    address = f"ipc://{tmp_path}/answering.sock"
    server = Server(address)
    asker, pinger, leaver = Client(address), Client(address), Client(address)
    try:
        asker.send("stats")
        leaver.send("stats")
        assert {server.next(2000)[0] for _ in range(2)} == {asker.routing_id, leaver.routing_id}
        asker_id, leaver_id = asker.routing_id, leaver.routing_id
        leaver.close()
        time.sleep(0.2)  # the connection's end reaches the server
        pong = lambda identity, m: encode("pong", m.id, {"time": 0.0, "sessions": 7, "pid": 1})  # noqa: E731
        with server.answering({"ping": pong}):
            answer = pinger.call("ping", timeout_s=2.0)  # answered mid-step: the step lasts the block
            assert answer is not None and answer["sessions"] == 7, answer
            late = asker.send("stats")  # held for next()
            assert server.send(asker_id, encode("stats_ok", 1, {"stats": {"n": 1}}))
            reply = asker.wait(1, "stats", 2.0)  # out before the step ends
            assert reply is not None and reply["stats"] == {"n": 1}
            assert server.send(leaver_id, encode("stats_ok", 1, {"stats": {}}))  # reported later
            with pytest.raises(RuntimeError):
                server.next()
            time.sleep(0.2)  # the held request arrives meanwhile
        assert server.undelivered() == [leaver_id]
        assert server.undelivered() == []
        identity, held = server.next(0)
        assert identity == asker_id and held.type == "stats" and held.id == late
        assert server.next(0) is None
    finally:
        for client in (asker, pinger, leaver):
            client.close()
        server.close()


def test_a_helper_that_fails_mid_step_gives_the_socket_back_with_its_error_and_the_next_step_answers(tmp_path):
    """The step's end waited for the helper to give the socket back: a helper that died (an answer
    that raised) left the daemon waiting for good (an audit). Its error ends the step instead, and
    the next step's helper answers pings again."""
    address = f"ipc://{tmp_path}/failing.sock"
    server = Server(address)
    pinger = Client(address)

    def broken(identity, message):
        raise KeyError("a bug in an answer")

    pong = lambda identity, m: encode("pong", m.id, {"time": 0.0, "sessions": 1, "pid": 1})  # noqa: E731
    ended: list[BaseException] = []

    def step() -> None:
        for _ in range(3):  # back to back: each lend a helper of its own (the wake address was not free yet)
            try:
                with server.answering({"ping": broken}):
                    pinger.send("ping")
                    time.sleep(0.3)  # the helper takes the ping and fails on it
            except RuntimeError as exc:
                ended.append(exc)

    try:
        stepping = threading.Thread(target=step, daemon=True)
        stepping.start()
        stepping.join(30)
        assert not stepping.is_alive(), "the step's end waits for a helper that died"
        assert len(ended) == 3 and all("a bug in an answer" in str(exc) for exc in ended), ended
        with server.answering({"ping": pong}):  # at once: a new helper, on a wake address of its own
            answer = pinger.call("ping", timeout_s=2.0)
        assert answer is not None and answer["sessions"] == 1
    finally:
        pinger.close()
        server.close()


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_an_ipv6_loopback_address_serves_without_further_flags():
    """`tcp://[::1]:PORT` counts as loopback (plaintext allowed), so it must also work: ZeroMQ
    sockets refuse it ("No such device") unless told to speak IPv6."""
    import socket

    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://[::1]:{port}"
    server = Server(address)
    client = Client(address)
    try:
        client.send("stats")
        identity, message = server.next(5000)
        assert message.type == "stats"
        assert server.send(identity, encode("stats_ok", message.id, {"stats": {"n": 6}}))
        reply = client.wait(message.id, "stats", 5.0)
        assert reply is not None and reply["stats"] == {"n": 6}
    finally:
        client.close()
        server.close()


def test_an_optional_tensor_may_be_left_out_but_no_stranger_comes_in():
    """A dflash proposal carries no `gate`; an unknown tensor is still refused by name."""
    bare = decode(encode("proposal", 1, {"draft_ms": 0.5}, {"hidden": torch.randn(2, HIDDEN)}))
    assert set(bare.tensors) == {"hidden"}
    with pytest.raises(ProtocolError, match=r"expected tensors \['hidden'\] \(and optionally \['gate'\]\)"):
        encode("proposal", 1, {"draft_ms": 0.5}, {"hidden": torch.randn(2, HIDDEN), "logits": torch.randn(2, 3)})


def test_thirty_thousand_lends_with_replies_leave_no_wake_behind(tmp_path):
    """Each lend whose replies went out before the helper looked used to leave wake bytes in the
    inproc pipe; ~2,000 of them filled it and the next reply raised zmq.Again, which took the
    target daemon down (a few thousand refused requests did it)."""
    address = f"ipc://{tmp_path}/wakes.sock"
    server = Server(address)
    client = Client(address)
    try:
        client.send("stats")
        identity, _ = server.next(2000)
        reply = encode("stats_ok", 1, {"stats": {}})
        for _ in range(30_000):
            with server.answering({}):
                for _ in range(3):
                    assert server.send(identity, reply)  # the client reads none: most are undelivered
        assert server.undelivered()  # reported, not raised
        pong = lambda identity, m: encode("pong", m.id, {"time": 0.0, "sessions": 0, "pid": 1})  # noqa: E731
        pinger = Client(address)
        with server.answering({"ping": pong}):
            assert pinger.call("ping", timeout_s=2.0) is not None
        pinger.close()
    finally:
        client.close()
        server.close()


def test_a_peer_that_stops_reading_has_at_most_the_send_queue_held_for_it(tmp_path):
    """The draft daemon's replies are up to megabytes, one per request: ZeroMQ's default queue of
    1000 a peer let a peer that read nothing pin 1.1 GB of pre-drafts (an audit). Past the queue a
    reply is refused (dropped by the daemon), the peer's own timeout takes over, and once it reads
    again it gets what was held and replies flow again."""
    from draft_node.daemon import SEND_QUEUE

    address = f"ipc://{tmp_path}/queue.sock"
    server = Server(address, send_queue=SEND_QUEUE)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)  # its own queue holds no more than one: what piles up is the server's
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(address)
    try:
        peer.send_multipart(encode("ping", 1, {}))
        identity, _ = server.next(5000)
        reply = encode("pong", 1, {"time": 0.0, "sessions": 0, "pid": 1}) + [b"x" * (256 << 10)]
        held = 0
        while held < 3000 and server.send(identity, reply):
            held += 1
        assert held == SEND_QUEUE < 100
        got = 0
        while peer.poll(1000):
            peer.recv_multipart()
            got += 1
        assert got == held and server.send(identity, reply)
    finally:
        peer.close(0)
        server.close()


def test_a_connection_has_at_most_the_receive_queue_read_ahead_and_loses_nothing(tmp_path):
    """What ZeroMQ reads ahead of the server from one connection: at its default of 1000 a draft
    daemon held 1000 x 22 MiB for a target that sent faster than it drafted (an audit). Past the
    receive queue the peer waits (its sends refused here, where it would block), and every message
    it sent arrives once the server reads."""
    address = f"ipc://{tmp_path}/receive.sock"
    server = Server(address, receive_queue=8)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.SNDHWM, 1)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(address)
    frames = encode("ping", 1, {}) + [b"x" * (1 << 20)]  # 1 MiB each: socket buffers hold about one
    try:
        sent = send_until_refused(peer, frames, most=200)
        assert 1 <= sent <= 8 + 6, sent  # the queue, the peer's one, and what socket buffers hold
        got = 0
        while server.next(1000) is not None:
            got += 1
        assert got == sent
    finally:
        peer.close(0)
        server.close()


def test_a_flood_during_a_step_is_held_within_bounds_and_every_peers_word_is_noted(tmp_path):
    """What the helper takes in during a step: pings answered and heartbeats absorbed without
    counting against what it holds; at most HELD_PER_PEER of one peer's other messages held, the
    rest answered busy at once; and each peer stamped heard when its message arrived, so a
    heartbeating client behind a flooder is not taken for silent."""
    address = f"ipc://{tmp_path}/flood.sock"
    server = Server(address)
    flooder, beater, pinger = Client(address), Client(address), Client(address)
    try:
        pong = lambda identity, m: encode("pong", m.id, {"time": 0.0, "sessions": 0, "pid": 1})  # noqa: E731
        # The flood waits in ZeroMQ's queues before the step begins, so the helper takes ~0.3 s to
        # read it however slowly this thread sent it (sent during the step, a slow sender's flood
        # was read as it came, before the ping: a review).
        for i in range(1, 1501):  # a peer that reads nothing takes ~2,000 replies before ZeroMQ refuses more
            flooder.send("ping", request_id=i)
        for i in range(3001, 3001 + HELD_PER_PEER + 20):
            flooder.send("stats", request_id=i)
        with server.answering({"ping": pong, "heartbeat": lambda identity, m: None}):
            answer = pinger.call("ping", timeout_s=2.0)
            answered = time.monotonic()
            assert answer is not None
            for _ in range(5):
                last_beat = time.monotonic()
                beater.send("heartbeat")
                time.sleep(0.05)
            beaten = time.monotonic()
            time.sleep(1.0)  # the rest of the flood is read, at READ_RATE
        pongs = busy = 0
        while flooder.sock.poll(1000):
            reply = decode(flooder.sock.recv_multipart())
            if reply.type == "pong":
                pongs += 1
            else:
                assert reply["code"] == "busy" and reply.id > 3000, reply
                busy += 1
        assert (pongs, busy) == (1500, 20)
        heard = server.heard()
        assert set(heard) == {flooder.routing_id, beater.routing_id, pinger.routing_id}
        # Ahead of the flood, not behind it: the flood was still being read once the ping was
        # answered (an order, not a speed, so a slow machine passes as a fast one does).
        assert heard[flooder.routing_id] > answered
        # The last beat, stamped as it arrived: not an earlier one, not when the step ended (1 s on).
        assert last_beat <= heard[beater.routing_id] < beaten + 0.5
        held = []
        while (taken := server.next(0)) is not None:
            held.append(taken)
        assert [m.id for _, m in held] == list(range(3001, 3001 + HELD_PER_PEER))
        assert server.heard() == {}  # what next() reads outside a step is its caller's to note
    finally:
        for client in (flooder, beater, pinger):
            client.close()
        server.close()


def test_the_helper_hands_the_socket_back_when_the_step_ends_however_many_messages_wait(tmp_path):
    """Reading a message costs tens of ms where it is a 64K-id prompt, and the helper used to read
    on through what the intake allowed (hundreds) after the step had ended, while the daemon waited
    for its socket: a flood of such prompts stalled every request 16 s a step (an audit). Now it
    asks after each message whether the lend goes on."""
    address = f"ipc://{tmp_path}/lend.sock"
    server = Server(address)
    flooder = Client(address)
    began_after_the_lend = []
    real_take = server._take

    def slow_take():
        began_after_the_lend.append(not server.lending)
        time.sleep(0.02)  # what checking a large prompt costs
        return real_take()

    server._take = slow_take
    try:
        with server.answering({}):
            for i in range(1, 201):
                flooder.send("stats", request_id=i)
            deadline = time.monotonic() + 10
            while not began_after_the_lend and time.monotonic() < deadline:
                time.sleep(0.01)
        assert began_after_the_lend and not any(began_after_the_lend), sum(began_after_the_lend)
        assert len(began_after_the_lend) < 200  # the rest wait in ZeroMQ's queue for next()
    finally:
        flooder.close()
        server.close()


FITTING = {**DRAFTER, "target_layer_ids": [0, 1, 2], "mask_token_id": 3, "format": "dflash2", "selector": SELECTOR}
TARGET = {"hidden_size": HIDDEN, "num_hidden_layers": 3, "vocab_size": 99}


@pytest.mark.parametrize(
    "change, why",
    [
        ({"block_size": 2**40}, "block size"),
        ({"block_size": 1}, "block size"),
        ({"ring_capacity": 2**40}, "ring capacity"),
        ({"draft_vocab": [4, 8, 4]}, "more than once"),
        ({"selector": {**SELECTOR, "top_k": 1000}}, "top_k"),
        ({"selector": {**SELECTOR, "rank": 1 << 20}}, "rank"),
        ({"selector": {**SELECTOR, "output_multiplier": 1e30}}, "multiplier"),
        ({"selector": {**SELECTOR, "output_multiplier": 0.0}}, "multiplier"),
    ],
)
def test_a_drafter_that_would_cost_the_target_unbounded_memory_or_time_does_not_fit(change, why):
    """What a draft daemon says of its drafter sizes the target's tensors: a block of 2**40 or a
    selector top-k of the whole vocabulary failed every request's step, a ring of 2**40 positions
    every request's start; a vocabulary listing a token twice skewed sampled output. Each is now a
    misfit, which the target refuses at the handshake (and drafts without)."""
    assert fit_problems(FITTING, TARGET) == []
    problems = fit_problems({**FITTING, **change}, TARGET)
    assert len(problems) == 1 and why in problems[0], problems


def test_a_second_server_on_a_live_ipc_path_is_refused_and_a_stale_one_is_taken(tmp_path):
    """ZeroMQ binds over an ipc path another process listens on: the first daemon lived on,
    unreachable, and the second took its clients (an audit). A file nobody listens on any more
    (a daemon that died) is bound over as before."""
    from protocol.transport import BindError

    address = f"ipc://{tmp_path}/taken.sock"
    first = Server(address)
    try:
        with pytest.raises(BindError, match="something listens there"):
            Server(address)
    finally:
        first.close()
    with socket.socket(socket.AF_UNIX) as gone:  # a socket file left behind: nobody listens there
        gone.bind(str(tmp_path / "stale.sock"))
    Server(f"ipc://{tmp_path}/stale.sock").close()


@pytest.mark.parametrize("kind", ["file", "folder", "link"])
def test_an_ipc_path_that_names_no_socket_is_refused_and_left_as_it_was(tmp_path, kind):
    """ZeroMQ unlinks whatever an ipc path names before it binds: `--bind ipc://notes.txt`
    deleted the notes, even when the daemon then failed to start (an audit)."""
    from protocol.transport import BindError

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    path = {"file": notes, "folder": tmp_path / "sub", "link": tmp_path / "link"}[kind]
    if kind == "folder":
        path.mkdir()
    if kind == "link":
        path.symlink_to(notes)
    with pytest.raises(BindError, match=f"is a {kind}, not a socket"):
        Server(f"ipc://{path}")
    assert notes.read_text() == "mine" and path.exists() and path.is_symlink() == (kind == "link")


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:*", "ipc://*"])
def test_a_server_bound_where_zeromq_chooses_names_the_address_it_chose(address, tmp_path, monkeypatch):
    """A daemon bound on a wildcard port logged "serving on tcp://127.0.0.1:*", and nothing
    said where a client could reach it (an audit)."""
    monkeypatch.chdir(tmp_path)  # ipc://* makes its socket under the working directory
    server = Server(address)
    try:
        assert "*" not in server.address and server.address.split("://")[0] == address.split("://")[0]
        client = Client(server.address)
        try:
            client.send("ping")
            request = server.next(5000)
            assert request is not None and request[1].type == "ping"
        finally:
            client.close()
    finally:
        server.close()


def test_a_server_closed_and_bound_again_at_once_on_its_ipc_path_is_not_refused(tmp_path):
    """ZeroMQ closes a listener asynchronously: the in-use probe refused half of the immediate
    rebinds in one process (a review). A server's own context is termed at close, and the probe
    gives a listener that just closed a moment."""
    address = f"ipc://{tmp_path}/again.sock"
    for _ in range(20):
        Server(address).close()


def test_a_closed_server_removes_its_ipc_file_and_only_its_own(tmp_path):
    """ZeroMQ leaves an ipc socket's file behind: stopped daemons piled them up (an audit). A
    server removes the file it bound, not one another server has bound at the path since."""
    path = tmp_path / "own.sock"
    Server(f"ipc://{path}").close()
    assert not path.exists()
    first = Server(f"ipc://{path}")
    path.unlink()  # someone cleared the path, and another daemon bound it
    second = Server(f"ipc://{path}")
    first.close()
    assert path.is_socket()
    second.close()
    assert not path.exists()


def test_a_wait_past_its_deadline_still_reads_the_replies_already_here(tmp_path):
    """A pre-draft's wait counts from its send, so after a long verify it begins past its deadline;
    its reply, queued behind a stale one, was given up on and the healthy daemon dropped (a review)."""
    address = f"ipc://{tmp_path}/late.sock"
    server, client = Server(address), Client(address)
    try:
        stale, wanted = client.send("stats"), client.send("stats")
        for _ in range(2):
            identity, msg = server.next(2000)
            assert server.send(identity, encode("stats_ok", msg.id, {"stats": {"id": msg.id}}))
        deadline = time.monotonic() + 2
        while client.sock.poll(0) == 0 and time.monotonic() < deadline:  # both replies here
            time.sleep(0.01)
        time.sleep(0.1)
        reply = client.wait(wanted, "stats", timeout_s=-1.0)  # the deadline long past
        assert reply is not None and reply["stats"] == {"id": wanted} and stale != wanted
        assert client.wait(client.send("stats"), "stats", timeout_s=-1.0) is None  # nothing here: no wait
    finally:
        client.close()
        server.close()


def test_only_the_refusal_of_an_enveloped_message_goes_out_in_an_envelope(tmp_path):
    """A peer that sent one message in a REQ envelope had its next reply, whichever it was, sent
    with the delimiter: a DEALER's pong arrived as [b"", pong] and its client missed it (a review)."""
    from protocol.errors import ErrorCode
    from protocol.transport import REQ_REFUSED

    address = f"ipc://{tmp_path}/envelope.sock"
    server = Server(address)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(address)
    try:
        peer.send_multipart([b"", *encode("ping", 1, {})])
        peer.send_multipart(encode("ping", 2, {}))
        (who, refused), (_, ping) = server.next(2000), server.next(2000)
        assert isinstance(refused, ProtocolError) and ping.type == "ping"
        assert server.send(who, encode("pong", 2, {"time": 0.0, "sessions": 0, "pid": 1}))  # answered first
        assert server.send(who, encode_error(refused.request_id, ErrorCode.MALFORMED, REQ_REFUSED))
        assert peer.poll(2000)
        pong = peer.recv_multipart()
        assert decode(pong).type == "pong"
        assert peer.poll(2000)
        delimiter, *error = peer.recv_multipart()
        assert delimiter == b"" and decode(error)["code"] == "malformed" and not server.enveloped
    finally:
        peer.close(0)
        server.close()


@pytest.mark.parametrize("wait_s", [1e9, float("inf")])
def test_a_wait_of_weeks_or_forever_waits_instead_of_overflowing(tmp_path, wait_s):
    """ZeroMQ polls take milliseconds as a C int: a --daemon-timeout of 1e9 s made every request of
    dflash-serve a bare 500 (OverflowError), as did a --draft-timeout of inf (an audit)."""
    import threading

    from protocol.transport import request

    address = f"ipc://{tmp_path}/d.sock"
    server = Server(address)

    def answer() -> None:
        got = server.next(5000)
        assert got is not None
        server.send(got[0], encode("pong", got[1].id, {"time": 0.0, "sessions": 0, "pid": 1}))

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        reply = request(address, "ping", timeout_s=wait_s)
    finally:
        thread.join()
        server.close()
    assert reply is not None and reply.type == "pong"


def test_a_launcher_waits_for_its_own_daemons_answer_not_another_at_the_address(tmp_path):
    """Two dflash-local runs given one address crossed: the second's daemon could not bind, and its
    launcher took the first run's answer for its own, so its client was answered by the other's
    model (an audit). A launcher names the process it started: another's answer does not count."""
    from protocol.transport import wait_ready

    address = f"ipc://{tmp_path}/crossed.sock"
    server = Server(address)
    pong = lambda identity, m: encode("pong", m.id, {"time": 0.0, "sessions": 0, "pid": 4242})  # noqa: E731
    try:
        with server.answering({"ping": pong}):
            assert wait_ready(address, 2.0) and wait_ready(address, 2.0, pid=4242)
            started = time.monotonic()
            assert not wait_ready(address, 30.0, alive=lambda: time.monotonic() < started + 1.5, pid=os.getpid())
    finally:
        server.close()


def test_a_closed_connection_is_logged_at_info_only_where_it_may_have_cut_a_message(tmp_path, caplog):
    """Every ping and client run ends by closing its connection: each was an INFO line that a frame
    over the limit may have been dropped (three on every demo run). A peer that leaves answered is a
    DEBUG line now; one whose first frame is over the limit is still an INFO line (after an answered
    message, ZeroMQ cannot tell it from a leave). A flood of peers coming and going leaves no entry."""
    caplog.set_level(logging.DEBUG, logger="transport")
    address = f"ipc://{tmp_path}/closing.sock"
    server = Server(address, max_message_bytes=1 << 16)
    try:
        for _ in range(200):
            client = Client(address)
            sent = client.send("stats")
            identity, message = server.next(2000)
            assert message.id == sent
            assert server.send(identity, encode("stats_ok", sent, {"stats": {}}))
            assert client.wait(sent, "stats", 2.0) is not None
            client.close()
        assert wait_until(lambda: server.next(0) is None and not server.connections, 5)
        assert not server.connection_of
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "transport"]
        assert any(level == logging.DEBUG and "a peer left" in text for level, text in lines)
        assert not [text for level, text in lines if level >= logging.INFO], lines
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.connect(address)
        big.send(b"\x80" * (1 << 17))
        cut = lambda: any("over this socket's limit" in r.getMessage() for r in caplog.records)  # noqa: E731
        assert wait_until(lambda: server.next(0) is None and cut(), 5)
        assert [r.levelno for r in caplog.records if "over this socket's limit" in r.getMessage()] == [logging.INFO]
        big.close(0)
    finally:
        server.close()


def test_an_inproc_server_reads_its_messages():
    """ZeroMQ gives an inproc message no source descriptor: reading it for the closed-connection log
    raised EINVAL, and an inproc server failed every message it received (a review)."""
    context = zmq.Context()
    server = Server("inproc://reads", context=context)
    client = Client("inproc://reads", context)
    try:
        sent = client.send("stats")
        identity, message = server.next(2000)
        assert message.id == sent and not server.connections
        assert server.send(identity, encode("stats_ok", sent, {"stats": {}}))
        assert client.wait(sent, "stats", 2.0).type == "stats_ok"
    finally:
        client.close()
        server.close()
