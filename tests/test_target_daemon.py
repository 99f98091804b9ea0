"""The target daemon as a real process: streaming, fairness, cancellation, bad requests."""

import threading
import time

import pytest
import zmq
from helpers import greedy, serving_in_thread, tiny_target

from frontend.target_client import TargetClient
from launch.local import daemon
from protocol import ErrorCode, ProtocolError, decode, encode
from protocol.transport import dealer, receive
from target_node.drafting.proposers import EMPTY, NGramProposer
from target_node.model.target import TargetModel
from target_node.serving.daemon import TargetService
from target_node.serving.settings import ServiceSettings

PROMPT = [5, 17, 42, 99, 3, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_target("llama", seed=5).model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def address(model_dir, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/target.sock"
    with daemon(
        "target daemon", "launch.target_daemon", address, ["--model", str(model_dir), "--proposer", "ngram"], 120
    ):
        yield address


def test_streamed_tokens_equal_greedy(model_dir, address):
    want = greedy(TargetModel.load(model_dir), PROMPT, 30)
    client = TargetClient(address, timeout_s=60)
    replies = list(client.stream(token_ids=PROMPT, max_new_tokens=30))
    client.close()
    chunks, done = replies[:-1], replies[-1]
    assert done.type == "done" and done["token_ids"] == want
    assert [t for c in chunks for t in c["token_ids"]] == want
    assert done["stats"]["proposer"] == "ngram" and done["stats"]["new_tokens"] == len(want)


def test_bad_requests_get_errors_and_the_daemon_carries_on(address):
    client = TargetClient(address, timeout_s=60)
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        client.generate(token_ids=[1, 10**6], max_new_tokens=4)
    with pytest.raises(ProtocolError, match="no tokenizer"):
        client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)
    with pytest.raises(ProtocolError, match="temperature"):
        client.generate(token_ids=PROMPT, max_new_tokens=4, sampling={"temperature": -1.0})
    with pytest.raises(ProtocolError, match="holds 2048"):  # over the model's positions and the daemon's limit
        client.generate(token_ids=PROMPT, max_new_tokens=100_000)
    assert client.generate(token_ids=PROMPT, max_new_tokens=4)["finish_reason"] in ("length", "eos")
    client.close()


@pytest.fixture(scope="module")
def one_slot(model_dir, tmp_path_factory):
    """A daemon that runs one request at a time, so requests contend for its slot."""
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/serial.sock"
    args = ["--model", str(model_dir), "--proposer", "ngram", "--max-batch", "1"]
    with daemon("target daemon", "launch.target_daemon", address, args, 120):
        yield address


def test_requests_are_served_round_robin_and_none_is_lost(one_slot):
    """Client A queues three requests, client B one, for one slot: B waits for at most one of A's."""
    address = one_slot
    context = zmq.Context.instance()
    a, b = dealer(context, address), dealer(context, address)
    try:
        for i in range(3):
            a.send_multipart(encode("generate", 100 + i, {"token_ids": PROMPT, "max_new_tokens": 40, "stream": False}))
        b.send_multipart(encode("generate", 200, {"token_ids": PROMPT, "max_new_tokens": 40, "stream": False}))
        finished = []
        poller = zmq.Poller()
        poller.register(a, zmq.POLLIN)
        poller.register(b, zmq.POLLIN)
        deadline = time.monotonic() + 120
        while len(finished) < 4 and time.monotonic() < deadline:
            for sock, _ in poller.poll(1000):
                reply = decode(sock.recv_multipart())
                assert reply.type == "done"
                finished.append((reply.id, time.monotonic()))
        order = [i for i, _ in finished]
        assert sorted(order) == [100, 101, 102, 200]
        assert order.index(200) <= 1
    finally:
        a.close(0)
        b.close(0)


def test_cancel_stops_a_running_request(address):
    sock = dealer(zmq.Context.instance(), address)
    try:
        sock.send_multipart(encode("generate", 7, {"token_ids": PROMPT, "max_new_tokens": 2000}))
        first = receive(sock, 7, time.monotonic() + 60)
        assert first.type == "chunk"
        sock.send_multipart(encode("cancel", 7, {}))
        reply = first
        while reply.type != "done":
            reply = receive(sock, 7, time.monotonic() + 60)
        assert reply["finish_reason"] == "cancelled" and len(reply["token_ids"]) < 2000
    finally:
        sock.close(0)


class NeverDrafts(NGramProposer):
    """Asked every step, drafts nothing, 20 ms a step: a plain decode that takes its time."""

    def propose(self, tokens, max_tokens):
        time.sleep(0.02)
        return EMPTY


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A daemon (in this process, two slots) whose answers never end before their length: no token
    is its model's end of text, and a step takes 20 ms, so 2,000 tokens take 40 s."""
    target = TargetModel(tiny_target("llama", seed=5).model, slots=2)
    target.eos_ids = frozenset()  # the tiny model's greedy answer ended after 48 tokens, 57 ms
    service = TargetService(target, [NeverDrafts(), NeverDrafts()], ServiceSettings(always_draft=True))
    address = f"ipc://{tmp_path_factory.mktemp('endless')}/target.sock"
    with serving_in_thread(service.serve, address):
        yield address


def test_a_client_closed_from_another_thread_cancels_every_stream_it_has_open(endless):
    """Two threads streamed on one TargetClient and a third closed it: one stream decoded on to its
    length, and ZeroMQ raised "Socket operation on non-socket" in a reader or in the close (an
    audit). Each stream now ends with the daemon's `done`, cancelled, and nothing raises."""
    ends, errors = [], []
    client = TargetClient(endless, timeout_s=60)
    reading = threading.Barrier(3)

    def read() -> None:
        try:
            stream = client.stream(token_ids=PROMPT, max_new_tokens=2000)
            first = next(stream)
            reading.wait(30)
            ends.append([first, *stream][-1])
        except Exception as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    reading.wait(30)
    client.close()
    for reader in readers:
        reader.join(30)
    assert errors == [] and len(ends) == 2, errors
    assert all(end.type == "done" and end["finish_reason"] == "cancelled" for end in ends), ends


def test_leaving_a_clients_with_block_cancels_the_stream_it_left_unread(endless):
    with TargetClient(endless, timeout_s=60) as client:
        stream = client.stream(token_ids=PROMPT, max_new_tokens=2000)
        assert next(stream).type == "chunk"
    end = list(stream)[-1]  # read on after the close: the cancel's `done`
    assert end.type == "done" and end["finish_reason"] == "cancelled"


def test_sampling_options_pass_through_the_daemon(model_dir, address):
    from protocol.sampling import SamplingParams
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import generate

    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    local = TargetModel.load(model_dir)
    want = generate(
        local, PROMPT, NGramProposer(), DecodeOptions(30, sampling=SamplingParams.from_dict(options))
    ).tokens
    client = TargetClient(address, timeout_s=60)
    got = [client.generate(token_ids=PROMPT, max_new_tokens=30, sampling=options)["token_ids"] for _ in range(2)]
    other = client.generate(token_ids=PROMPT, max_new_tokens=30, sampling=dict(options, seed=99))["token_ids"]
    client.close()
    assert got[0] == got[1] == want  # same seed, model and proposer: the same sample, remote or local
    assert other != want
    assert want != greedy(local, PROMPT, 30)


def test_a_request_longer_than_the_model_is_refused_before_any_work(address):
    client = TargetClient(address, timeout_s=60)
    try:
        began = time.monotonic()
        with pytest.raises(ProtocolError, match=r"\(2000 tokens\) plus max_new_tokens \(100\).*holds 2048") as err:
            client.generate(token_ids=[5] * 2000, max_new_tokens=100)
        assert err.value.code.value == "context_length" and time.monotonic() - began < 5
        # Over the model and over this daemon's own limit (4096) too: the model's bound is named.
        with pytest.raises(ProtocolError, match=r"plus max_new_tokens \(5000\).*holds 2048") as err:
            client.generate(token_ids=PROMPT, max_new_tokens=5000)
        assert err.value.code.value == "context_length"
        assert client.generate(token_ids=PROMPT, max_new_tokens=4)["finish_reason"] in ("length", "eos")
    finally:
        client.close()


def test_fit_context_cuts_the_answer_to_the_room_the_prompt_leaves(model_dir, address):
    """`fit_context` (what the HTTP front end sends for a request that names no limit): the answer
    ends at the model's last position, token for token the start of the uncut answer; a prompt
    that leaves no room is still refused."""
    prompt = [5 + i % 50 for i in range(2040)]
    want = greedy(TargetModel.load(model_dir), prompt, 8)
    client = TargetClient(address, timeout_s=120)
    try:
        done = client.generate(token_ids=prompt, max_new_tokens=100, fit_context=True)
        assert done["token_ids"] == want and (done["finish_reason"] == "length" or len(want) < 8)
        # Named by what it is: the client set no max_new_tokens, so the 100 is not its (an audit).
        with pytest.raises(ProtocolError, match=r"the prompt \(2048 tokens\) fills the model's 2048 positions") as err:
            client.generate(token_ids=[5] * 2048, max_new_tokens=100, fit_context=True)
        assert err.value.code.value == "context_length"
        short = client.generate(token_ids=PROMPT, max_new_tokens=4, fit_context=True)["token_ids"]
        assert len(short) <= 4  # a cap, never raised to the room left
    finally:
        client.close()


def test_a_new_token_limit_past_what_one_reply_carries_is_refused_at_start(capsys):
    """Else a request would be accepted, run to its end, and its `done` be refused by the wire."""
    from launch import target_daemon
    from protocol.messages import MAX_REPLY_TOKENS

    with pytest.raises(SystemExit):
        target_daemon.main(["--max-new-tokens-limit", str(MAX_REPLY_TOKENS + 1)])
    assert f"--max-new-tokens-limit must be in [1, {MAX_REPLY_TOKENS}]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_new_tokens_limit must be in"):
        ServiceSettings(max_new_tokens_limit=MAX_REPLY_TOKENS + 1)


