"""The front end's line to the daemon, against a real ROUTER socket: what it promises and keeps."""

import threading
import time

import anyio
import pytest

from frontend.link import HEARTBEAT_S, TargetLink
from protocol import encode
from protocol.transport import Server


def pings_answered(server: Server, stop: threading.Event, otherwise) -> threading.Thread:
    """A fake daemon's thread, until `stop`: pings answered at once, every other message given to
    `otherwise(identity, msg)`."""

    def daemon() -> None:
        while not stop.is_set():
            got = server.next(20)
            if got is None:
                continue
            identity, msg = got
            if msg.type == "ping":
                server.send(identity, encode("pong", msg.id, {"time": 0.0, "sessions": 0, "pid": 1}))
            else:
                otherwise(identity, msg)

    thread = threading.Thread(target=daemon)
    thread.start()
    return thread


def test_a_waiting_request_promises_heartbeats_and_keeps_the_promise(tmp_path):
    """So a front end that dies frees its requests' slots within three beats (the daemon drops a
    silent client's requests), where a request without them ran on for nobody."""
    address = f"ipc://{tmp_path}/daemon.sock"
    server, heard, stop = Server(address), [], threading.Event()

    thread = pings_answered(server, stop, lambda identity, msg: heard.append((time.monotonic(), msg)))
    link = TargetLink(address)
    call = link.generate({"token_ids": [1, 2, 3], "max_new_tokens": 4})
    began = time.monotonic()

    async def wait() -> None:
        with anyio.move_on_after(2.5 * HEARTBEAT_S):
            await call.next()

    try:
        anyio.run(wait)
    finally:
        stop.set()
        thread.join()
        call.call.client.close()
        server.close()
    kinds = [msg.type for _, msg in heard]
    assert kinds[0] == "generate" and heard[0][1]["heartbeat_s"] == HEARTBEAT_S
    beats = [t - began for t, msg in heard if msg.type == "heartbeat" and msg.id == call.id]
    assert len(beats) == 2, kinds
    assert beats[0] == pytest.approx(HEARTBEAT_S, abs=0.5) and beats[1] == pytest.approx(2 * HEARTBEAT_S, abs=0.5)


def run_then_stop(main, server: Server, stop: threading.Event, thread: threading.Thread) -> None:
    """`anyio.run(main)`, then the fake daemon's thread ends and its socket closes."""
    try:
        anyio.run(main)
    finally:
        stop.set()
        thread.join()
        server.close()


def test_a_flood_of_stats_callers_shares_one_daemon_call_at_a_time(tmp_path):
    """/stats and /metrics stay open under --api-key: 64 callers at once used to make 64 daemon
    calls (each taking the daemon's room for held messages). Callers waiting together now share
    one call, and each still gets figures from a call begun after it arrived."""
    address = f"ipc://{tmp_path}/daemon.sock"
    server, calls, stop = Server(address), [], threading.Event()

    def daemon():  # answers each stats call slowly, numbering them
        while not stop.is_set():
            got = server.next(20)
            if got is None:
                continue
            identity, msg = got
            assert msg.type == "stats", msg.type
            calls.append(msg.id)
            time.sleep(0.2)
            server.send(identity, encode("stats_ok", msg.id, {"stats": {"call": len(calls)}}))

    thread = threading.Thread(target=daemon)
    thread.start()
    link = TargetLink(address)
    got: list[tuple[int, dict | None]] = []

    async def ask() -> None:
        heard_before = len(calls)  # calls the daemon had received when this caller arrived
        got.append((heard_before, await link.stats()))

    async def flood() -> None:
        async with anyio.create_task_group() as group:
            for i in range(64):
                group.start_soon(ask)
                if i % 16 == 15:
                    await anyio.sleep(0.1)  # arrivals spread over a call or two
        got.append((len(calls), await link.stats()))  # alone, afterwards: a call of its own

    run_then_stop(flood, server, stop, thread)
    assert len(got) == 65 and all(figures is not None for _, figures in got)
    assert len(calls) <= 4, f"{len(calls)} daemon calls for 65 callers"
    assert all(figures["call"] > heard_before for heard_before, figures in got), got
    assert got[-1][1]["call"] == len(calls)


