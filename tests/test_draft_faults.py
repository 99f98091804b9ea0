"""The draft daemon as a real process over CURVE on TCP: keys, sessions per peer, fuzzing, SIGSTOP."""

import os
import signal
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import zmq
from fuzz import Fuzzer, Template, run
from helpers import assert_lossless, drafter_config, free_tcp_address, greedy, tiny_target, wait_until

from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from draft_node.daemon import DraftService
from draft_node.settings import DraftSettings
from launch.draft_daemon import main as draft_daemon_main
from launch.local import daemon
from launch.processes import rss_mb
from protocol import decode, encode
from protocol.keys import client_keys, create_keypair
from protocol.transport import Client, InsecureBind, Server, dealer, is_local, receive, request
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.proposers import DFlashProposer, DrafterUnavailable, NGramProposer
from target_node.drafting.remote import LinkTiming, RemoteDraftBackend

PROMPT = [200, 11, 11, 11, 250, 12, 13, 14]
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    for name in ("draft", "target", "other", "stranger"):
        create_keypair(folder, name)
    return folder


def link(keys, me, server="draft"):
    """`me`'s keys for a link to `server`."""
    return client_keys(keys / f"{me}.key_secret", keys / f"{server}.key")


@pytest.fixture(scope="module")
def drafter(target, keys, tmp_path_factory):
    """A draft daemon on TCP with CURVE, letting in the keys 'target' and 'other'."""
    folder = tmp_path_factory.mktemp("drafter")
    cfg = config_for_target(target.config, block_size=8, taps=3)
    checkpoint = save_drafter(random_drafter(cfg, seed=1, std=0.1), folder / "ckpt")
    address, log = free_tcp_address(), folder / "draft.log"
    args = ["--checkpoint", str(checkpoint), "--threads", "1", "--ring-capacity", "256", "--max-sessions", "16"]
    args += ["--curve-key", str(keys / "draft.key_secret")]
    args += ["--curve-allow", str(keys / "target.key"), "--curve-allow", str(keys / "other.key")]
    with daemon("draft daemon", "launch.draft_daemon", address, args, 60, curve=link(keys, "target"), log=log) as proc:
        yield SimpleNamespace(address=address, proc=proc, log=log, cfg=cfg)


def wait_for_log(log, text, timeout_s=5.0):
    return wait_until(lambda: text in log.read_text(), timeout_s) is not None


def test_an_allowed_target_drafts_and_other_keys_get_nothing(target, keys, drafter):
    backend = RemoteDraftBackend(drafter.address, target, curve=link(keys, "target"))
    result = generate(target, PROMPT, DFlashProposer(backend), DecodeOptions(MAX_NEW, adaptive=False))
    backend.close()
    assert_lossless(target, PROMPT, result.tokens, greedy(target, PROMPT, MAX_NEW))
    assert result.stats.sources == {"dflash": result.stats.steps - result.stats.plain_steps}
    assert backend.counters["timeouts"] == 0
    unknown_key = link(keys, "stranger")
    wrong_server = client_keys(keys / "target.key_secret", keys / "stranger.key")
    for curve in (unknown_key, None, wrong_server):  # None: a plaintext client
        assert request(drafter.address, "ping", timeout_s=1.0, curve=curve) is None
    assert wait_for_log(drafter.log, "its CURVE key is not on the allow-list")
    assert wait_for_log(drafter.log, "failed the handshake")
    assert request(drafter.address, "ping", timeout_s=10, curve=link(keys, "other")).type == "pong"


def test_the_all_in_one_keys_let_only_the_target_into_the_draft_daemon(target, tmp_path):
    """`dflash-local --curve`: the client's key opens the target daemon, not the drafter's."""
    from launch.keys import LocalKeys

    keys = LocalKeys(tmp_path / "keys")
    folder = tmp_path / "ckpt"
    save_drafter(random_drafter(config_for_target(target.config, block_size=4, taps=2)), folder)
    address = free_tcp_address()
    args = ["--checkpoint", str(folder), "--threads", "1", *keys.draft_args]
    with daemon("draft daemon", "launch.draft_daemon", address, args, 60, curve=keys.launcher_to_draft):
        assert request(address, "ping", timeout_s=10, curve=keys.launcher_to_draft).type == "pong"
        as_client = client_keys(tmp_path / "keys" / "client.key_secret", tmp_path / "keys" / "draft.key")
        assert request(address, "ping", timeout_s=1.0, curve=as_client) is None


