"""The front end's line to the daemon, against a real ROUTER socket: what it promises and keeps."""

import threading
import time

import anyio
import pytest

from frontend.link import HEARTBEAT_S, TargetLink
from protocol import encode
from protocol.transport import Server


def test_a_waiting_request_promises_heartbeats_and_keeps_the_promise(tmp_path):
    """So a front end that dies frees its requests' slots within three beats (the daemon drops a
    silent client's requests), where a request without them ran on for nobody."""
    address = f"ipc://{tmp_path}/daemon.sock"
    server, heard, stop = Server(address), [], threading.Event()

    def daemon():  # answers pings, keeps everything else
        while not stop.is_set():
            got = server.next(50)
            if got is None:
                continue
            identity, msg = got
            if msg.type == "ping":
                server.send(identity, encode("pong", msg.id, {"time": 0.0, "sessions": 0}))
            else:
                heard.append((time.monotonic(), msg))

    thread = threading.Thread(target=daemon)
    thread.start()
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
