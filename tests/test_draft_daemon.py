"""The draft daemon answers every mistake with a precise error and keeps serving."""

import time
from dataclasses import replace

import msgpack
import pytest
import torch
import zmq
from helpers import children_hear_hang_ups, draft_daemon, drafter_config

from draft_node.checkpoint import load_drafter, random_drafter, save_drafter
from draft_node.daemon import DraftService
from draft_node.settings import DraftSettings
from protocol import PROTOCOL_VERSION, decode, encode
from protocol.transport import dealer, receive

CFG = drafter_config(num_hidden_layers=1, rope_theta=1_000_000.0)
TARGET = {"hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 100}


class Clock:
    """A test's own seconds for a service's idleness: a loaded machine stretched the real ones past
    a test's thresholds (36 opens took over 50 ms while the suite shared two cores)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def service(clock):
    svc = DraftService(
        random_drafter(CFG), DraftSettings(ring_capacity=64, max_sessions=2, idle_timeout=60), clock=clock
    )
    assert call(svc, "open", session="a").type == "ok"
    return svc


def call(svc, type_, tensors=None, peer="", **fields):
    if type_ == "open" and tensors is None:
        tensors = {"mask": torch.randn(1, 32)}
    msg = decode(encode(type_, 9, fields, tensors))
    msg.peer = peer  # who the transport says sent it
    return decode(svc.handle(msg))


def propose(svc, session="a", start=0, position=3, width=64, block=(1, 32), **extra):
    tensors = {"features": torch.randn(position - start, width), "noise": torch.randn(*block)}
    return call(svc, "propose", tensors, session=session, start=start, position=position, **extra)


def error_code(reply):
    assert reply.type == "error", reply.type
    return reply["code"]


def test_hello_describes_the_drafter_and_picks_a_wire_dtype(service):
    reply = call(service, "hello", wire_dtypes=["bfloat16", "float32"], target=TARGET)
    assert reply["drafter"]["feature_width"] == 64 and reply["drafter"]["block_size"] == 4
    assert reply["wire_dtype"] == "float32"  # the drafter's own dtype wins when offered
    assert call(service, "hello", wire_dtypes=["bfloat16"], target=TARGET)["wire_dtype"] == "bfloat16"
    assert reply["drafter"]["draft_vocab"] == []
    service.drafter.draft_vocab = [3, 1, 4]
    assert call(service, "hello", wire_dtypes=["float32"], target=TARGET)["drafter"]["draft_vocab"] == [3, 1, 4]
    service.drafter.draft_vocab = [100]
    assert error_code(call(service, "hello", wire_dtypes=["float32"], target=TARGET)) == "config_mismatch"


def test_hello_refuses_a_target_that_does_not_fit(service):
    reply = call(service, "hello", wire_dtypes=["float32"], target=dict(TARGET, hidden_size=48, num_hidden_layers=6))
    assert error_code(reply) == "config_mismatch"
    assert "hidden size" in reply["message"] and "layer count" in reply["message"]


def test_propose_happy_path_and_rows(service):
    reply = propose(service)
    assert reply.type == "proposal" and reply.tensor("hidden").shape == (3, 32)
    reply = call(
        service,
        "propose",
        {"features": torch.randn(2, 64), "noise": torch.randn(1, 32)},
        session="a",
        start=3,
        position=5,
        rows=1,
    )
    assert reply.tensor("hidden").shape == (1, 32)


@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"session": "nobody"}, "unknown_session"),
        ({"width": 48}, "config_mismatch"),
        ({"block": (5, 32)}, "config_mismatch"),
        ({"start": 2, "position": 5}, "out_of_order"),  # a gap: the drafter holds nothing yet
        ({"rows": 4}, "bad_field"),  # more draft rows than the block has
    ],
)
def test_propose_mistakes_get_precise_errors(service, kwargs, code):
    assert error_code(propose(service, **kwargs)) == code
    assert propose(service).type == "proposal"  # and the session still works


def test_reset_rewinds_and_close_forgets(service):
    assert propose(service, start=0, position=10).type == "proposal"
    assert call(service, "reset", session="a", position=4).type == "ok"
    assert error_code(propose(service, start=6, position=8)) == "out_of_order"
    assert propose(service, start=4, position=8).type == "proposal"
    assert call(service, "close", session="a").type == "ok"
    assert error_code(call(service, "close", session="a")) == "unknown_session"


def test_sessions_are_evicted_when_idle_or_when_full(service, clock):
    call(service, "open", session="b")
    # max_sessions=2, both in use: the peer's own live sessions are not evicted for its third.
    refused = call(service, "open", session="c")
    assert error_code(refused) == "busy" and {name for _, name in service.sessions} == {"a", "b"}
    service.settings = replace(service.settings, reclaim_after=0.02)
    clock.sleep(0.05)
    call(service, "reset", session="b", position=0)
    assert call(service, "open", session="c").type == "ok"  # its own idle one goes: "a"
    assert {name for _, name in service.sessions} == {"b", "c"}
    service.settings = replace(service.settings, idle_timeout=1e-6)
    clock.sleep(0.01)
    service.evict_idle()
    assert service.sessions == {} and service.counters["evicted"] == 3


def test_one_peer_holds_at_most_its_quota_whatever_the_tables_state():
    """The quota used to be checked only when the table was full: on an empty daemon one peer
    opened all 40 of 40 sessions. Now the 33rd is refused, and a later peer opens its own."""
    svc = DraftService(random_drafter(CFG), DraftSettings(ring_capacity=16, max_sessions=40, max_sessions_per_peer=32))
    replies = [call(svc, "open", peer="hog", session=f"h{i}") for i in range(40)]
    assert [r.type for r in replies] == ["ok"] * 32 + ["error"] * 8
    assert "holds 32 sessions (limit 32)" in replies[-1]["message"]
    assert all(call(svc, "open", peer="late", session=f"l{i}").type == "ok" for i in range(8))
    assert sum(owner == "hog" for owner, _ in svc.sessions) == 32 and len(svc.sessions) == 40


def test_a_full_table_evicts_no_live_session_and_no_live_peers_idle_one(clock):
    """A peer's second open in a full table used to evict its own first (a target's eight slots
    evicted each other in turn); and any newcomer could take a session idle for --reclaim-after,
    though its target was alive, only between requests. Now a session goes only if idle and its
    owner silent that long, and a newcomer of many identities takes nothing from a live peer."""
    svc = DraftService(
        random_drafter(CFG),
        DraftSettings(ring_capacity=16, max_sessions=8, reclaim_after=0.05, max_sessions_per_peer=8),
        clock=clock,
    )
    for i in range(4):
        assert call(svc, "open", peer="target", session=f"t{i}").type == "ok"
    for i in range(4):
        assert call(svc, "open", peer=f"sybil{i}", session="s").type == "ok"
    assert error_code(call(svc, "open", peer="target", session="t4")) == "busy"
    assert {name for owner, name in svc.sessions if owner == "target"} == {"t0", "t1", "t2", "t3"}
    for round_ in range(3):  # the target idles between requests but pings; the sybils keep coming
        clock.sleep(0.06)
        assert call(svc, "ping", peer="target")["sessions"] == 4
        opened = [call(svc, "open", peer=f"sybil{i}-{round_}", session="s").type for i in range(4, 40)]
        assert opened == ["ok"] * 4 + ["error"] * 32  # the last round's sybils, gone silent, only
    assert {name for owner, name in svc.sessions if owner == "target"} == {"t0", "t1", "t2", "t3"}
    assert all(call(svc, "reset", peer="target", session=f"t{i}", position=0).type == "ok" for i in range(4))
    clock.sleep(0.06)  # now a target that fell silent: over its fair share, its idle sessions may go
    assert call(svc, "open", peer="newcomer", session="n").type == "ok"
    assert sum(owner == "target" for owner, _ in svc.sessions) == 3


def test_the_sessions_of_peers_gone_silent_come_free_whatever_their_share(clock):
    """A peer silent past --reclaim-after is gone (targets ping every 10 s). Its sessions stayed
    taken while it held no more than its share, and the gone peers counted in the share: 7 tenants
    gone of 8 left a newcomer 1 of the 8 sessions it asked for, for 10 minutes (an audit)."""
    svc = DraftService(
        random_drafter(CFG),
        DraftSettings(ring_capacity=16, max_sessions=16, reclaim_after=0.05, max_sessions_per_peer=8),
        clock=clock,
    )
    for tenant in range(8):
        for i in range(2):
            assert call(svc, "open", peer=f"tenant{tenant}", session=f"s{i}").type == "ok"
    clock.sleep(0.1)  # all fall silent but tenant 0, which pings
    call(svc, "ping", peer="tenant0")
    assert [call(svc, "open", peer="newcomer", session=f"n{i}").type for i in range(8)] == ["ok"] * 8
    assert sum(owner == "tenant0" for owner, _ in svc.sessions) == 2  # live: kept


def test_a_peer_keeping_many_sessions_alive_takes_no_other_peers_slot(clock):
    svc = DraftService(
        random_drafter(CFG),
        DraftSettings(ring_capacity=16, max_sessions=6, reclaim_after=0.05, max_sessions_per_peer=4),
        clock=clock,
    )
    for name in ("v0", "v1"):
        assert call(svc, "open", peer="victim", session=name).type == "ok"
    for i in range(4):
        assert call(svc, "open", peer="squatter", session=f"s{i}").type == "ok"
    refused = call(svc, "open", peer="squatter", session="s4")
    assert error_code(refused) == "busy" and "holds 4 sessions (limit 4)" in refused["message"]
    clock.sleep(0.1)  # the victim's sessions idle past reclaim_after (it pings); the squatter keeps its own alive
    for i in range(4):
        call(svc, "reset", peer="squatter", session=f"s{i}", position=0)
    call(svc, "ping", peer="victim")
    assert error_code(call(svc, "open", peer="newcomer", session="n0")) == "busy"
    assert {name for owner, name in svc.sessions if owner == "victim"} == {"v0", "v1"}
    clock.sleep(0.1)  # now both fell silent: the squatter holds more than its share, so one of its goes first
    assert call(svc, "open", peer="newcomer", session="n0").type == "ok"
    assert {name for owner, name in svc.sessions if owner == "victim"} == {"v0", "v1"}
    assert sum(owner == "squatter" for owner, _ in svc.sessions) == 3
    # In a full daemon a peer's new session takes its own least recently used one.
    assert call(svc, "open", peer="squatter", session="s5").type == "ok"
    assert sum(owner == "squatter" for owner, _ in svc.sessions) == 3 and len(svc.sessions) == 6
    # At its quota, a peer gives up its own longest-idle session (a restarted target's leftovers).
    assert call(svc, "close", peer="newcomer", session="n0").type == "ok"
    assert call(svc, "open", peer="squatter", session="s6").type == "ok"  # room: its 4th
    clock.sleep(0.1)
    assert call(svc, "open", peer="squatter", session="s7").type == "ok"
    squatter = {name for owner, name in svc.sessions if owner == "squatter"}
    assert len(squatter) == 4 and "s7" in squatter and len(svc.sessions) == 6
    assert call(svc, "ping", peer="victim")["sessions"] == 2  # its own, not the daemon's


def test_ping_and_stats(service):
    assert call(service, "ping")["sessions"] == 1
    propose(service)
    stats = call(service, "stats")["stats"]
    assert stats["proposals"] == 1 and stats["per_session"]["a"]["steps"] == 1 and stats["sessions"] == 1
    # Another tenant sees its own figures, not this one's traffic.
    assert call(service, "stats", peer="other")["stats"] == {
        "sessions": 0,
        "block_size": 4,
        "proposals": 0,
        "per_session": {},
        "kept_prefixes": 0,
    }
    assert call(service, "ping", peer="other")["sessions"] == 0


def test_garbage_over_a_real_socket_gets_errors_and_the_daemon_lives(tmp_path):
    folder = save_drafter(random_drafter(CFG), tmp_path / "ckpt")
    address = f"ipc://{tmp_path}/d.sock"
    with draft_daemon(address, folder):
        sock = dealer(zmq.Context.instance(), address)
        try:
            cases = [
                ([b"\xc1not msgpack"], "malformed"),
                ([msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "ping", "id": 5, "tensors": []})], "bad_version"),
                ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "fly", "id": 6, "tensors": []})], "unknown_type"),
                (encode("open", 7, {"session": "s"}, {"mask": torch.randn(1, 32)}) + [b"extra frame"], "bad_tensor"),
            ]
            for frames, code in cases:
                sock.send_multipart(frames)
                reply = decode(sock.recv_multipart())
                assert reply.type == "error" and reply["code"] == code, (code, reply.fields)
            sock.send_multipart(encode("ping", 99, {}))
            assert receive(sock, 99, time.monotonic() + 5).type == "pong"
        finally:
            sock.close(0)
    assert load_drafter(folder).config == CFG


def test_a_hang_up_stops_a_daemon_cleanly(tmp_path):
    """SIGHUP (its terminal closed, an ssh cut) killed a daemon outright: its clients waited out
    their timeouts and its ipc file stayed. It now stops as SIGTERM stops it."""
    import signal

    folder = save_drafter(random_drafter(CFG), tmp_path / "ckpt")
    address = f"ipc://{tmp_path}/d.sock"
    with children_hear_hang_ups(), draft_daemon(address, folder) as proc:
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0
    assert not (tmp_path / "d.sock").exists()


def test_a_burst_stops_taking_messages_once_they_carry_max_burst_bytes(tmp_path, monkeypatch):
    """A burst of whole-ring resends (22 MiB each) is read a few at a time, not 32 at once; small
    messages still come MAX_BURST at a time."""
    from draft_node import daemon as draft_daemon
    from protocol.transport import Client, Server

    monkeypatch.setattr(draft_daemon, "MAX_BURST_BYTES", 1 << 20)
    address = f"ipc://{tmp_path}/burst.sock"
    server, client = Server(address), Client(address)
    try:
        features = {"features": torch.randn(1000, 100), "noise": torch.randn(1, 32)}  # 400 KB each
        for i in range(7):
            client.send("propose", {"session": "s", "start": 0, "position": 1000}, features, request_id=i)
        for i in range(100):
            client.send("ping", request_id=100 + i)
        time.sleep(0.5)
        sizes = []
        while (first := server.next(1000)) is not None:
            sizes.append(len(draft_daemon.take_burst(server, first)))
            if sum(sizes) == 107:
                break
    finally:
        client.close()
        server.close()
    assert sizes[:3] == [3, 3, draft_daemon.MAX_BURST] and sum(sizes) == 107, sizes  # 3 x 400 KB passes 1 MiB


def test_a_kept_prefix_starts_another_session_of_the_peer_as_its_rows_would():
    """`keep` then `restore`: the second session drafts, from the rows after the prefix only, the
    bits a session sent every row drafts; another peer cannot name the prefix."""
    service = DraftService(random_drafter(CFG), DraftSettings(ring_capacity=64, max_sessions=4))
    mask, features, noise = torch.randn(1, 32), torch.randn(20, 64), torch.randn(1, 32)
    for session in ("a", "b"):
        assert call(service, "open", {"mask": mask}, session=session).type == "ok"
    first = call(service, "propose", {"features": features[:12], "noise": noise}, session="a", start=0, position=12)
    assert first.type == "proposal"
    assert call(service, "keep", session="a", name="chat-1", rows=30)["rows"] == 12  # what it holds from 0
    assert call(service, "restore", session="b", name="chat-1", rows=10)["rows"] == 10
    tail = {"features": features[10:20], "noise": noise}
    restored = call(service, "propose", tail, session="b", start=10, position=20)
    call(service, "reset", session="a", position=0)
    whole = call(service, "propose", {"features": features, "noise": noise}, session="a", start=0, position=20)
    assert torch.equal(restored.tensor("hidden"), whole.tensor("hidden"))
    assert error_code(call(service, "restore", session="b", name="chat-1", rows=10, peer="other")) == "unknown_session"
    assert call(service, "open", session="c", peer="other").type == "ok"
    assert call(service, "restore", session="c", name="chat-1", rows=10, peer="other")["rows"] == 0
    assert call(service, "stats")["stats"]["kept_prefixes"] == 1


def test_a_peer_flooding_the_kept_prefixes_evicts_its_own_not_the_others():
    """One LRU pool for every peer: one peer's keeps under new names emptied it of every other
    target's prefixes (an audit: 48 keeps of 4,096 rows in 0.13 s). The peer keeping the most bytes
    now loses its own oldest entry first."""
    svc = DraftService(random_drafter(CFG), DraftSettings(ring_capacity=64, max_sessions=4, keep_mb=40_000 / (1 << 20)))
    for peer in ("victim", "flood"):
        call(svc, "open", session="a", peer=peer)
        propose(svc, position=40, peer=peer)
    assert call(svc, "keep", session="a", name="chat", rows=40, peer="victim")["rows"] == 40
    for i in range(200):
        assert call(svc, "keep", session="a", name=f"junk{i}", rows=40, peer="flood").type == "kept"
        assert svc.kept.held <= 40_000
    assert call(svc, "restore", session="a", name="chat", rows=40, peer="victim")["rows"] == 40
    assert call(svc, "restore", session="a", name="junk199", rows=40, peer="flood")["rows"] == 40
    assert svc.kept.counters["evicted"] >= 190


def test_a_keep_that_would_be_its_own_victim_is_refused_and_evicts_nothing():
    """Evicting the largest holder's oldest until the store fits made the keeper the largest part
    way, and its new entry went too: the other peer lost entries for nothing and the reply still
    said `kept` (a review). Such a keep is now refused (0 rows), and nothing is evicted."""
    from draft_node.kept_prefixes import KeptPrefixes

    store = KeptPrefixes(max_bytes=256)
    rows = torch.zeros(1, 1, 1, 8)  # 64 bytes as keys and values

    def entry(n):  # n rows: 64 n bytes
        return rows.expand(1, 1, n, 8).contiguous(), rows.expand(1, 1, n, 8).contiguous()

    for i in range(3):
        assert store.keep("a", f"a{i}", *entry(1))
    assert not store.keep("b", "big", *entry(3))  # 192 bytes: b would be the largest with nothing older
    assert sorted(store.entries) == [("a", "a0"), ("a", "a1"), ("a", "a2")] and store.held == 192
    assert store.keep("b", "fits", *entry(2))  # 128: a (192) is the largest, gives up its oldest
    assert sorted(store.entries) == [("a", "a1"), ("a", "a2"), ("b", "fits")] and store.held == 256
    assert store.take("a", "a1", 1) is not None  # used: a2 is a's oldest now
    assert store.keep("a", "a3", *entry(1))
    assert sorted(store.entries) == [("a", "a1"), ("a", "a3"), ("b", "fits")]
    assert store.held == sum(e[2] for e in store.entries.values()) == sum(store.held_by.values())


def test_kept_prefixes_stay_within_their_bytes_under_a_flood():
    svc = DraftService(random_drafter(CFG), DraftSettings(ring_capacity=64, max_sessions=2, keep_mb=40_000 / (1 << 20)))
    call(svc, "open", session="a")
    propose(svc, position=40)
    for i in range(500):
        assert call(svc, "keep", session="a", name=f"p{i}", rows=1 + i % 40).type == "kept"
        assert svc.kept.held <= 40_000
    assert svc.kept.counters["evicted"] > 400
    assert call(svc, "restore", session="a", name="p499", rows=40)["rows"] == 1 + 499 % 40  # the newest is held
    assert call(svc, "restore", session="a", name="p0", rows=40)["rows"] == 0  # the oldest went


def test_a_req_socket_gets_an_error_naming_the_dealer_socket_instead_of_waiting_for_ever(tmp_path):
    """A REQ socket sends an empty delimiter before the message and drops any reply without one:
    its user waited for ever (an audit). The reply now comes in REQ's envelope and says what to
    use, and the daemon serves a DEALER beside it as before."""
    from helpers import serving_in_thread

    from draft_node.daemon import serve
    from protocol.transport import request

    address = f"ipc://{tmp_path}/req.sock"
    svc = DraftService(random_drafter(CFG), DraftSettings(ring_capacity=16))
    context = zmq.Context.instance()
    with serving_in_thread(lambda where, stop: serve(svc, where, stop), address):
        asker = context.socket(zmq.REQ)
        asker.connect(address)
        try:
            asker.send_multipart(encode("ping", 1, {}))
            assert asker.poll(5000), "no reply reached the REQ socket"
            reply = decode(asker.recv_multipart())
        finally:
            asker.close(0)
        assert reply.type == "error" and reply["code"] == "malformed" and "DEALER" in reply["message"]
        pong = request(address, "ping", timeout_s=5)
        assert pong is not None and pong.type == "pong"
    assert svc.counters["errors"] >= 1


def test_without_curve_a_keep_makes_room_from_its_own_targets_other_slots():
    """Each slot of a target is a peer of its own without CURVE, so a keep was refused while the
    store held only stale entries of the same target's other slots (an audit). They are that
    target's to give up (their names carry its process secret); another target's are not."""
    from draft_node.kept_prefixes import KeptPrefixes

    store = KeptPrefixes(max_bytes=256)
    store.by_peer = False
    rows = torch.zeros(1, 1, 1, 8)  # 64 bytes as keys and values
    mine, theirs = "a" * 32, "b" * 32

    def entry(n):  # n rows: 64 n bytes
        return rows.expand(1, 1, n, 8).contiguous(), rows.expand(1, 1, n, 8).contiguous()

    assert store.keep("slot1", f"{mine}-0", *entry(1)) and store.keep("slot1", f"{mine}-1", *entry(1))
    assert store.keep("other", f"{theirs}-0", *entry(1))
    assert store.keep("slot2", f"{mine}-2", *entry(3))  # slot2 the largest, nothing older: slot1's go
    assert sorted(name for _, name in store.entries) == [f"{mine}-2", f"{theirs}-0"] and store.held == 256
    assert not store.keep("slot3", "c" * 32 + "-0", *entry(4))  # a stranger: nothing of its own to give
    assert sorted(name for _, name in store.entries) == [f"{mine}-2", f"{theirs}-0"]
    store.keep("slot1", f"{mine}-3", *entry(1))
    store.keep("slot1", f"{mine}-4", *entry(1))  # slot2 (192) the largest gives up its one entry
    assert store.held <= store.max_bytes
    assert store.held == sum(e[2] for e in store.entries.values()) == sum(store.held_by.values())


def test_the_transport_names_the_peer_of_an_undecodable_request(tmp_path):
    """The daemon keeps a peer's replies in order across an undecodable request (its error waits
    with the peer's later requests: test_draft_batching), so the error must name its peer as the
    peer's decoded requests do."""
    from protocol.transport import Server

    address = f"ipc://{tmp_path}/named.sock"
    server = Server(address)
    socks = [dealer(zmq.Context.instance(), address) for _ in range(2)]
    try:
        for sock in socks:
            sock.send_multipart([b"\xc1not msgpack"])
            sock.send_multipart(encode("ping", 5, {}))
        taken = []
        while len(taken) < 4 and (got := server.next(5000)) is not None:
            taken.append(got)
    finally:
        for sock in socks:
            sock.close(0)
        server.close()
    assert len(taken) == 4
    by_identity: dict[bytes, list] = {}
    for identity, request in taken:
        by_identity.setdefault(identity, []).append(request)
    assert len(by_identity) == 2
    for garbled, ping in by_identity.values():
        assert garbled.code.value == "malformed" and ping.type == "ping"
        assert garbled.peer is not None and garbled.peer == ping.peer