def test_one_target_cannot_see_or_touch_another_targets_session(target, keys, drafter):
    owner = RemoteDraftBackend(drafter.address, target, curve=link(keys, "target"), name="shared")
    proposer = DFlashProposer(owner)
    first = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, adaptive=False))
    intruder = Client(drafter.address, curve=link(keys, "other"))
    hidden, width = drafter.cfg.hidden_size, drafter.cfg.feature_width
    try:
        attempts = [
            ("reset", {"session": "shared", "position": 0}, {}),
            ("propose", {"session": "shared", "start": 0, "position": 2},
             {"features": torch.randn(2, width), "noise": torch.randn(1, hidden)}),
            ("close", {"session": "shared"}, {}),
        ]  # fmt: skip
        for type_, fields, tensors in attempts:
            reply = intruder.call(type_, fields, tensors, timeout_s=10)
            assert reply["code"] == "unknown_session", reply.fields
        # Word for word what a session that never existed gets.
        never = intruder.call("close", {"session": "never-opened"}, timeout_s=10)
        assert never["message"] == reply["message"].replace("'shared'", "'never-opened'")
        assert "shared" not in intruder.call("stats", timeout_s=10)["stats"]["per_session"]
        assert "shared" in owner._call("stats", {})["stats"]["per_session"]
        # The intruder's own session of the same name is another session.
        assert intruder.call("open", {"session": "shared"}, {"mask": torch.randn(1, hidden)}, timeout_s=10).type == "ok"
        assert intruder.call("close", {"session": "shared"}, timeout_s=10).type == "ok"
    finally:
        intruder.close()
    errors = owner.counters["errors"]
    second = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, adaptive=False))
    owner.close()
    assert second.tokens == first.tokens
    assert second.stats.sources == {"dflash": second.stats.steps - second.stats.plain_steps}
    assert owner.counters["errors"] == errors  # its session was never disturbed


def test_fuzzed_messages_get_typed_errors_and_the_daemon_stays_healthy(target, keys, drafter):
    hidden, width = drafter.cfg.hidden_size, drafter.cfg.feature_width
    g = torch.Generator().manual_seed(0)
    templates = [
        Template("hello", {"wire_dtypes": ["float32"], "target": target.info}, {}),
        Template("open", {"session": "fz"}, {"mask": torch.randn(1, hidden, generator=g)}),
        Template("reset", {"session": "fz", "position": 0}, {}),
        Template("close", {"session": "fz-b"}, {}),
        Template(
            "propose",
            {"session": "fz", "start": 0, "position": 3, "rows": 2},
            {"features": torch.randn(3, width, generator=g), "noise": torch.randn(1, hidden, generator=g)},
        ),
        Template("ping", {}, {}),
        Template("stats", {}, {}),
    ]
    fuzzer = Fuzzer(templates, seed=14, extra_kinds=("nonfinite", "huge_position"))
    sock = dealer(zmq.Context.instance(), drafter.address, curve=link(keys, "other"))
    try:
        run(sock, fuzzer, seconds=0.5)  # warm-up: allocator and caches settle before RSS is read
        before = rss_mb(drafter.proc.pid)
        counts = run(sock, fuzzer, seconds=4.0)
        after = rss_mb(drafter.proc.pid)
    finally:
        sock.close(0)
    print(f"draft daemon fuzz: {counts}, RSS {before:.0f} -> {after:.0f} MB")
    assert counts["cases"] > 500 and set(counts["kinds"]) == set(fuzzer.kinds)
    assert after - before < 50, (before, after)
    # A frame past the socket's limit: dropped unread with the connection, and logged.
    big = dealer(zmq.Context.instance(), drafter.address, curve=link(keys, "other"))
    try:
        big.send_multipart([b"\x80", b"\x00" * (4 << 20)])
        assert not big.poll(1000)
    finally:
        big.close(0)
    assert wait_for_log(drafter.log, "sent a frame over this socket's limit")
    backend = RemoteDraftBackend(drafter.address, target, curve=link(keys, "target"))
    result = generate(target, PROMPT, DFlashProposer(backend), DecodeOptions(MAX_NEW, adaptive=False))
    backend.close()
    assert_lossless(target, PROMPT, result.tokens, greedy(target, PROMPT, MAX_NEW))
    assert result.stats.sources == {"dflash": result.stats.steps - result.stats.plain_steps}


