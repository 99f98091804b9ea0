"""What one client can hold of the front end: connections, their heads, the bodies arriving at once,
and what the routes open without a key show (the findings of an audit of the front end's limits)."""

import asyncio
import json
import socket
import threading
import time

import pytest
from serving import CHAT, MODEL, stream_end, wait_for
from test_serve_errors import ASK, CHAT_PATH, TEXT_PATH, assert_openai_error

from launch.local import free_port


def running_server(app, protocol):
    """uvicorn in a thread with the front end's connection bounds (`protocol`); a keep-alive far
    past the head deadline, so only the bound closes a connection that went quiet."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=300, http=protocol
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    return server, thread, port


def closed_by_server(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sent before it closed `sock` (fails if it is still open after `within_s`)."""
    sock.settimeout(within_s)
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk


def test_connections_past_the_bound_get_503_and_heads_not_finished_in_time_are_closed(monkeypatch):
    """uvicorn gave a connection all the time it liked to send a request's head, and accepted
    connections until the process ran out of files: 20,000 half-sent heads left /health unanswered
    (an audit). Now connections past the bound get 503 at once, and a head must arrive within the
    deadline, on a new connection and after each answer on a kept-alive one; a request whose head
    arrived runs as long as it takes."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(1.0)  # past the head deadline: the request runs on
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def ask(sock: socket.socket, path: str) -> bytes:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        sock.settimeout(10)
        reply = b""
        while not reply.endswith(b"ok"):
            reply += sock.recv(65536)
        return reply

    import frontend.connections
    from frontend.connections import REFUSALS_DRAINED, bounded_h11

    monkeypatch.setattr(frontend.connections, "REFUSED_LINGER_S", 60.0)  # drained until their clients leave
    protocol = bounded_h11(3, head_deadline_s=0.5)
    server, thread, port = running_server(app, protocol)
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        # A flood of refused connections that stay open: the drained ones are bounded, the rest
        # closed at once (held, they took the files of the admitted requests' sockets: a review).
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(REFUSALS_DRAINED + 8)]
        assert all(closed_by_server(sock, within_s=5).startswith(b"HTTP/1.1 503") for sock in flood)
        assert protocol.draining <= REFUSALS_DRAINED and len(server.server_state.connections) <= 3 + REFUSALS_DRAINED
        for sock in flood:
            sock.close()
        wait_for(lambda: protocol.draining == 0, timeout_s=10)  # each gone with its client
        for body in (b"", b"x" * 1_000_000):  # a client that sent a body read a reset, not the 503 (a review)
            extra = socket.create_connection(("127.0.0.1", port))
            head = f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            extra.sendall(head + body)
            refused = closed_by_server(extra, within_s=5)
            assert refused.startswith(b"HTTP/1.1 503"), refused
            assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
            extra.close()
        for sock in idle:  # none sent a head in time
            assert closed_by_server(sock, within_s=5) == b""
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head's end never comes
        kept = socket.create_connection(("127.0.0.1", port))
        assert ask(kept, "/slow").startswith(b"HTTP/1.1 200")
        assert ask(kept, "/").startswith(b"HTTP/1.1 200")  # kept alive, then a half head
        kept.sendall(b"GET / HTTP/1.1\r\n")
        assert closed_by_server(half, within_s=5) == b""
        assert closed_by_server(kept, within_s=5) == b""
        with socket.create_connection(("127.0.0.1", port)) as fresh:  # the bound counts open ones only
            assert ask(fresh, "/").startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(30)


def test_bodies_arriving_at_once_share_a_budget_and_a_flood_of_them_holds_no_more():
    """Each body was bounded alone: 40 clients that sent 8 MiB less a byte and waited held 400 MiB of
    the front end (an audit). Now the bytes of the bodies arriving at once share a budget: a body
    gets 429 when its next chunk would pass it, every byte is given back however its request ends,
    and a body counts only what it sent (declared lengths alone shut everyone out: a review)."""
    from frontend.body_limit import BodyLimit

    async def route(scope, receive, send):
        message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(message["body"])).encode()})

    def client(chunks, declared=None, hold=None):
        """A request's scope and `receive`: `chunks` sent one by one, waiting on `hold` before the last."""
        headers = [] if declared is None else [(b"content-length", str(declared).encode())]
        scope = {"type": "http", "path": CHAT_PATH, "headers": headers}
        left = list(chunks)

        async def receive():
            if len(left) == 1 and hold is not None:
                await hold.wait()
            body = left.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(left)}

        return scope, receive

    async def answer(limit, scope, receive):
        sent = []

        async def send(message):
            sent.append(message)

        await limit(scope, receive, send)
        return sent[0]["status"], (sent[1]["body"] if len(sent) > 1 else b"")

    async def scenario():
        limit = BodyLimit(route, limit=600, paths=(CHAT_PATH,), deadline_s=600, budget=1000)
        release, never = asyncio.Event(), asyncio.Event()
        held = asyncio.ensure_future(answer(limit, *client([b"a" * 500, b"a" * 100], declared=600, hold=release)))
        squatters = [  # declared the most, sent nothing yet: they hold nothing
            asyncio.ensure_future(answer(limit, *client([b"", b"s"], declared=600, hold=never))) for _ in range(8)
        ]
        await asyncio.sleep(0.05)
        assert limit.buffered == 500
        chunked = client([b"c" * 400, b"c" * 200])  # 900, then 1100: refused as it passes
        assert (await answer(limit, *chunked))[0] == 429
        assert await answer(limit, *client([b"d" * 300, b"d" * 100], declared=400)) == (200, b"400")
        release.set()
        assert await held == (200, b"600")
        assert await answer(limit, *client([b"b" * 600], declared=600)) == (200, b"600")
        assert limit.buffered == 0
        for squatter in squatters:
            squatter.cancel()
        await asyncio.gather(*squatters, return_exceptions=True)
        # A flood of stalled bodies: the budget holds ten of 100 bytes, the rest are refused at once.
        slow = BodyLimit(route, limit=600, paths=(CHAT_PATH,), deadline_s=0.3, budget=1000)
        flood = [answer(slow, *client([b"x" * 100, b"x"], hold=never)) for _ in range(50)]
        statuses = sorted(status for status, _ in await asyncio.gather(*flood))
        assert statuses == [408] * 10 + [429] * 40, statuses
        assert slow.buffered == 0 and limit.buffered == 0

    asyncio.run(scenario())