def test_queue_limits_answer_busy_and_lose_nothing_accepted(model_dir, tmp_path):
    address = f"ipc://{tmp_path}/busy.sock"
    args = ["--model", str(model_dir), "--proposer", "none", "--max-queued-per-client", "2", "--max-queued", "3"]
    # One slot: the first request runs and two wait, however the six arrive across intakes (with
    # eight slots, requests read in a later intake found an empty queue and ran).
    args += ["--max-new-tokens-limit", "300", "--max-batch", "1"]
    with daemon("target daemon", "launch.target_daemon", address, args, 120):
        context = zmq.Context.instance()
        a, b = dealer(context, address), dealer(context, address)
        try:
            limited = TargetClient(address, timeout_s=60)
            with pytest.raises(ProtocolError, match="max_new_tokens 301 exceeds this daemon's limit 300"):
                limited.generate(token_ids=PROMPT, max_new_tokens=301)
            limited.close()
            request = {"token_ids": PROMPT, "max_new_tokens": 200, "stream": False}
            for i in range(6):
                a.send_multipart(encode("generate", 10 + i, request))
            replies = []
            while len(replies) < 6 and a.poll(120_000):
                replies.append(decode(a.recv_multipart()))
            assert sorted(r.id for r in replies) == list(range(10, 16))
            busy = [r for r in replies if r.type == "error"]
            assert len(busy) >= 3 and all(r["code"] == "busy" and "limit 2" in r["message"] for r in busy)
            want = greedy(TargetModel.load(model_dir), PROMPT, 200)
            assert all(r["token_ids"] == want for r in replies if r.type == "done")
            # Another client still gets in: the limit is per client first.
            b.send_multipart(encode("generate", 99, dict(request, max_new_tokens=5)))
            assert receive(b, 99, time.monotonic() + 120).type == "done"
        finally:
            a.close(0)
            b.close(0)