@pytest.mark.parametrize("bad", [float("nan"), 3e38])
def test_nan_or_huge_features_are_refused_and_do_not_poison_the_session(keys, drafter, bad):
    """Finite rows of 3e38 passed, overflowed in the drafter, and left NaN keys and values in the
    session's context: every later draft of it was NaN until a reset (an audit)."""
    hidden, width = drafter.cfg.hidden_size, drafter.cfg.feature_width
    client = Client(drafter.address, curve=link(keys, "other"))
    try:
        assert client.call("open", {"session": "n"}, {"mask": torch.randn(1, hidden)}, timeout_s=10).type == "ok"
        features = torch.randn(4, width)
        clean = client.call("propose", {"session": "n", "start": 0, "position": 4},
                            {"features": features, "noise": torch.ones(1, hidden)}, timeout_s=10)  # fmt: skip
        poisoned = features.clone()
        poisoned[2, 5] = bad
        reply = client.call("propose", {"session": "n", "start": 0, "position": 4},
                            {"features": poisoned, "noise": torch.ones(1, hidden)}, timeout_s=10)  # fmt: skip
        assert reply["code"] == "bad_tensor" and "rows [2]" in reply["message"]
        again = client.call("propose", {"session": "n", "start": 0, "position": 4},
                            {"features": features, "noise": torch.ones(1, hidden)}, timeout_s=10)  # fmt: skip
        assert torch.equal(again.tensor("hidden"), clean.tensor("hidden"))
    finally:
        client.close()


def test_a_stopped_daemon_costs_one_stall_and_drafts_again_once_continued(target, keys, drafter):
    """SIGSTOP mid-request: the request finishes exactly on the fallback after one stall of about
    the draft timeout (later probes wait 0.2 s at most); after SIGCONT the drafter drafts again."""
    timeout_s, stop_s = 1.0, 3.0
    backend = RemoteDraftBackend(
        drafter.address,
        target,
        timing=LinkTiming(timeout_s=timeout_s, probe_timeout_s=0.2, retry_s=0.5),
        curve=link(keys, "target"),
    )
    proposer = DFlashProposer(backend, NGramProposer())
    want = greedy(target, PROMPT, MAX_NEW)
    times, resume = [time.monotonic()], threading.Timer(stop_s, os.kill, (drafter.proc.pid, signal.SIGCONT))

    def stop_after_a_few(tokens, text):
        times.append(time.monotonic())
        if len(times) == 6:
            os.kill(drafter.proc.pid, signal.SIGSTOP)
            resume.start()

    try:
        result = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, adaptive=False), on_commit=stop_after_a_few)
    finally:
        resume.join()
        os.kill(drafter.proc.pid, signal.SIGCONT)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert_lossless(target, PROMPT, result.tokens, want)
    assert backend.counters["timeouts"] >= 1 and result.stats.sources["dflash"] < result.stats.steps
    assert len([g for g in gaps if g >= 0.9 * timeout_s]) == 1, gaps
    assert max(gaps) < timeout_s + 1.5, gaps
    # Continued: the next request drafts remotely again.
    result = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, adaptive=False))
    backend.close()
    assert_lossless(target, PROMPT, result.tokens, want)
    assert result.stats.sources.get("dflash", 0) > 0
    assert request(drafter.address, "ping", timeout_s=10, curve=link(keys, "other")).type == "pong"


