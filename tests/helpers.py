"""Tiny random targets and test drafters, built the way users build real ones."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.proposal import Proposal
from target_node.drafting.proposers import NoProposer
from target_node.model.target import TargetModel
from target_node.model.tiny import tiny_target  # noqa: F401 - the tests import it from here


def hang_ups_by_default() -> None:
    """A child's preexec_fn where a test sends it SIGHUP: under nohup the tests' process ignores
    SIGHUP, every child inherited that, and the hang-up tests failed (a server that ignored both
    hang-ups streamed on to its length and never stopped)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def signals_by_default() -> None:
    """A child's preexec_fn where a test sends it SIGHUP or SIGINT, as from a terminal: a suite run
    in the background (CI's) ignores SIGINT, a shell started so cannot trap it, and the test
    failed there alone."""
    for signum in (signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


@contextmanager
def signals_as_in_a_terminal() -> Iterator[None]:
    """This process takes Ctrl-C and a hang-up as Python does in a terminal for the block, though
    the suite may run in the background (which ignores Ctrl-C) or under nohup."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@contextmanager
def children_hear_hang_ups() -> Iterator[None]:
    """`hang_ups_by_default` for children started by code that takes no preexec_fn (this process's
    own SIGHUP is back as it was at the block's end)."""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)


def drafter_config(**overrides):
    """A small drafter config for a 4-layer target with hidden size 32."""
    from draft_node.config import DFlashConfig

    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        target_layer_ids=(0, 2),
        block_size=4,
        mask_token_id=7,
        num_target_layers=4,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return DFlashConfig(**base)


def columns_logits(rows: int, vocab: int, kept: int, seed: int) -> Proposal:
    """Random draft logits over `kept` of `vocab` tokens, as a drafter with a vocabulary of its own
    gives them: on its columns, ascending."""
    gen = torch.Generator().manual_seed(seed)
    columns = torch.randperm(vocab, generator=gen)[:kept].sort().values
    return Proposal([], torch.randn(rows, kept, generator=gen) * 3, columns=columns)


def greedy(target: TargetModel, prompt: list[int], max_new: int, **kw) -> list[int]:
    return generate(target, prompt, NoProposer(), DecodeOptions(max_new, **kw)).tokens


def top2_gap(target: TargetModel, tokens: list[int]) -> float:
    """Logit gap between the target's top two choices after `tokens`, from a full forward pass."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([tokens], device=target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_lossless(target: TargetModel, prompt: list[int], got: list[int], want: list[int], tie: float = 0.0) -> None:
    """Exact equality. `tie` > 0 excuses a divergence at a measured near-tie (a top-2 gap below
    it): only for outputs no promise makes equal (another device's), never speculation's."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"lengths differ: {len(got)} vs {len(want)}"
    gap = top2_gap(target, prompt + want[:i])
    assert gap < tie, f"divergence at output token {i} ({got[i]} vs {want[i]}) with a top-2 gap of {gap:.2e}"
    print(f"tolerated near-tie divergence at token {i}: top-2 gap {gap:.2e}")


class OracleBackend:
    """A drafter that knows the answer: its hidden states project onto the true next tokens.

    It stands in for a perfect drafter behind the same DraftBackend interface, so the
    whole loop (features, noise, projection through the target's LM head) is exercised.
    """

    def __init__(self, target: TargetModel, reference: list[int], block_size: int, target_layer_ids=(0,)) -> None:
        self.target, self.reference = target, reference
        self.info = {
            "block_size": block_size,
            "hidden_size": target.hidden_size,
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": 0,
            "feature_width": len(target_layer_ids) * target.hidden_size,
            "ring_capacity": 4096,
            "num_target_layers": target.config.num_hidden_layers,
            "draft_vocab": [],
        }
        self.length = 0
        self.attached = True
        self.counters: dict = {}
        self.hit = False  # it never pre-drafts

    def begin_request(self) -> None:
        pass

    def send_draft(self, start, features, noise, position, rows, predraft=-1) -> None:
        pass  # it answers in `draft`

    def predraft(self, position, heads, known) -> None:
        pass  # it drafts the truth whenever asked

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reset(self, position: int) -> None:
        self.length = position

    def draft(self, start, features, noise, position, rows, predraft=-1):
        assert start == self.length and start + features.shape[0] == position, "features out of order"
        self.length = position
        head = self.target.model.get_output_embeddings().weight
        wanted = self.reference[position + 1 : position + 1 + rows]
        wanted += [0] * (rows - len(wanted))
        return head[wanted] / head[wanted].norm(dim=-1, keepdim=True) * 50.0, None

    def codebooks(self):
        raise AssertionError("an oracle has no selector")


def free_tcp_address() -> str:
    from launch.local import free_address

    return free_address()


def draft_daemon(address: str, checkpoint, ready_timeout_s: float = 60.0, dtype: str = "float32"):
    """A real draft daemon process on `address`, serving `checkpoint` in `dtype` (the tests' drafters
    are fp32, so remote and in-process drafts compare bit for bit); stopped on exit."""
    from launch.local import daemon

    # Same thread count as this process: matmul reduction order, and so the bits, match.
    threads = str(torch.get_num_threads())
    return daemon(
        "draft daemon",
        "launch.draft_daemon",
        address,
        ["--checkpoint", str(checkpoint), "--threads", threads, "--dtype", dtype],
        ready_timeout_s,
    )


@contextmanager
def serving_in_thread(serve: Callable[[str, threading.Event], None], address: str) -> Iterator[None]:
    """`serve(address, stop)` on a thread of this process until the block ends: a daemon a test
    makes misbehave, or whose insides it reads."""
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(address, stop))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def send_until_refused(sock, frames: list, most: int) -> int:
    """Send `frames` without blocking until `most` went out or ZeroMQ refused more for 2 s (the
    receiving side reads no further ahead): how many went out. For tests of a read-ahead bound."""
    import time

    import zmq

    sent, refused = 0, 0
    while sent < most and refused < 40:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            sent, refused = sent + 1, 0
        except zmq.Again:
            refused += 1
            time.sleep(0.05)
    return sent


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie has ended: only its exit status is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def long_ago(path) -> None:
    """`path` last touched an hour ago: a killed writer's part, past basics.files.QUIET_S."""
    then = time.time() - 3600
    os.utime(path, (then, then))


def wait_until(condition, timeout_s: float, every_s: float = 0.05) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `timeout_s`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if condition():
            return time.monotonic() - began
        time.sleep(every_s)
    return None