def test_a_request_that_arrives_during_a_step_counts_its_queue_time_from_its_arrival(tmp_path_factory, monkeypatch):
    """A request that came while a step computed waited in the server's hold until the step ended,
    and its clock started only then: behind a prompt's 512-row chunk, a first token 1.2 s after the
    request was reported as 0.12 s, queued 0.5 ms (an audit), and so in the TTFT and queue metrics.
    Held here through a step of known length, its queue time covers that step."""
    from target_node.drafting.proposers import NoProposer

    target = TargetModel(tiny_target("llama", seed=5).model, slots=2)
    service = TargetService(target, [NoProposer(), NoProposer()], ServiceSettings())
    stepping, release, advance = threading.Event(), threading.Event(), service.advance

    def held_once() -> None:
        if not stepping.is_set():
            stepping.set()
            release.wait(30)
        advance()

    monkeypatch.setattr(service, "advance", held_once)
    address = f"ipc://{tmp_path_factory.mktemp('held')}/target.sock"
    context = zmq.Context.instance()
    with serving_in_thread(service.serve, address):
        a, b = dealer(context, address), dealer(context, address)
        try:
            a.send_multipart(encode("generate", 1, {"token_ids": PROMPT, "max_new_tokens": 4, "stream": False}))
            assert stepping.wait(30)
            b.send_multipart(encode("generate", 2, {"token_ids": PROMPT, "max_new_tokens": 4, "stream": False}))
            deadline = time.monotonic() + 30
            while not service.server.held and time.monotonic() < deadline:  # B arrived, held by the helper
                time.sleep(0.005)
            arrived_by = time.monotonic()
            time.sleep(0.3)
            released_at = time.monotonic()
            release.set()
            done = receive(b, 2, time.monotonic() + 60, "generate")
            assert receive(a, 1, time.monotonic() + 60, "generate").type == "done"
        finally:
            release.set()
            a.close(0)
            b.close(0)
    assert done.type == "done", done
    assert done["stats"]["queued_s"] >= released_at - arrived_by - 0.001, done["stats"]
    assert service.metrics.queue.sum >= released_at - arrived_by - 0.001  # the queue-time metric too