def test_a_client_that_pings_a_quiet_daemon_keeps_its_heartbeats_going(tmp_path, monkeypatch):
    """dflash-client pings a daemon silent for QUIET_S; the ping blocked the request's heartbeats,
    and a ping answered late had the daemon drop a live request as silent (a review). The
    heartbeats now go on while the ping waits."""
    import frontend.target_client as target_client
    from frontend.target_client import TargetClient

    monkeypatch.setattr(target_client, "QUIET_S", 0.3)
    address = f"ipc://{tmp_path}/late.sock"
    server, beats, stop = Server(address), [], threading.Event()
    began = time.monotonic()

    def daemon():  # holds the request for 2 s, answers pings 0.5 s late, notes each heartbeat
        due, request = [], None
        while not stop.is_set():
            now = time.monotonic()
            for when, identity, id_ in [d for d in due if d[0] <= now]:
                server.send(identity, encode("pong", id_, {"time": 0.0, "sessions": 0, "pid": 1}))
                due.remove((when, identity, id_))
            if request is not None and now - began > 2.0:
                identity, msg = request
                server.send(
                    identity,
                    encode("done", msg.id, {"text": "", "token_ids": [], "finish_reason": "length", "stats": {}}),
                )
                request = None
            got = server.next(10)
            if got is None:
                continue
            identity, msg = got
            if msg.type == "ping":
                due.append((time.monotonic() + 0.5, identity, msg.id))
            elif msg.type == "heartbeat":
                beats.append(time.monotonic())
            elif msg.type == "generate":
                request = (identity, msg)

    thread = threading.Thread(target=daemon)
    thread.start()
    try:
        client = TargetClient(address, timeout_s=10.0, heartbeat_s=0.2)
        done = client.generate(token_ids=[1, 2, 3], max_new_tokens=4)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert done.type == "done" and len(beats) >= 5
    gaps = [b - a for a, b in zip([began, *beats], beats, strict=False)]
    assert max(gaps) < 3 * 0.2, gaps  # the daemon drops a request after 3 missed beats: the contract


def test_stats_callers_behind_an_unanswered_call_do_not_wait_again(tmp_path):
    """Callers that arrived while a stats call to a silent daemon was under way waited it out, then
    made a call of their own and waited the whole timeout again (a review): /stats and /metrics
    took twice the timeout to say the daemon is away. What they waited through answers them."""
    address = f"ipc://{tmp_path}/silent.sock"
    server, calls, stop = Server(address), [], threading.Event()

    def daemon():  # reads every call, answers none
        while not stop.is_set():
            got = server.next(20)
            if got is not None:
                calls.append(got[1].type)

    thread = threading.Thread(target=daemon)
    thread.start()
    link = TargetLink(address, daemon_timeout_s=0.5)
    got: list[dict | None] = []

    async def ask() -> None:
        got.append(await link.stats())

    async def flood() -> None:
        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(ask)
                await anyio.sleep(0.02)  # all arrive while the first call waits
        got.append(await link.stats())  # alone, afterwards: a call of its own

    run_then_stop(flood, server, stop, thread)
    assert got == [None] * 9
    assert calls == ["stats", "stats"], calls


