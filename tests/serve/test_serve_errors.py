"""Every refusal has its HTTP status and an OpenAI-shaped body, and the server serves on afterwards."""

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import openai
import pytest
import requests
from pydantic import ValidationError
from serving import CHAT, MODEL, daemon_stats, stream_end, wait_for

from launch.local import daemon, free_port
from launch.serve import front_end

ASK = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0}

CHAT_PATH, TEXT_PATH = "/v1/chat/completions", "/v1/completions"
CASES = {  # name: (path, body, HTTP status, the parameter named, OpenAI error code)
    "bad JSON": (CHAT_PATH, b'{"model": "tiny-chat", "messages": [', 400, None, "invalid_json"),
    "not UTF-8": (CHAT_PATH, b'{"model": "tiny-chat\xff", "messages": []}', 400, None, "invalid_json"),
    "wrong type": (CHAT_PATH, {**ASK, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    "bool for int": (CHAT_PATH, {**ASK, "max_tokens": True}, 400, "max_tokens", "invalid_value"),
    "out of range": (CHAT_PATH, {**ASK, "top_p": 0}, 400, "top_p", "invalid_value"),
    "bad message": (CHAT_PATH, {**ASK, "messages": [{"role": "robot"}]}, 400, "messages.0.role", "invalid_value"),
    "no messages": (CHAT_PATH, {**ASK, "messages": []}, 400, "messages", "invalid_value"),
    "n > 1": (CHAT_PATH, {**ASK, "n": 2}, 400, "n", "unsupported_value"),
    "tools": (CHAT_PATH, {**ASK, "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    "logprobs": (CHAT_PATH, {**ASK, "logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    "unknown": (CHAT_PATH, {**ASK, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    "a refusal sent back": (
        CHAT_PATH,
        {**ASK, "messages": [*CHAT, {"role": "assistant", "content": None, "refusal": "No."}]},
        400,
        f"messages.{len(CHAT)}.refusal",
        "unsupported_parameter",
    ),
    "tool calls sent back": (
        CHAT_PATH,
        {**ASK, "messages": [*CHAT, {"role": "assistant", "tool_calls": [{"id": "x"}]}]},
        400,
        f"messages.{len(CHAT)}.tool_calls",
        "unsupported_parameter",
    ),
    "top_k below -1": (CHAT_PATH, {**ASK, "top_k": -2}, 400, "top_k", "invalid_value"),
    "usage without stream": (
        CHAT_PATH,
        {**ASK, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    "unknown model": (CHAT_PATH, {**ASK, "model": "gpt-4"}, 404, "model", "model_not_found"),
    "too long (chat)": (CHAT_PATH, {**ASK, "max_tokens": 2040}, 400, "messages", "context_length_exceeded"),
    "too long (prompt)": (
        TEXT_PATH,
        {"model": MODEL, "prompt": "otter " * 2100, "max_tokens": 4},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "two prompts": (TEXT_PATH, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    "two token prompts": (TEXT_PATH, {"model": MODEL, "prompt": [[1], [2]]}, 400, "prompt", "unsupported_value"),
    # 0 asks for the chosen token's logprob (OpenAI, vLLM): it was answered 200 with null (an audit).
    "logprobs 0": (TEXT_PATH, {"model": MODEL, "prompt": "a", "logprobs": 0}, 400, "logprobs", "unsupported_parameter"),
    "store true": (CHAT_PATH, {**ASK, "store": True}, 400, "store", "unsupported_parameter"),
    # Past what the wire carries: named by the parameter, not the protocol's field (an audit).
    "huge max_tokens": (CHAT_PATH, {**ASK, "max_tokens": 2**63}, 400, "max_tokens", "invalid_value"),
    "long stop": (CHAT_PATH, {**ASK, "stop": ["x" * 257]}, 400, "stop", "invalid_value"),
    "token id below 0": (TEXT_PATH, {"model": MODEL, "prompt": [-1]}, 400, "prompt", "invalid_value"),
    "top_k past int64": (CHAT_PATH, {**ASK, "top_k": 2**70}, 400, "top_k", "invalid_value"),
    "full prompt, no max_tokens": (
        TEXT_PATH,
        {"model": MODEL, "prompt": "otter " * 2100},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    # Each named the wrong parameter or none, or said NaN was too large (an audit).
    "token id past the vocabulary": (TEXT_PATH, {"model": MODEL, "prompt": [10**6]}, 400, "prompt", "invalid_value"),
    "an unknown key named like a type": (
        TEXT_PATH,
        {"model": MODEL, "prompt": "a", "dict": 1},
        400,
        "dict",
        "unknown_parameter",
    ),
    # A list of parts holding an image was told "messages.0.content: Input should be a valid
    # string", as if parts were not taken at all (an audit): the part that is not text is named.
    "an image part": (
        CHAT_PATH,
        {**ASK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content.0.type",
        "invalid_value",
    ),
    "a text part without its text": (
        CHAT_PATH,
        {**ASK, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages.0.content.0.text",
        "invalid_value",
    ),
    "an unknown key in a message": (
        CHAT_PATH,
        {**ASK, "messages": [{"role": "user", "content": "hi", "list": 1}]},
        400,
        "messages.0.list",
        "unknown_parameter",
    ),
}


def assert_openai_error(reply: requests.Response, status: int, param, code) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["message"] and error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_requests_get_their_status_and_the_server_serves_on(server, case):
    path, body, status, param, code = CASES[case]
    raw = {"data": body, "headers": {"Content-Type": "application/json"}}
    send = raw if isinstance(body, bytes) else {"json": body}
    error = assert_openai_error(requests.post(f"{server}{path}", timeout=60, **send), status, param, code)
    assert error["type"] == "invalid_request_error"
    assert "generate." not in error["message"] and "max_new_tokens" not in error["message"], error["message"]
    reply = requests.post(f"{server}/v1/chat/completions", json=ASK, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_a_chat_that_names_no_limit_gets_the_room_its_prompt_leaves(server):
    """A request without max_tokens gets --default-max-tokens (512) cut to the context's room,
    as OpenAI's API does, where it used to get 400 context_length_exceeded; one that names a
    limit over the room is still refused (CASES)."""
    long_chat = [{"role": "user", "content": "otter " * 850}]
    reply = requests.post(
        f"{server}{CHAT_PATH}", json={"model": MODEL, "messages": long_chat, "temperature": 0}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    used = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert 2048 - 512 < body["usage"]["prompt_tokens"] < 2048
    finish = body["choices"][0]["finish_reason"]
    assert (finish == "length" and used == 2048) or (finish == "stop" and used < 2048), body["usage"]
    # The field goes only where asked: a daemon from before it refuses it as unexpected.
    from frontend.schemas import ChatCompletionRequest

    named = ChatCompletionRequest(model=MODEL, messages=CHAT, max_tokens=5).to_daemon(512)
    unnamed = ChatCompletionRequest(model=MODEL, messages=CHAT).to_daemon(512)
    assert "fit_context" not in named and unnamed["fit_context"] is True and unnamed["max_new_tokens"] == 512


def test_what_openai_clients_send_reads_as_openai_means_it():
    """Each refused before, or read otherwise (an audit): a negative int64 seed (clients draw
    random ones), one prompt as a list of token lists, OpenAI's store/metadata/service_tier at
    their neutral values, and text parts, which were glued word to word."""
    from frontend.schemas import ChatCompletionRequest, CompletionRequest

    parts = [{"role": "user", "content": [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "hi"}]}]
    chat = ChatCompletionRequest(model=MODEL, messages=parts, seed=-1, store=False, metadata={}, service_tier="auto")
    chat.check_supported()
    sent = chat.to_daemon(512)
    assert sent["messages"][0]["content"] == "Translate:\nhi" and sent["sampling"]["seed"] == 2**63 - 1
    assert ChatCompletionRequest(model=MODEL, messages=CHAT, seed=-(2**63)).sampling()["seed"] == 0
    assert CompletionRequest(model=MODEL, prompt=[[5, 6, 7]]).to_daemon(512)["token_ids"] == [5, 6, 7]


def test_the_daemons_and_the_wires_refusals_name_the_parameter():
    """They came back with param null and the protocol's names (an audit)."""
    from frontend.errors import from_daemon, from_protocol

    limit = from_daemon("bad_field", "max_new_tokens 5000 exceeds this daemon's limit 4096", "messages")
    assert (limit.param, limit.message) == ("max_tokens", "max_tokens 5000 exceeds this daemon's limit 4096")
    nested = from_protocol("generate.messages[0].content: expected str of 0..524288 chars, got str", "messages")
    assert nested.param == "messages" and nested.message.startswith("messages[0].content: expected str")
    whole = from_protocol("generate: header is 1800264 bytes, limit 1048576", "prompt")
    assert (whole.param, whole.message) == ("prompt", "header is 1800264 bytes, limit 1048576")
    unpackable = from_protocol("generate: header cannot be packed: 'utf-8' codec can't encode", "messages")
    assert unpackable.param is None  # a stop string's as likely as the prompt's (a review)
    ids = from_daemon("bad_field", "token ids [49152] are outside the vocabulary (49152)", "prompt")
    assert ids.param == "prompt"
    completion = from_daemon("bad_field", "max_new_tokens 5000 exceeds this daemon's limit 4096", "messages", "x")
    assert completion.param == "x" and completion.message.startswith("x 5000")


MAX_BODY = 8 << 20  # dflash-serve's default --max-body-size


def padded(size: int) -> bytes:
    """ASK as a JSON body of exactly `size` bytes (padded with whitespace, which JSON ignores)."""
    body = json.dumps(ASK).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def chunked(body: bytes):
    """`body` sent without Content-Length (Transfer-Encoding: chunked), 64 KiB a chunk."""
    return (body[i : i + 65536] for i in range(0, len(body), 65536))


def post_body(url: str, body) -> requests.Response:
    return requests.post(f"{url}{CHAT_PATH}", data=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_a_body_over_the_size_limit_is_413_and_the_server_serves_on(server):
    """An audit found no limit on the request body: the daemon's prompt limits refused a 200 MB
    one (400), but only once it was read and parsed, the front end grown from 53 to 633 MiB. Now a
    body of the limit is served and a byte more is refused: with Content-Length before any of it
    is read, chunked once the limit is passed."""
    for body in (padded(MAX_BODY), chunked(padded(MAX_BODY))):
        assert post_body(server, body).status_code == 200
    for body, declared in ((padded(MAX_BODY + 1), f"({MAX_BODY + 1} bytes) "), (chunked(padded(MAX_BODY + 1)), "")):
        error = assert_openai_error(post_body(server, body), 413, None, "request_too_large")
        assert error["message"] == f"the request body {declared}is over this server's limit of {MAX_BODY} bytes"
        reply = requests.post(f"{server}{CHAT_PATH}", json=ASK, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    # A terabyte declared and never sent: answered at once, the body unread.
    address = urlsplit(server)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    connection.putrequest("POST", CHAT_PATH)
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(10**12))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_only_the_generate_routes_wait_for_a_body_and_not_forever():
    """A client that declared 8 MiB, sent all but a byte and waited held them in the front end for as
    long as it kept the connection, on any path, past the API key (an audit). Now a route that reads
    no body answers without waiting for one, and a generate route's body must arrive whole within
    the deadline (408)."""
    import asyncio

    from frontend.body_limit import BodyLimit

    async def route(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def stalled():  # a first chunk, then nothing more
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)

    async def run(path):
        started = []

        async def send(message):
            started.append(message) if message["type"] == "http.response.start" else None

        scope = {"type": "http", "path": path, "headers": [(b"content-length", b"8000000")]}
        limit = BodyLimit(route, paths=("/v1/chat/completions",), deadline_s=0.3)
        await asyncio.wait_for(limit(scope, stalled, send), 10)
        return started[0]["status"]

    sent = []
    assert asyncio.run(run("/health")) == 200 and not sent  # answered, its body never read
    assert asyncio.run(run("/v1/chat/completions")) == 408 and sent


def test_an_answer_the_daemon_cut_off_unasked_is_an_error_not_a_stop():
    """The daemon gives up a stream whose heartbeats stopped (its client stopped reading for 3 x 2 s)
    with `done` / `cancelled`, which the front end passed on as finish_reason `stop`: a cut-off
    answer that looked whole (an audit). Now the stream ends with an error event after the chunks
    so far, and an answer not streamed is a 503."""
    import asyncio

    from frontend.app import check, events
    from frontend.errors import APIError
    from frontend.responses import Answer
    from frontend.schemas import ChatCompletionRequest
    from protocol import Message

    class Replies:  # the rest of a call's replies, as LinkCall gives them
        def __init__(self, replies):
            self.replies, self.closed = list(replies), False

        async def next(self, gone=None):
            return self.replies.pop(0)

        async def close(self, wait_s=None):
            self.closed = True

    body = ChatCompletionRequest(model=MODEL, messages=CHAT, stream=True)
    cut = Message("done", 1, {"text": "Ot", "token_ids": [1, 2], "finish_reason": "cancelled", "stats": {}})
    call = Replies([cut])

    async def stream():
        first = Message("chunk", 1, {"text": "Ot", "token_ids": [1, 2]})
        return [e async for e in events(call, first, Answer(True, MODEL), body)]

    sent = [e.decode() for e in asyncio.run(stream())]
    data = [json.loads(e.split("data: ", 1)[1]) for e in sent[:-1]]
    assert [d["choices"][0]["delta"].get("content") for d in data[1:-1]] == ["Ot"]
    assert data[-1]["error"]["code"] == "target_request_cancelled" and "finish_reason" not in sent[-2]
    assert "[DONE]" in sent[-1] and call.closed
    with pytest.raises(APIError) as err:
        check(cut, body)
    assert err.value.status == 503


def test_a_daemon_of_another_protocol_version_is_a_502_that_names_it(tmp_path):
    """A target daemon a version ahead answers every request with its `bad_version` error in its
    own envelope, which this side cannot read: every route was a bare 500 "Internal Server Error"
    (an audit). Now each is a 502 in OpenAI's shape naming both versions, and a stream that meets
    such a reply after its first ends with an error event."""

    import msgpack
    import zmq
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import DaemonMisspoke, TargetLink
    from frontend.settings import FrontendSettings
    from protocol import PROTOCOL_VERSION

    address, stop = f"ipc://{tmp_path}/ahead.sock", threading.Event()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)

    def ahead():  # every request answered as a daemon of the next version answers it
        while not stop.is_set():
            if router.poll(50):
                identity, head, *_ = router.recv_multipart()
                why = f"protocol version mismatch: peer sent v={PROTOCOL_VERSION}"
                reply = {"v": PROTOCOL_VERSION + 1, "type": "error", "id": msgpack.unpackb(head)["id"], "tensors": []}
                router.send_multipart([identity, msgpack.packb({**reply, "code": "bad_version", "message": why})])

    thread = threading.Thread(target=ahead)
    thread.start()
    try:
        for name in (None, MODEL):  # the model asked of the daemon, or named at start
            app = create_app(TargetLink(address, daemon_timeout_s=2.0), FrontendSettings(model_name=name))
            with TestClient(app, raise_server_exceptions=False) as client:
                paths = ("/health", "/stats", "/metrics") + (() if name else ("/v1/models",))  # named: not asked
                replies = [client.get(path) for path in paths]
                replies += [client.post(CHAT_PATH, json={**ASK, "stream": stream}) for stream in (False, True)]
            for reply in replies:
                error = assert_openai_error(reply, 502, None, "upstream_protocol")
                assert f"v={PROTOCOL_VERSION + 1}" in error["message"], error
    finally:
        stop.set()
        thread.join()
        router.close(0)

    last, after = stream_end(DaemonMisspoke("bad_version: protocol version mismatch"))  # a second reply unread
    assert last["error"]["code"] == "upstream_protocol" and "[DONE]" in after


def test_what_a_client_sends_comes_back_in_an_error_bounded_and_in_words():
    """An unknown parameter's name came back whole, twice: an 8 MiB key, a 16 MiB reply; NaN was
    "less than or equal to 2"; a lone surrogate "header cannot be packed" (an audit)."""
    from frontend.errors import ECHO_CHARS, from_protocol, from_validation
    from frontend.schemas import ChatCompletionRequest

    key = "K" * (1 << 20)
    for loc in (("body", key), ("body", "messages", 0, key)):
        error = from_validation([{"type": "extra_forbidden", "loc": loc, "msg": "Extra inputs are not permitted"}])
        assert len(error.param) < ECHO_CHARS + 40 and len(error.message) < 2 * ECHO_CHARS, len(error.message)
    with pytest.raises(ValidationError, match="finite number"):
        ChatCompletionRequest(model=MODEL, messages=CHAT, temperature=float("nan"))
    why = "'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed"
    unpackable = from_protocol(f"generate: header cannot be packed: {why}", "messages")
    assert "not valid Unicode" in unpackable.message and "header" not in unpackable.message
    too_large = from_protocol("generate: header cannot be packed: Integer value out of range", "messages")
    assert "Unicode" not in too_large.message


def test_a_lone_surrogate_echoed_in_an_error_is_escaped_not_a_500():
    """JSON may carry a lone surrogate (\\ud800), UTF-8 cannot: an unknown model named so was echoed
    in the 404's message, whose rendering then failed with a bare 500 (an audit)."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), FrontendSettings(model_name=MODEL)
    )
    body = '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post(CHAT_PATH, content=body.encode(), headers={"Content-Type": "application/json"})
    error = assert_openai_error(reply, 404, "model", "model_not_found")
    assert "\\ud800" in error["message"]


def test_a_method_a_route_does_not_take_is_405_with_the_allow_header():
    """Starlette's 405 says which methods the route takes (Allow, as HTTP requires of a 405); the
    OpenAI-shaped error body replaced it without the header (an audit)."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from frontend.link import TargetLink
    from frontend.settings import FrontendSettings

    app = create_app(
        TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.5), FrontendSettings(model_name=MODEL)
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path, allowed in (("GET", CHAT_PATH, "POST"), ("POST", "/v1/models", "GET")):
            reply = client.request(method, path)
            assert_openai_error(reply, 405, None, None)
            assert reply.headers["allow"] == allowed


def test_requests_past_the_sockets_the_link_holds_are_429_and_closing_frees_one(monkeypatch):
    """Every open generate has a socket of its own in one ZeroMQ context, which holds 1,023: past
    them a request met "Too many open files" as a bare 500 (an audit). The link now counts what is
    open and refuses past its bound, which the front end answers 429 as it does a full queue."""
    import asyncio

    from frontend.link import TargetLink, TooManyOpen

    link = TargetLink("ipc:///nonexistent/target.sock", daemon_timeout_s=0.2, max_open=2)
    fields = {"max_new_tokens": 4, "token_ids": [1, 2, 3]}

    async def scenario():
        first, second = link.generate(fields), link.generate(fields)
        with pytest.raises(TooManyOpen):
            link.generate(fields)
        await first.close()
        await first.close()  # twice: counted once
        third = link.generate(fields)
        assert link.open == 2
        for call in (second, third):
            await call.close()
        assert link.open == 0

    asyncio.run(scenario())
    # Out of sockets or file descriptors all the same (below the link's count): refused the same way.
    import errno

    import zmq

    def no_socket(*args, **kwargs):
        raise zmq.ZMQError(errno.EMFILE)

    monkeypatch.setattr("frontend.link.GenerateCall", no_socket)
    with pytest.raises(TooManyOpen, match="no socket for another request"):
        link.generate(fields)
    assert link.open == 0


def test_the_openai_client_raises_its_own_error_types(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert err.value.param == "n" and err.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2040, stream=True)
    assert err.value.code == "context_length_exceeded" and "2048" in err.value.message
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-4", messages=CHAT)


@pytest.fixture(scope="module")
def lonely(tmp_path_factory):
    """A front end whose target daemon address has no daemon (until a test starts one there), and
    which takes request bodies of up to 64 KiB."""
    address = f"ipc://{tmp_path_factory.mktemp('nobody')}/target.sock"
    args = ["--target", address, "--served-model-name", MODEL, "--daemon-timeout", "1", "--max-body-size", "64K"]
    with front_end(free_port(), args) as url:
        yield url, address


def busy_daemon(model_dir, address):
    """One request running and one queued is all this daemon takes."""
    args = ["--model", str(model_dir), "--proposer", "none", "--threads", "1", "--max-batch", "1"]
    return daemon("target daemon", "launch.target_daemon", address, [*args, "--max-queued", "1"], 120)


def test_an_unreachable_daemon_is_503_and_the_front_end_serves_on(lonely):
    url, address = lonely
    for stream in (False, True):
        reply = requests.post(f"{url}/v1/chat/completions", json={**ASK, "stream": stream}, timeout=60)
        error = assert_openai_error(reply, 503, None, "target_unreachable")
        assert address in error["message"]
    assert_openai_error(requests.get(f"{url}/health", timeout=60), 503, None, "target_unreachable")
    assert "dflash_target_daemon_up 0.0" in requests.get(f"{url}/metrics", timeout=60).text
    assert requests.get(f"{url}/v1/models", timeout=60).status_code == 200


def test_max_body_size_sets_the_limit_and_413_needs_no_daemon(lonely):
    url, _ = lonely
    for body in (padded(65537), chunked(padded(65537))):
        error = assert_openai_error(post_body(url, body), 413, None, "request_too_large")
        assert "limit of 65536 bytes" in error["message"]
    # Within the limit: on to the (absent) daemon.
    assert_openai_error(post_body(url, padded(65536)), 503, None, "target_unreachable")


def test_a_full_queue_is_429_and_loses_nothing_accepted(lonely, chat_model_dir):
    url, address = lonely
    with busy_daemon(chat_model_dir, address):
        # This front end started before any daemon was there: it serves once one is.
        assert requests.get(f"{url}/health", timeout=60).status_code == 200
        long = {**ASK, "max_tokens": 1900, "stream": True}
        with requests.post(f"{url}/v1/chat/completions", json=long, stream=True, timeout=60) as running:
            lines = running.iter_lines()  # held: dropping the iterator would close the connection
            assert next(lines)  # the first request is generating
            queued = {}
            waiter = threading.Thread(
                target=lambda: queued.update(reply=requests.post(f"{url}/v1/chat/completions", json=ASK, timeout=120))
            )
            waiter.start()
            wait_for(lambda: daemon_stats(url)["queued"] == 1)
            for stream in (False, True):
                reply = requests.post(f"{url}/v1/chat/completions", json={**ASK, "stream": stream}, timeout=60)
                error = assert_openai_error(reply, 429, None, "rate_limit_exceeded")
                assert error["type"] == "rate_limit_error" and "limit 1" in error["message"]
        waiter.join(120)  # leaving the stream cancelled the running request; the queued one runs
        assert queued["reply"].status_code == 200 and queued["reply"].json()["usage"]["completion_tokens"] == 2
        reply = requests.post(f"{url}/v1/chat/completions", json=ASK, timeout=60)
        assert reply.status_code == 200


def test_a_request_whose_daemon_restarted_is_503_not_an_endless_wait(chat_model_dir, tmp_path):
    """The target daemon is killed mid-request and back on its address within the front end's
    --daemon-timeout: the front end's pings are answered, so it never counted the daemon as gone, and
    the new daemon never held the request. Its heartbeats are answered `unknown_request`, and the HTTP
    client gets 503 within a few seconds; before, it waited until it gave up (found by an audit)."""
    address = f"ipc://{tmp_path}/target.sock"
    args = ["--model", str(chat_model_dir), "--proposer", "none", "--threads", "1"]
    with front_end(free_port(), ["--target", address, "--served-model-name", MODEL, "--daemon-timeout", "120"]) as url:
        got = {}
        long = {**ASK, "max_tokens": 1900}
        asking = threading.Thread(
            target=lambda: got.update(reply=requests.post(f"{url}/v1/chat/completions", json=long, timeout=120))
        )
        with daemon("target daemon", "launch.target_daemon", address, args, 120) as first:
            asking.start()
            wait_for(lambda: daemon_stats(url)["running"] == 1)
            first.kill()
            first.wait()
            with daemon("target daemon", "launch.target_daemon", address, args, 120):
                began = time.monotonic()
                asking.join(60)
                took = time.monotonic() - began
                assert requests.post(f"{url}/v1/chat/completions", json=ASK, timeout=60).status_code == 200
    error = assert_openai_error(got["reply"], 503, None, "target_request_lost")
    assert "lost the request" in error["message"] and took < 10, (error, took)


def test_with_an_api_key_v1_wants_it_and_the_rest_stays_open(target_address, reference):
    """`--api-key`: /v1 without the key, or with another, is 401 before its body is read; with it,
    the answer is the daemon's own; probes and scrapers need none. A burst of wrong keys costs the
    key's holder nothing."""
    key = "s3cret-Key_1"
    with front_end(free_port(), ["--target", target_address, "--served-model-name", MODEL, "--api-key", key]) as url:
        missing = requests.post(f"{url}{CHAT_PATH}", json=ASK, timeout=60)
        assert_openai_error(missing, 401, None, "invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        with requests.Session() as stranger:
            for guess in ("s3cret-Key_", "s3cret-Key_12", "x" * 64, *(f"guess{i}" for i in range(100))):
                wrong = stranger.post(f"{url}{CHAT_PATH}", json=ASK, headers={"Authorization": f"Bearer {guess}"})
                assert "Incorrect API key" in assert_openai_error(wrong, 401, None, "invalid_api_key")["message"]
        huge = requests.post(f"{url}{CHAT_PATH}", data=b" " * (9 << 20), timeout=60)
        assert_openai_error(huge, 401, None, "invalid_api_key")  # not 413: a stranger's body is not read
        assert requests.get(f"{url}/v1/models", timeout=60).status_code == 401
        for open_path in ("/health", "/metrics", "/stats", "/"):
            assert requests.get(f"{url}{open_path}", timeout=60).status_code == 200, open_path

        from openai import OpenAI

        with OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) as client:
            answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
        expected = reference(messages=CHAT, max_new_tokens=6, sampling={"temperature": 0.0}, stream=False)
        assert answer.choices[0].message.content == expected["text"] != ""
        with OpenAI(base_url=f"{url}/v1", api_key="not-it", max_retries=0, timeout=120) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


@pytest.mark.parametrize("key", ["", "two words", "tab\there", "ключ"])
def test_an_api_key_a_header_cannot_carry_is_refused_at_start(key):
    from launch.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--api-key", key])


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("127.example.com", False),  # a name that only starts as a loopback address does (an audit)
    ],
)
def test_only_loopback_hosts_serve_without_a_key_quietly(host, loopback):
    from protocol.transport import is_loopback

    assert is_loopback(host) is loopback