def test_admission_takes_a_bounded_share_of_a_step_and_refuses_every_request_in_turn(monkeypatch):
    """Refused requests take no slot, so admission went on through the whole queue in one step:
    64 prompts of 512K characters, a second each to tokenize, stalled every running request for a
    minute (an audit). Now a step admits for ADMIT_BUDGET_S at most (one request at least), and the
    next steps go on where it stopped: every request is answered, in order."""
    from protocol.codec import Message
    from target_node.drafting.proposers import NoProposer
    from target_node.serving import daemon as daemon_module

    service = TargetService(TargetModel(tiny_target("llama", seed=5).model, slots=1), [NoProposer()], ServiceSettings())
    sent = []
    monkeypatch.setattr(service, "send", lambda identity, frames: sent.append(decode(frames).id))

    def slow_refusal(target, msg):
        time.sleep(0.1)  # a long prompt's tokenizing
        raise ProtocolError(ErrorCode.BAD_FIELD, "the prompt cannot be tokenized")

    monkeypatch.setattr(daemon_module, "prompt_ids", slow_refusal)
    monkeypatch.setattr(daemon_module, "ADMIT_BUDGET_S", 0.25)
    for i in range(1, 11):
        fields = {"prompt": "x", "token_ids": [], "hints": [], "messages": [], "stop": [], "max_new_tokens": 4}
        service.enqueue(b"client", Message("generate", i, fields))
    service.admit()
    assert 1 <= len(sent) <= 4, sent
    while service.pending():
        service.admit()
    assert sent == list(range(1, 11))


