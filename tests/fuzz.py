"""A seeded message fuzzer for the daemons: the classes of bad input a peer can send.

Each case is built from a valid request (a template the daemon would serve) and broken one
way: random bytes, truncated or garbled msgpack, a mutated schema (missing, extra or
retyped fields, extreme values), broken tensor specs and frames, NaN/Inf in tensors, huge
positions, bad sampling values. `expect` says what the daemon must answer: the codec's own
verdict on the frames (the same checks run on both sides), or, for a message that decodes,
anything typed but `internal`.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import msgpack
import zmq

from protocol import MAX_HEADER_BYTES, ProtocolError, decode, encode

# Values no field accepts everywhere: wrong types, out of range, oversized, nested.
WEIRD = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64 - 1,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    1e-300,
    "",
    "x" * 300,
    "\u0000\ud7ff\U0010ffff",
    b"\x00\xff",
    [],
    [1] * 2000,
    [[[[[[[[[[1]]]]]]]]]],
    {},
    {"a": 1},
    {"": None},
]
HUGE_POSITIONS = [2**31, 2**40, 2**62, 2**63 - 8, 2**63 - 1]
# Sampling options the daemon must refuse (bad_field), and valid extremes it must serve (done):
# one list of both took either answer for each, and a daemon that clamped instead of refusing
# passed (a review of the tests).
REFUSED_SAMPLING = [
    {"temperature": -1.0},
    {"temperature": 1e300},
    {"temperature": "hot"},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_p": -1e-9},
    {"top_k": -1},
    {"top_k": 2.5},
    {"seed": -1},
    {"seed": 2**63},
    {"seed": "abc"},
    {"temp": 1.0},
]
EXTREME_SAMPLING = [
    {"temperature": 1e-300},
    {"top_k": 2**62},
    {"seed": 2**63 - 1},
    {"temperature": 0.7, "top_p": 1e-300, "top_k": 1, "seed": 0},
]


@dataclass
class Template:
    type: str
    fields: dict
    tensors: dict  # name -> tensor


@dataclass
class Case:
    kind: str
    frames: list  # what goes on the wire (bytes or memoryviews)


class Fuzzer:
    """Cases from `templates`, reproducible from `seed`."""

    def __init__(self, templates: list[Template], seed: int, extra_kinds: tuple[str, ...] = ()) -> None:
        self.templates = templates
        self.rng = random.Random(seed)
        self.kinds = ["random_bytes", "random_frames", "truncated", "garbled", "mutated", *extra_kinds]
        if any(t.tensors for t in templates):
            self.kinds.append("tensor")
        self.next_id = 1000

    def case(self) -> Case:
        kind = self.rng.choice(self.kinds)
        return Case(kind, getattr(self, kind)())

    def valid(self, template: Template | None = None) -> tuple[dict, list]:
        """A valid message as (header dict, tensor frames), with a fresh id."""
        t = template or self.rng.choice(self.templates)
        self.next_id += 1
        frames = encode(t.type, self.next_id, t.fields, t.tensors)
        return msgpack.unpackb(frames[0], raw=False), [bytes(f) for f in frames[1:]]

    def pack(self, header: dict, tensors: list) -> list:
        return [msgpack.packb(header, use_bin_type=True), *tensors]

    def random_bytes(self) -> list:
        return [self.rng.randbytes(self.rng.randint(0, 300))]

    def random_frames(self) -> list:
        header, _ = self.valid()
        head = [self.pack(header, [])[0]] if self.rng.random() < 0.5 else [self.rng.randbytes(20)]
        return head + [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(self.rng.randint(1, 10))]

    def truncated(self) -> list:
        frames = self.pack(*self.valid())
        head = frames[0]
        return [head[: self.rng.randint(0, len(head) - 1)], *frames[1:]]

    def garbled(self) -> list:
        frames = self.pack(*self.valid())
        head = bytearray(frames[0])
        for _ in range(self.rng.randint(1, 4)):
            head[self.rng.randrange(len(head))] = self.rng.randrange(256)
        return [bytes(head), *frames[1:]]

    def mutated(self) -> list:
        header, tensors = self.valid()
        target, key = self._pick(header)
        op = self.rng.random()
        if op < 0.2 and isinstance(target, dict):
            target.pop(key, None)
        elif op < 0.35 and isinstance(target, dict):
            target[self.rng.choice(["extra", "v2", "tensors_", "Session"])] = self.rng.choice(WEIRD)
        else:
            target[key] = self.rng.choice(WEIRD)
        return self.pack(header, tensors)

    def _pick(self, header: dict) -> tuple[dict | list, object]:
        """A container in the header and a key (or index) in it, top level or nested."""
        target, key = header, self.rng.choice(list(header))
        while isinstance(target[key], (dict, list)) and target[key] and self.rng.random() < 0.6:
            target = target[key]
            key = self.rng.choice(list(target)) if isinstance(target, dict) else self.rng.randrange(len(target))
        return target, key

    def tensor(self) -> list:
        with_tensors = [t for t in self.templates if t.tensors]
        header, tensors = self.valid(self.rng.choice(with_tensors))
        spec = self.rng.choice(header["tensors"])
        op = self.rng.randrange(8)
        if op == 0:
            spec["dtype"] = self.rng.choice(["float64", "int8", "uint8", "complex64", "", 5])
        elif op == 1:
            spec["shape"] = self.rng.choice([[-1, 4], [2**31, 2**31], [1] * 5, [], "4x4", [1.5]])
        elif op == 2:
            spec["nbytes"] = self.rng.choice([0, spec["nbytes"] + 1, 2**40, -4, 2**63])
        elif op == 3:
            tensors[0] = tensors[0][: max(0, len(tensors[0]) - self.rng.randint(1, 8))]
        elif op == 4:
            tensors.append(b"\x00" * 16)
        elif op == 5:
            header["tensors"] = header["tensors"][:-1]
            tensors = tensors[:-1]
        elif op == 6:
            spec["name"] = self.rng.choice(["", "x" * 100, "other", 7])
        else:
            shape = [2**20, 1] if self.rng.random() < 0.5 else [64, 4096]  # declared big, frame small
            spec.update(shape=shape, nbytes=math.prod(shape) * 4)
        return self.pack(header, tensors)

    # --- classes that need a template of a given type ---------------------------------------

    def of_type(self, type_: str) -> Template:
        return self.rng.choice([t for t in self.templates if t.type == type_])

    def nonfinite(self) -> list:
        t = self.of_type(self.rng.choice(["propose", "open"]))
        name = self.rng.choice(list(t.tensors))
        tensor = t.tensors[name].clone()
        tensor.view(-1)[self.rng.randrange(tensor.numel())] = self.rng.choice([math.nan, math.inf, -math.inf])
        return self.pack(*self.valid(Template(t.type, t.fields, {**t.tensors, name: tensor})))

    def huge_position(self) -> list:
        header, tensors = self.valid(self.of_type(self.rng.choice(["propose", "reset"])))
        field = self.rng.choice(["position", "start"]) if header["type"] == "propose" else "position"
        header[field] = self.rng.choice(HUGE_POSITIONS)
        return self.pack(header, tensors)

    def bad_sampling(self) -> list:
        """A generate whose sampling options are refused."""
        header, tensors = self.valid(self.of_type("generate"))
        header["sampling"] = dict(self.rng.choice(REFUSED_SAMPLING))
        return self.pack(header, tensors)

    def extreme_sampling(self) -> list:
        """A generate of token ids (which need no tokenizer) whose sampling options are valid, at
        their extremes."""
        plain = [
            t for t in self.templates if t.type == "generate" and "token_ids" in t.fields and not t.fields.get("stop")
        ]
        header, tensors = self.valid(self.rng.choice(plain))
        header["sampling"] = dict(self.rng.choice(EXTREME_SAMPLING))
        return self.pack(header, tensors)


def expected(frames: list, max_frame_bytes: int = MAX_HEADER_BYTES):
    """What the codec makes of `frames`: its ProtocolError, or the decoded Message."""
    try:
        return decode(frames, max_frame_bytes=max_frame_bytes)
    except ProtocolError as exc:
        return exc


def run(sock: zmq.Socket, fuzzer: Fuzzer, seconds: float, silent: tuple[str, ...] = ()) -> dict:
    """Send cases one at a time for `seconds`; check every answer. Returns counts per kind
    and per reply code. `silent`: message types that get no reply (one-way notices)."""
    counts: dict = {"cases": 0, "kinds": {}, "codes": {}}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        case = fuzzer.case()
        verdict = expected(case.frames)
        sock.send_multipart(case.frames)
        counts["cases"] += 1
        counts["kinds"][case.kind] = counts["kinds"].get(case.kind, 0) + 1
        if not isinstance(verdict, ProtocolError) and verdict.type in silent:
            continue
        reply = _answer(sock, verdict, case)
        code = reply["code"] if reply.type == "error" else reply.type
        counts["codes"][code] = counts["codes"].get(code, 0) + 1
        assert code != "internal", (case.kind, case.frames[0][:200], reply.fields)
        if isinstance(verdict, ProtocolError):
            assert reply.type == "error" and code == verdict.code.value, (case.kind, verdict, reply.fields)
            assert reply.id == (verdict.request_id or 0)
        elif case.kind == "nonfinite":
            assert code == "bad_tensor", (reply.fields, case.frames[0][:200])
        elif case.kind == "bad_sampling":
            assert code == "bad_field", (reply.fields, case.frames[0][:200])
        elif case.kind == "extreme_sampling":
            assert code == "done", (reply.fields, case.frames[0][:200])
    return counts


def _answer(sock: zmq.Socket, verdict, case: Case):
    """The final reply to the case just sent (streamed chunks of a valid generate skipped)."""
    while True:
        assert sock.poll(30_000), f"no reply to a {case.kind} case: {case.frames[0][:200]!r}"
        reply = decode(sock.recv_multipart())
        assert isinstance(verdict, ProtocolError) or reply.id == verdict.id, (reply.id, reply.fields)
        if reply.type != "chunk":
            return reply