@pytest.mark.parametrize(
    "address, local",
    [
        ("ipc:///tmp/d.sock", True),
        ("inproc://d", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://lo:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.77.0.2:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://127.1:5555", True),  # the socket layer's own short form of 127.0.0.1
        ("tcp://127.0.0.1.example.com:5555", False),  # a name: ZeroMQ resolves it, to anywhere (an audit)
        ("tcp://[::ffff:10.0.0.1]:5555", False),
    ],
)
def test_only_loopback_and_local_sockets_count_as_local(address, local):
    assert is_local(address) is local


def test_plaintext_beyond_loopback_is_refused_unless_asked_for(caplog, capsys):
    address = free_tcp_address().replace("127.0.0.1", "0.0.0.0")
    with pytest.raises(InsecureBind, match="--insecure-plaintext"):
        Server(address)
    Server(address, insecure_plaintext=True).close()
    assert "in plaintext: anyone who can reach it" in caplog.text
    # The daemon refuses while parsing its flags, before it loads anything.
    with pytest.raises(SystemExit) as refused:
        draft_daemon_main(["--bind", address, "--checkpoint", "/nowhere"])
    assert refused.value.code == 2 and "--insecure-plaintext" in capsys.readouterr().err


def test_without_curve_a_session_belongs_to_the_connection_that_opened_it():
    service = DraftService(random_drafter(drafter_config(num_hidden_layers=1)), DraftSettings(ring_capacity=16))

    def call(peer, type_, tensors=None, **fields):
        msg = decode(encode(type_, 1, fields, tensors))
        msg.peer = peer  # what the transport sets: the routing id without CURVE
        return decode(service.handle(msg))

    assert call("aa", "open", {"mask": torch.randn(1, 32)}, session="s").type == "ok"
    assert call("bb", "reset", session="s", position=0)["code"] == "unknown_session"
    assert call("bb", "stats")["stats"]["per_session"] == {}
    assert list(call("aa", "stats")["stats"]["per_session"]) == ["s"]
    assert call("aa", "reset", session="s", position=0).type == "ok"


def test_many_identities_cannot_take_a_live_targets_idle_session(target, tmp_path):
    """Without CURVE identities are free: 64 fresh routing ids used to take every slot, the idle
    sessions of running targets included. A target's backend pings while idle (keepalive), and the
    daemon takes sessions only from peers it has not heard from: the live target keeps its
    session through a squat, while one that stays silent loses it."""
    cfg = config_for_target(target.config, block_size=8, taps=3)
    checkpoint = save_drafter(random_drafter(cfg, seed=1, std=0.1), tmp_path / "ckpt")
    address = free_tcp_address()
    args = ["--checkpoint", str(checkpoint), "--threads", "1", "--ring-capacity", "64"]
    args += ["--max-sessions", "4", "--reclaim-after", "0.4"]
    with daemon("draft daemon", "launch.draft_daemon", address, args, 60):
        live = RemoteDraftBackend(address, target, timing=LinkTiming(keepalive_s=0.1))
        silent = RemoteDraftBackend(address, target, timing=LinkTiming(keepalive_s=0.1))
        assert live.attached and silent.attached
        context, squatters, answers = zmq.Context.instance(), [], Counter()
        try:
            began = time.monotonic()
            while time.monotonic() - began < 2.0:
                sock = dealer(context, address)
                squatters.append(sock)
                sock.send_multipart(encode("open", 1, {"session": "squat"}, {"mask": torch.randn(1, cfg.hidden_size)}))
                reply = receive(sock, 1, time.monotonic() + 5)
                answers[reply.type if reply.type == "ok" else reply["code"]] += 1
                live.keepalive()  # what the target daemon's loop calls between steps
                time.sleep(0.02)
            live.reset(0)  # its session is still there
            with pytest.raises(DrafterUnavailable, match="no session"):
                silent.reset(0)
        finally:
            for sock in squatters:
                sock.close(0)
            live.close()
            silent.close()
    print(f"squatters' opens: {answers}")
    assert answers["ok"] >= 2, answers  # the squat took slots: the free ones, the silent target's