def test_the_queue_is_bounded_in_bytes_and_holds_prompts_compactly(tmp_path):
    """Requests queued behind a busy slot count by what they hold: 60,000-id prompts as 4-byte
    arrays (~235 KiB each, not ~2 MiB as Python ints), two of them under a 600 KiB bound."""
    from protocol.codec import Message
    from target_node.serving.daemon import compact

    fields = {"token_ids": list(range(60_000)), "hints": [1, 2], "prompt": "", "messages": [], "stop": []}
    msg = Message("generate", 1, fields)
    held = compact(msg)
    assert 240_000 < held < 242_000 and msg["token_ids"].itemsize == 4 and list(msg["token_ids"][:3]) == [0, 1, 2]
    address = f"ipc://{tmp_path}/bytes.sock"
    # The slot holder must outlast the three sends even on a loaded machine: room for 4,096 new
    # tokens (the daemon's own limit), still too few positions for a 60,000-token prompt.
    longer = tiny_target("llama", seed=5).model
    longer.config.max_position_embeddings = 50_000
    longer.save_pretrained(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--proposer", "none", "--max-batch", "1", "--max-queued-bytes", "600K"]
    with daemon("target daemon", "launch.target_daemon", address, args, 120):
        sock = dealer(zmq.Context.instance(), address)
        try:
            # Greedy from this prompt runs 4,096 tokens without the EOS (318), in fp32 and in bf16:
            # from PROMPT it ended at its 48th token, the slot came free before the three sends were
            # read on a loaded machine, and the third was queued and refused for its length (a flake).
            holder = [71, 294, 35, 133, 63, 256]
            sock.send_multipart(encode("generate", 1, {"token_ids": holder, "max_new_tokens": 4096}))
            assert receive(sock, 1, time.monotonic() + 60).type == "chunk"  # it holds the one slot
            big = {"token_ids": [7] * 60_000, "max_new_tokens": 4, "stream": False}
            for i in (2, 3, 4):
                sock.send_multipart(encode("generate", i, big))
            sock.send_multipart(encode("cancel", 1, {}))
            replies = {}
            while len(replies) < 3 and sock.poll(60_000):
                reply = decode(sock.recv_multipart())
                if reply.id != 1:
                    replies[reply.id] = reply
            assert replies[4].type == "error" and replies[4]["code"] == "busy"
            assert "queued requests hold 472 KiB, this one 236 KiB (limit 600 KiB)" in replies[4]["message"]
            # The two that fitted were queued, then refused at admission for the model's length.
            assert all(replies[i].type == "error" and replies[i]["code"] == "context_length" for i in (2, 3))
        finally:
            sock.close(0)


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "\U0001f600" * 32, "content": ""}] * 1024},
        {"messages": [{"role": "u", "content": ""}] * 1024, "stop": ["\U0001f600" * 256] * 16},
        {"messages": [{"role": "user", "content": "otter " * 4000}]},
        {"token_ids": [5] * 65536, "hints": [6] * 16384},
    ],
    ids=["odd roles", "stop strings", "long content", "ids"],
)
def test_a_queued_request_counts_at_least_what_it_holds(fields):
    """The queue's byte limit counts each request by compact(): a chat of 1,024 empty messages with
    long roles held 8x what it counted (an audit). Now the count covers what decoding it allocated:
    the memory still allocated from the protocol's and the daemon's code, where other threads of a
    full suite (whose allocations the process's total held too) allocate nothing meanwhile."""
    import gc
    import tracemalloc

    from target_node.serving.daemon import compact

    frames = [bytes(f) for f in encode("generate", 1, {"max_new_tokens": 1, **fields})]
    ours = [tracemalloc.Filter(True, "*/protocol/*"), tracemalloc.Filter(True, "*/target_node/serving/daemon.py")]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(ours)
        msg = decode(frames)
        counted = compact(msg)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(ours)
    finally:
        tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert msg.fields and held <= counted < 2 * held + 4096, (held, counted)