def test_a_stream_waiting_on_a_hung_daemons_ping_still_notices_it_must_end(tmp_path):
    """A quiet stream pings the daemon; on a hung one the ping waits --daemon-timeout, and the
    stream asked nothing else meanwhile: a draining server's 503 came after uvicorn's cut (a
    review). The stream now ends within a slice of being told to, and the ping is left to end alone."""
    from frontend.link import WAIT_SLICE_S, ClientGone

    address = f"ipc://{tmp_path}/daemon.sock"
    server = Server(address)  # a hung daemon: it reads nothing, answers nothing
    link = TargetLink(address, daemon_timeout_s=30.0)
    call = link.generate({"token_ids": [1, 2, 3], "max_new_tokens": 4})
    told = time.monotonic() + 1.5  # past QUIET_S: the ping is under way by then
    ended: list[float] = []

    async def wait() -> None:
        async def gone() -> bool:
            return time.monotonic() >= told

        with pytest.raises(ClientGone):
            await call.next(gone=gone)
        ended.append(time.monotonic())

    try:
        anyio.run(wait)
    finally:
        call.call.client.close()
        server.close()
    assert link.probed == 0.0  # the ping had not ended: the stream did not wait for it
    assert ended[0] - told < 5 * WAIT_SLICE_S, ended[0] - told


def test_a_daemon_that_forgot_a_request_is_not_taken_for_alive_by_that_reply(tmp_path):
    """A stopping daemon tells each request it was not finished (`unknown_request`) and then
    answers nothing; that reply counted as the daemon's word that it was up, and /health said
    200 for QUIET_S after it stopped (an audit). Whether it is up is now a ping's to say."""
    from protocol import ErrorCode, encode_error

    address = f"ipc://{tmp_path}/daemon.sock"
    server = Server(address)
    link = TargetLink(address, daemon_timeout_s=0.3)
    call = link.generate({"token_ids": [1, 2, 3], "max_new_tokens": 4})
    identity, msg = server.next(5000)
    server.send(identity, encode_error(msg.id, ErrorCode.UNKNOWN_REQUEST, "the target daemon is shutting down"))
    answers: list = []

    async def ask() -> None:
        answers.append((await call.next()).type)
        answers.append(await link.alive())  # the daemon reads nothing more: the ping goes unanswered

    try:
        anyio.run(ask)
    finally:
        call.call.client.close()
        server.close()
    assert answers == ["error", False]


def test_a_stream_that_pings_gets_the_pings_own_error_not_a_group_of_them(tmp_path, monkeypatch):
    """The ping runs beside the stream's own checks (a task group), which wrapped its errors: out
    of sockets was a 500 where it is a 429 `TooManyOpen` (a review)."""
    from frontend.link import TooManyOpen

    address = f"ipc://{tmp_path}/daemon.sock"
    server = Server(address)  # answers nothing: the stream pings
    link = TargetLink(address, daemon_timeout_s=5.0)
    call = link.generate({"token_ids": [1, 2, 3], "max_new_tokens": 4})

    async def no_socket() -> bool:
        raise TooManyOpen("no socket for a ping")

    monkeypatch.setattr(link, "alive", no_socket)

    async def wait() -> None:
        async def gone() -> bool:
            return False

        with pytest.raises(TooManyOpen):
            await call.next(gone=gone)

    try:
        anyio.run(wait)
    finally:
        call.call.client.close()
        server.close()


def test_a_live_daemon_that_forgot_one_request_is_still_alive(tmp_path):
    """After an `unknown_request` (a request dropped for late heartbeats), the last answered ping's
    time made `alive` say no for QUIET_S without asking: another stream got a 503 (a review)."""
    from protocol import ErrorCode, encode_error

    address = f"ipc://{tmp_path}/daemon.sock"
    server, stop = Server(address), threading.Event()

    def forgets(identity: bytes, msg) -> None:  # every generate
        if msg.type == "generate":
            server.send(identity, encode_error(msg.id, ErrorCode.UNKNOWN_REQUEST, "not held"))

    thread = pings_answered(server, stop, forgets)
    link = TargetLink(address, daemon_timeout_s=2.0)
    answers: list = []

    async def ask() -> None:
        answers.append(await link.alive())  # a ping, answered
        call = link.generate({"token_ids": [1, 2, 3], "max_new_tokens": 4})
        try:
            answers.append((await call.next()).type)
        finally:
            call.call.client.close()
        answers.append(await link.alive())

    run_then_stop(ask, server, stop, thread)
    assert answers == [True, "error", True]