def test_a_probe_with_no_socket_left_is_429_not_a_bare_500(monkeypatch):
    """Out of file descriptors, /health and /stats raised ZeroMQ's "Too many open files" through
    the routes: a plain-text 500 (an audit). It is 429, as a generate request past the bound is."""
    import errno

    import zmq
    from starlette.testclient import TestClient

    import frontend.link
    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    def no_files(*args, **kwargs):
        raise zmq.ZMQError(errno.EMFILE)

    monkeypatch.setattr(frontend.link, "request", no_files)
    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), FrontendSettings(model_name=MODEL)
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("/health", "/stats", "/metrics"):
            assert_openai_error(client.get(path), 429, None, "rate_limit_exceeded")


def test_the_open_routes_show_the_served_name_and_no_api_schema(target_address):
    """/stats, open under --api-key, named the daemon's model folder where /v1/models gives the
    served name; /docs, /redoc and /openapi.json answered without the key (an audit)."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    for served in ("otters-1", None):  # None: the daemon's folder's name
        app = create_app(
            TargetLink(target_address, daemon_timeout_s=30), FrontendSettings(model_name=served, api_key="k3y")
        )
        with TestClient(app, raise_server_exceptions=False) as client:
            listed = client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).json()["data"][0]["id"]
            assert client.get("/stats").json()["model"] == listed == (served or listed)
            assert listed.startswith("otters" if served else "tiny-chat")
            # The SDK's models.retrieve: the served model's card was a 404 (an audit); another's is.
            key = {"Authorization": "Bearer k3y"}
            assert client.get(f"/v1/models/{listed}", headers=key).json()["id"] == listed
            assert_openai_error(client.get("/v1/models/gpt-4/turbo", headers=key), 404, "model", "model_not_found")
            assert client.get(f"/v1/models/{listed}").status_code == 401
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert client.get(path).status_code == 404, path
            assert client.head("/").status_code == 200  # probes of the page


def test_a_loopback_server_answers_no_request_for_another_host(server):
    """DNS rebinding: a web page pointed its own name at 127.0.0.1, and the default server (loopback,
    no key) generated text and showed /stats to it, the browser taking both for the page's own
    origin (an audit). Such a request names the page's host: it gets 400. Loopback names in any
    form pass, and a name given with --allowed-hosts (a proxy's)."""
    import requests
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    port = server.rsplit(":", 1)[1]
    rebound = {"Host": f"rebind.attacker.example:{port}"}
    for path in ("/stats", "/v1/models", "/"):  # dflash-serve's default: --host 127.0.0.1
        assert_openai_error(requests.get(server + path, headers=rebound, timeout=30), 400, None, "invalid_host")
    chat = requests.post(f"{server}{CHAT_PATH}", json=ASK, headers=rebound, timeout=30)
    assert "rebind.attacker.example" in assert_openai_error(chat, 400, None, "invalid_host")["message"]
    assert requests.get(f"{server}/v1/models", timeout=30).status_code == 200

    settings = FrontendSettings(model_name=MODEL, allowed_hosts=frozenset({"proxy.example"}))
    app = create_app(TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        for host in ("127.0.0.1:8000", "localhost", "LOCALHOST.:1", "[::1]:8000", "127.1", "proxy.example:443"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("testserver", "127.0.0.1.nip.io", "proxy.example.attacker.example", "[2001:db8::1]"):
            assert_openai_error(client.get("/v1/models", headers={"Host": host}), 400, None, "invalid_host")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_read_in_any_case_and_only_the_key_is_compared(scheme):
    """RFC 9110: an authentication scheme's name is case-insensitive, and spaces follow it; `bearer
    KEY` got 401 (an audit)."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5),
        FrontendSettings(model_name=MODEL, api_key="k"),
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        for right in (f"{scheme} k", f"{scheme}  k"):  # one or more spaces
            assert client.get("/v1/models", headers={"Authorization": right}).status_code == 200
        for wrong in (f"{scheme} kk", f"{scheme}k", "Basic k", "k", f"{scheme} k k", f"{scheme}\tk"):
            assert client.get("/v1/models", headers={"Authorization": wrong}).status_code == 401, wrong


def test_a_huge_value_is_quoted_short_in_its_error():
    """A refused parameter's value came back whole: a 300k-key logit_bias gave a 3.8 MB error (an audit)."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), FrontendSettings(model_name=MODEL)
    )
    bias = {str(i): 1 for i in range(50_000)}
    with TestClient(app, raise_server_exceptions=False) as client:
        for body in ({**ASK, "logit_bias": bias}, {**ASK, "model": "m" * 100_000}):
            reply = client.post(CHAT_PATH, json=body)
            assert reply.status_code in (400, 404) and len(reply.content) < 1000, len(reply.content)
            assert "characters)" in reply.json()["error"]["message"]
        chat = {**ASK, "messages": [{**CHAT[0], "refusal": "r" * 100_000}]}
        assert len(client.post(CHAT_PATH, json=chat).content) < 1000


def test_a_list_longer_than_the_daemon_takes_is_refused_before_its_items_are_read():
    """500,000 empty messages (8 MB) were validated one by one before the daemon's limit of 1,024
    refused them: the event loop, and every other request, waited 2.6 s, and the front end grew by
    540 MB (an audit). The length is read first: too many items, none of them valid, are refused
    for their number; at the limit the items are read."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings
    from protocol.messages import MAX_MESSAGES, MAX_PROMPT_TOKENS, MAX_STOP

    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), FrontendSettings(model_name=MODEL)
    )
    robot = {"role": "robot"}  # no valid message
    with TestClient(app, raise_server_exceptions=False) as client:
        for path, body, param in (
            (CHAT_PATH, {"model": MODEL, "messages": [robot] * (MAX_MESSAGES + 1)}, "messages"),
            (CHAT_PATH, {**ASK, "stop": [None] * (MAX_STOP + 1)}, "stop"),
            (TEXT_PATH, {"model": MODEL, "prompt": [None] * (MAX_PROMPT_TOKENS + 1)}, "prompt"),
            (TEXT_PATH, {"model": MODEL, "prompt": [[-1] * (MAX_PROMPT_TOKENS + 1)]}, "prompt"),
        ):
            reply = client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param and "at most" in error["message"], error
        at_limit = client.post(CHAT_PATH, json={"model": MODEL, "messages": [robot] * MAX_MESSAGES})
        assert at_limit.status_code == 400 and "messages.0.role" in at_limit.json()["error"]["message"], at_limit.text


def test_the_connections_are_what_the_open_files_leave_beside_the_requests_sockets(monkeypatch):
    """The bound on connections was the requests' own (1,000), which 1,000 idle sockets filled,
    locking out the page and /health where the open files allowed six times as many (a review)."""
    import resource

    from frontend.link import FILES_SPARE, connection_limit, open_call_limit

    for soft, calls, connections in ((1024, 320, 320), (20000, 1000, 20000 - FILES_SPARE - 2000)):
        monkeypatch.setattr(resource, "getrlimit", lambda which, soft=soft: (soft, soft))
        assert (open_call_limit(), connection_limit(open_call_limit())) == (calls, connections)


def test_a_stream_whose_ping_finds_no_socket_ends_with_an_error_event():
    """A ping inside a stream that found no socket ended the stream with no error and no [DONE]."""
    from frontend.link import TooManyOpen

    last, after = stream_end(TooManyOpen("no socket for a ping (Too many open files); retry later"))
    assert last["error"]["code"] == "rate_limit_exceeded" and "[DONE]" in after


FORGED = b'10.9.9.9:1 - "POST /v1/admin HTTP/1.1" 200 OK\x85INFO:     6.6.6.6 \x1b[31m'


def access_log(extra: list[str], tmp_path) -> str:
    """The log of a front end (no daemon behind it) that was sent one request with a forged
    X-Forwarded-For and a 15,000-character path."""
    import subprocess
    import sys

    from launch.processes import stop
    from launch.serve import wait_http_ready

    port, log = free_port(), tmp_path / f"serve{len(extra)}.log"
    command = [sys.executable, "-m", "launch.serve", "--port", str(port), "--target", "ipc:///nowhere/t.sock", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--served-model-name", MODEL], stdout=out, stderr=out)
        try:
            assert wait_http_ready(f"http://127.0.0.1:{port}/", 60, alive=lambda: proc.poll() is None)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                path = b"/" + b"A" * 15000
                conn.sendall(
                    b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Forwarded-For: " + FORGED + b"\r\n\r\n"
                )
                assert conn.recv(100).startswith(b"HTTP/1.1 404")
        finally:
            stop(proc, grace_s=10)
    return log.read_bytes().decode("utf-8", "replace")


def test_a_front_end_started_before_its_daemon_says_so(tmp_path):
    """Started in front of no daemon, it said nothing, and each request waited 5 s for its 503 (an audit)."""
    assert "no target daemon answers at ipc:///nowhere/t.sock yet" in access_log([], tmp_path)


def test_a_client_can_neither_forge_access_log_lines_nor_flood_the_log_with_a_path(tmp_path):
    """uvicorn believed X-Forwarded-For from 127.0.0.1, where every client of the default --host
    is: a header wrote a forged line (U+0085), raw escapes for the terminal reading the log, and
    any address it liked; a 15,000-character path went into the log whole (an audit)."""
    line = next(line for line in access_log([], tmp_path).splitlines() if "GET /AAA" in line)
    assert "10.9.9.9" not in line and "6.6.6.6" not in line and line.split()[1].startswith("127.0.0.1:")
    assert len(line) < 400 and "(15001 characters)" in line
    behind = access_log(["--forwarded-allow-ips", "127.0.0.1"], tmp_path)  # an operator's own proxy
    line = next(line for line in behind.splitlines() if "GET /AAA" in line)
    assert "10.9.9.9" in line and "\x1b" not in line and "\x85" not in line and "\u0085" not in line
    assert "\\x1b" in line and "6.6.6.6" in line and len(line) < 700