def test_concurrent_clients_are_batched_and_each_gets_its_output_alone(model_dir, address):
    """Six clients at once, prompts and lengths of their own, greedy and seeded-sampled, streamed or
    not: the daemon decodes them side by side, and each output is the same request decoded alone."""
    from protocol.sampling import SamplingParams
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import generate

    asks = []
    for i in range(6):
        prompt = [(7 * i + 3 * j) % 300 + 3 for j in range(4 + 5 * i)]
        sampling = {"temperature": 0.9, "top_k": 30, "seed": i} if i % 2 else {"temperature": 0.0}
        asks.append({"token_ids": prompt, "max_new_tokens": 20 + 7 * i, "sampling": sampling, "stream": i % 3 == 0})
    local = TargetModel.load(model_dir)
    want = [
        generate(
            local,
            a["token_ids"],
            NGramProposer(),
            DecodeOptions(a["max_new_tokens"], sampling=SamplingParams(**a["sampling"])),
        ).tokens
        for a in asks
    ]
    got, batches = [None] * len(asks), [0] * len(asks)

    def ask(i: int) -> None:
        client = TargetClient(address, timeout_s=120)
        try:
            done = client.generate(**asks[i])
            got[i], batches[i] = done["token_ids"], done["stats"]["batch"]
        finally:
            client.close()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert got == want
    assert max(batches) > 1  # they really ran side by side


def test_the_daemon_keeps_its_drafter_sessions_alive_busy_or_idle(tmp_path):
    """A draft daemon takes sessions only from targets it has not heard from: the target daemon's
    loop calls every slot's keepalive between steps and while idle (a remote backend pings when
    it has sent nothing for KEEPALIVE_S), so a slot free between requests keeps its session."""
    from target_node.drafting.proposers import NoProposer

    class Counting:  # a remote backend's keepalive, counted
        def __init__(self) -> None:
            self.calls, self.attached, self.counters = 0, True, {}

        def keepalive(self) -> None:
            self.calls += 1

    slots = [NoProposer(), NoProposer()]
    for proposer in slots:
        proposer.backend = Counting()
    settings = ServiceSettings(always_draft=True)
    service = TargetService(TargetModel(tiny_target("llama", seed=5).model, slots=2), slots, settings)
    address = f"ipc://{tmp_path}/keepalive.sock"
    with serving_in_thread(service.serve, address):
        time.sleep(0.5)  # idle: the loop wakes every 100 ms
        idle = [p.backend.calls for p in slots]
        client = TargetClient(address, timeout_s=60)
        client.generate(token_ids=PROMPT, max_new_tokens=40)  # one slot busy, the other free
        client.close()
    assert all(n >= 3 for n in idle), idle
    assert all(p.backend.calls >= idle[i] + 40 for i, p in enumerate(slots)), [p.backend.calls for p in slots]


def test_the_looked_up_branch_follows_the_proposer_and_the_flag():
    """Every greedy tree verifies the looked-up continuations (the context's, the datastore's), except
    where the daemon decodes plainly (`--proposer none`) or `--no-lookup` says so."""
    from protocol.sampling import SamplingParams
    from target_node.drafting.datastore import Datastore
    from target_node.drafting.proposers import NoProposer

    target = TargetModel(tiny_target("llama", seed=5).model, slots=1)
    msg = {"max_new_tokens": 8, "stop": [], "hints": [], "sampling": SamplingParams().to_dict()}
    cases = [(NoProposer(), ServiceSettings(), False), (NGramProposer(), ServiceSettings(), True)]
    cases.append((NGramProposer(), ServiceSettings(no_lookup=True), False))
    store = Datastore.build([[5, 6, 7]])
    for proposer, settings, lookup in cases:
        options = TargetService(target, [proposer], settings, datastore=store).decode_options(msg, 8)
        assert options.lookup is lookup and options.datastore is (store if lookup else None)
    from concurrent.futures import Future

    coming = Future()  # its index still being built: requests go without it, then with it
    service = TargetService(target, [NGramProposer()], ServiceSettings(always_draft=True), datastore=coming)
    assert service.decode_options(msg, 8).datastore is None
    coming.set_result(store)
    assert service.decode_options(msg, 8).datastore is store


def test_a_fitted_budget_is_cut_to_the_daemons_limit_and_an_explicit_one_is_not():
    """`fit_context` makes max_new_tokens a cap: under a --max-new-tokens-limit below the front
    end's default (512) a request that named no limit is cut to it, not refused; one that named
    its limit is still held to it."""
    from target_node.drafting.proposers import NoProposer
    from target_node.serving.requests import answer_budget

    target = TargetModel(tiny_target("llama", seed=5).model, slots=1)
    settings = ServiceSettings(max_new_tokens_limit=300)
    service = TargetService(target, [NoProposer()], settings)
    assert answer_budget(target, settings, {"max_new_tokens": 512, "fit_context": True}, 10) == 300
    assert answer_budget(target, settings, {"max_new_tokens": 512, "fit_context": True}, 2000) == 48
    explicit = {"max_new_tokens": 512, "fit_context": False, "stop": [], "hints": [], "sampling": {}}
    with pytest.raises(ProtocolError, match="exceeds this daemon's limit 300"):
        service.decode_options(explicit, answer_budget(target, settings, explicit, 10))


def test_an_answer_over_what_a_done_reply_holds_is_refused_alone(tmp_path, monkeypatch):
    """A `done` the wire refuses (a raised --max-new-tokens-limit and long tokens can make one over
    its 1 MiB) used to raise out of the daemon's loop and end it for every client. Now that request
    alone gets `too_large`, after its streamed chunks, and the daemon serves on. Here the wire's
    limit is lowered to 12 tokens a `done`, so a 20-token answer is over it."""
    from dataclasses import replace

    from protocol.fields import Int, List
    from protocol.messages import SCHEMAS
    from target_node.drafting.proposers import NoProposer

    done = SCHEMAS["done"]
    small = replace(done.fields, required={**done.fields.required, "token_ids": List(Int(0), 0, 12)})
    monkeypatch.setitem(SCHEMAS, "done", replace(done, fields=small))
    target = TargetModel(tiny_target("llama", seed=5).model, slots=2)
    want_20, want_10 = greedy(target, PROMPT, 20), greedy(target, PROMPT, 10)
    assert len(want_20) > 12
    service = TargetService(target, [NoProposer(), NoProposer()], ServiceSettings())
    address = f"ipc://{tmp_path}/done.sock"
    with serving_in_thread(service.serve, address):
        client = TargetClient(address, timeout_s=60)
        try:
            for stream in (False, True):
                chunks = []
                with pytest.raises(ProtocolError, match="over what one `done` reply carries") as refused:
                    for reply in client.stream(token_ids=PROMPT, max_new_tokens=20, stream=stream):
                        chunks += reply["token_ids"] if reply.type == "chunk" else []
                assert refused.value.code.value == "too_large"
                assert chunks == (want_20 if stream else [])
            # The daemon serves on.
            assert client.generate(token_ids=PROMPT, max_new_tokens=10)["token_ids"] == want_10
        finally:
            client.close()
    # The metrics count the two as refused, not as answered, and their tokens as decoded.
    metrics = service.metrics.to_dict()
    assert metrics["refused"] == {"too_large": 2} and metrics["requests"] == {"length": 1}, metrics
    assert metrics["generation_tokens"] == 20 + 20 + 10


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_daemon_that_goes_away_mid_request_is_noticed_in_seconds(model_dir, tmp_path, monkeypatch, how):
    """A daemon stopped (SIGTERM) while a request ran said nothing to its client, and one killed
    could say nothing: dflash-client waited out its whole timeout, 300 s by default (an audit).
    A stopping daemon now tells each unfinished request (unknown_request, as a restarted one
    tells their heartbeats); the client pings a silent daemon and gives up when it does not answer."""
    import signal

    import frontend.target_client as target_client

    monkeypatch.setattr(target_client, "QUIET_S", 1.0)
    monkeypatch.setattr(target_client, "PING_S", 2.0)  # a killed daemon's ping times out: 2 s, not 10
    address = f"ipc://{tmp_path}/going.sock"
    with daemon(
        "target daemon", "launch.target_daemon", address, ["--model", str(model_dir), "--proposer", "ngram"], 120
    ) as proc:
        client = TargetClient(address, timeout_s=60.0)
        stream = client.stream(token_ids=PROMPT, max_new_tokens=2000, stream=True)
        assert next(stream).type == "chunk"
        proc.send_signal(signal.SIGTERM if how == "stopped" else signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises((ProtocolError, TimeoutError)) as caught:
            for _ in stream:
                pass
        assert time.monotonic() - began < 15
        if how == "stopped":
            assert caught.value.code == ErrorCode.UNKNOWN_REQUEST and "shutting down" in str(caught.value)
            assert proc.wait(10) == 0
        else:
            assert "stopped answering" in str(caught.value)


def test_a_request_that_arrives_during_the_last_step_is_told_the_daemon_stops(model_dir, tmp_path):
    """A request taken in by the answering helper during the step the daemon stopped after was
    never read, so it got no reply at all: its client waited for its liveness ping to fail."""
    from target_node.drafting.proposers import NoProposer

    service = TargetService(TargetModel.load(model_dir), [NoProposer(), NoProposer()], ServiceSettings())
    stop, armed, stepping = threading.Event(), threading.Event(), threading.Event()
    advance = service.advance

    def last_step() -> None:  # once armed, the step during which the second request arrives, then the stop
        if armed.is_set():
            stepping.set()  # the second request is sent now, so the answering helper takes it in
            deadline = time.monotonic() + 30
            while not service.server.held and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()
        advance()

    service.advance = last_step
    address = f"ipc://{tmp_path}/stopping.sock"
    thread = threading.Thread(target=service.serve, args=(address, stop))
    thread.start()
    first, second = TargetClient(address, timeout_s=30), TargetClient(address, timeout_s=30)
    try:
        running = first.stream(token_ids=PROMPT, max_new_tokens=2000, stream=True)
        assert next(running).type == "chunk"  # the first request runs
        armed.set()
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                assert stepping.wait(30)
                second.generate(token_ids=PROMPT, max_new_tokens=4)
            except BaseException as exc:  # the assertion reads it
                errors.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        with pytest.raises(ProtocolError, match="shutting down"):
            for _ in running:
                pass
        asker.join(20)
        assert not asker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ProtocolError), errors
        assert errors[0].code == ErrorCode.UNKNOWN_REQUEST and "shutting down" in str(errors[0])
    finally:
        stop.set()
        thread.join(20)
        first.close()
        second.close()


def test_clients_that_queue_cancel_and_leave_leave_no_entry_behind(model_dir, tmp_path):
    """With the slot busy, each client that queued a request, cancelled it and left kept an empty
    queue until the slot freed: 3,000 of them, 3,000 entries, each walked by every message (an
    audit). A queue that empties by a cancel goes."""
    from target_node.drafting.proposers import NoProposer

    service = TargetService(TargetModel.load(model_dir, slots=1), [NoProposer()], ServiceSettings())
    advance = service.advance

    def slow_step() -> None:  # the holder must outlast the clients
        time.sleep(0.01)
        advance()

    service.advance = slow_step
    address = f"ipc://{tmp_path}/queues.sock"
    context = zmq.Context.instance()
    entries = []
    with serving_in_thread(service.serve, address):
        holder = dealer(context, address)
        holder.send_multipart(encode("generate", 1, {"token_ids": PROMPT, "max_new_tokens": 2000}))
        assert receive(holder, 1, time.monotonic() + 60).type == "chunk"
        for i in range(40):
            sock = dealer(context, address)
            sock.send_multipart(encode("generate", 10 + i, {"token_ids": PROMPT, "max_new_tokens": 8}))
            sock.send_multipart(encode("cancel", 10 + i, {}))
            reply = receive(sock, 10 + i, time.monotonic() + 60)
            assert reply.type == "done" and reply["finish_reason"] == "cancelled"
            sock.close(0)
            entries.append(len(service.queues))
        holder.send_multipart(encode("cancel", 1, {}))
        holder.close(0)
    assert max(entries) <= 1, entries  # each client's own, at most, while it waits
