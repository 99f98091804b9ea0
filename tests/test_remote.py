"""Target and drafter in separate processes, over real ZeroMQ sockets."""

import os
import signal
import threading
import time

import pytest
import torch
from helpers import (
    assert_lossless,
    draft_daemon,
    free_tcp_address,
    greedy,
    send_until_refused,
    serving_in_thread,
    tiny_target,
)

from draft_node.checkpoint import config_for_target, load_drafter, random_drafter, save_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer
from target_node.drafting.remote import DrafterMismatch, LinkTiming, Reachability, RemoteDraftBackend

PROMPTS = [[5, 17, 42, 99, 3, 7], [200, 11, 11, 11, 250, 12, 13, 14]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4)


@pytest.fixture(scope="module")
def checkpoint(target, tmp_path_factory):
    cfg = config_for_target(target.config, block_size=8, taps=3)
    return save_drafter(random_drafter(cfg, seed=1, std=0.1), tmp_path_factory.mktemp("drafter"))


@pytest.fixture(params=["ipc", "tcp"])
def address(request, tmp_path):
    return f"ipc://{tmp_path}/draft.sock" if request.param == "ipc" else free_tcp_address()


def test_remote_equals_local_equals_greedy(target, checkpoint, address):
    local = DFlashProposer(LocalDraftBackend(load_drafter(checkpoint)))
    with draft_daemon(address, checkpoint):
        backend = RemoteDraftBackend(address, target)
        remote = DFlashProposer(backend)
        for prompt in PROMPTS:
            want = greedy(target, prompt, MAX_NEW)
            # adaptive=False: the same steps in both runs, so their histograms can be compared.
            local_result = generate(target, prompt, local, DecodeOptions(MAX_NEW, adaptive=False))
            remote_result = generate(target, prompt, remote, DecodeOptions(MAX_NEW, adaptive=False))
            assert_lossless(target, prompt, local_result.tokens, want)
            assert remote_result.tokens == local_result.tokens
            # fp32 on the wire: the remote drafter proposes exactly what the local one does.
            assert remote_result.stats.histogram == local_result.stats.histogram
            assert remote_result.stats.sources == {
                "dflash": remote_result.stats.steps - remote_result.stats.plain_steps
            }
        assert backend.counters["timeouts"] == 0 and backend.counters["round_trips"] > 10
        backend.close()


def test_a_batch_of_remote_sessions_drafts_each_as_alone(target, checkpoint, tmp_path):
    """Requests stepping together send their proposes first and then take the replies, so the
    step waits for about one round trip; each session drafts what it would alone, exactly."""
    from target_node.decoding.sequence import Sequence, step
    from target_node.model.target import TargetModel

    batch = TargetModel(target.model, slots=3)
    address = f"ipc://{tmp_path}/draft.sock"
    prompts = [*PROMPTS, [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    local = DFlashProposer(LocalDraftBackend(load_drafter(checkpoint)))
    alone = [generate(batch, p, local, DecodeOptions(MAX_NEW, adaptive=False)) for p in prompts]
    with draft_daemon(address, checkpoint):
        backends = [RemoteDraftBackend(address, batch) for _ in prompts]
        sequences = [
            Sequence(batch, p, DFlashProposer(b), DecodeOptions(MAX_NEW, adaptive=False), slot=slot)
            for slot, (p, b) in enumerate(zip(prompts, backends, strict=True))
        ]
        while not all(seq.done for seq in sequences):
            step(batch, [seq for seq in sequences if not seq.done])
        for seq, want, backend in zip(sequences, alone, backends, strict=True):
            got = seq.result()
            assert got.tokens == want.tokens and got.stats.histogram == want.stats.histogram
            counters = backend.counters
            assert counters["sent_ahead"] == counters["proposals"] > 5 and counters["timeouts"] == 0
            backend.close()


def noise_block(target, cfg, g):
    """[last_tok's embedding (random here), MASK, ...]: rows 1.. are what the daemon holds since open."""
    mask = target.embed([cfg.mask_token_id])
    return torch.cat([torch.randn(1, cfg.hidden_size, generator=g), mask.expand(cfg.block_size - 1, -1)])


def test_remote_hidden_states_equal_in_process_drafter(target, checkpoint, tmp_path):
    address = f"ipc://{tmp_path}/d.sock"
    drafter = load_drafter(checkpoint)
    cfg = drafter.config
    g = torch.Generator().manual_seed(0)
    features = torch.randn(30, cfg.feature_width, generator=g)
    with draft_daemon(address, checkpoint):
        remote = RemoteDraftBackend(address, target)
        local = LocalDraftBackend(drafter)
        for backend in (remote, local):
            backend.reset(0)
        for start, end in [(0, 12), (12, 13), (13, 20), (17, 25)]:  # the last one rewinds
            noise = noise_block(target, cfg, g)
            got, _ = remote.draft(start, features[start:end], noise, end, cfg.block_size - 1)
            want, _ = local.draft(start, features[start:end], noise, end, cfg.block_size - 1)
            assert torch.equal(got, want)
        # The reply carries only the rows the target asked for.
        assert remote.draft(25, features[25:26], noise, 26, 3)[0].shape == (3, cfg.hidden_size)
        remote.close()


def test_two_targets_share_one_draft_daemon(checkpoint, tmp_path):
    address = f"ipc://{tmp_path}/shared.sock"
    targets = [tiny_target("qwen3", seed=4), tiny_target("qwen3", seed=4)]
    results, errors = {}, []

    def worker(i):
        try:
            backend = RemoteDraftBackend(address, targets[i], name=f"session-{i}")
            proposer = DFlashProposer(backend)
            prompt = PROMPTS[i]
            result = generate(targets[i], prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False))
            results[i] = (result, greedy(targets[i], prompt, MAX_NEW))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    with draft_daemon(address, checkpoint):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    for i in range(2):
        result, want = results[i]
        assert_lossless(targets[i], PROMPTS[i], result.tokens, want)
        assert result.stats.sources["dflash"] > 0


def test_daemon_killed_mid_generation_then_restarted(target, checkpoint, tmp_path):
    address = f"ipc://{tmp_path}/dying.sock"
    prompt = PROMPTS[1]
    want = greedy(target, prompt, MAX_NEW)
    with draft_daemon(address, checkpoint) as proc:
        backend = RemoteDraftBackend(
            address, target, timing=LinkTiming(timeout_s=1.0, probe_timeout_s=0.2, retry_s=60.0)
        )
        proposer = DFlashProposer(backend, NGramProposer())
        seen = []

        def kill_after_a_few(tokens, text):
            seen.extend(tokens)
            if len(seen) >= 8 and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

        result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False), on_commit=kill_after_a_few)
    assert_lossless(target, prompt, result.tokens, want)
    assert result.stats.sources["dflash"] > 0 and backend.counters["timeouts"] >= 1
    assert result.stats.steps > result.stats.sources["dflash"]  # the rest ran on the fallback
    with draft_daemon(address, checkpoint):  # restarted: the next request drafts remotely again
        result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False))
        assert_lossless(target, prompt, result.tokens, want)
        assert result.stats.sources == {"dflash": result.stats.steps - result.stats.plain_steps}
    backend.close()


def test_handshake_refuses_a_drafter_for_another_target(checkpoint, tmp_path):
    address = f"ipc://{tmp_path}/other.sock"
    other = tiny_target("llama", seed=0, layers=6)
    with draft_daemon(address, checkpoint):
        with pytest.raises(DrafterMismatch, match="layer count"):
            RemoteDraftBackend(address, other)


@pytest.mark.parametrize("ahead", [1, -1])
def test_a_draft_daemon_of_another_protocol_version_is_a_misfit_not_a_daemon_away(target, tmp_path, ahead):
    """A daemon a version ahead or behind answers `hello` with `bad_version` in its own envelope.
    That counted as a daemon away: the target started, logged "no drafter answered yet", and
    said hello again at every request's start for ever (an audit). It is now refused at start,
    as a drafter for another target is."""
    import msgpack
    import zmq

    from protocol import PROTOCOL_VERSION

    address, stop, heard = f"ipc://{tmp_path}/other_version.sock", threading.Event(), []
    daemon = zmq.Context.instance().socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind(address)

    def answer():
        while not stop.is_set():
            if daemon.poll(50):
                identity, head, *_ = daemon.recv_multipart()
                request = msgpack.unpackb(head)
                heard.append(request["type"])
                reply = {"v": PROTOCOL_VERSION + ahead, "type": "error", "id": request["id"], "tensors": []}
                daemon.send_multipart([identity, msgpack.packb({**reply, "code": "bad_version", "message": "v"})])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(DrafterMismatch, match=f"another protocol.*v={PROTOCOL_VERSION + ahead}"):
            RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=2.0))
    finally:
        stop.set()
        thread.join()
        daemon.close(0)
    assert heard == ["hello"]


def test_a_target_started_before_its_drafter_picks_it_up(target, checkpoint, tmp_path):
    """No daemon yet: requests run exactly on the fallback. Once it answers, the next request drafts."""
    address = f"ipc://{tmp_path}/late.sock"
    prompt = PROMPTS[1]
    want = greedy(target, prompt, MAX_NEW)
    backend = RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=0.3))
    proposer = DFlashProposer(backend, NGramProposer())
    early = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False))
    assert backend.info is None and "dflash" not in early.stats.sources
    assert_lossless(target, prompt, early.tokens, want)
    with draft_daemon(address, checkpoint):
        late = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False))
    backend.close()
    assert_lossless(target, prompt, late.tokens, want)
    assert late.stats.sources == {"dflash": late.stats.steps - late.stats.plain_steps}


def test_a_targets_slots_probe_an_absent_daemon_once_at_start(target, checkpoint, tmp_path):
    """Each of a target's slots waited out its own hello to a daemon not there yet: its start was
    late by the reply timeout once per slot (18 s at 8 slots, an audit). One probe speaks for all
    until the retry; then each slot attaches at its next request."""
    address = f"ipc://{tmp_path}/absent.sock"
    reach, timing = Reachability(), LinkTiming(timeout_s=0.3, retry_s=0.2)
    backends = [RemoteDraftBackend(address, target, timing=timing, reach=reach) for _ in range(8)]
    assert [b.counters["timeouts"] for b in backends] == [1] + [0] * 7 and all(b.info is None for b in backends)
    prompt = PROMPTS[1]
    with draft_daemon(address, checkpoint):
        time.sleep(0.2)  # past the retry
        late = generate(
            target, prompt, DFlashProposer(backends[5], NGramProposer()), DecodeOptions(MAX_NEW, adaptive=False)
        )
    for backend in backends:
        backend.close()
    assert_lossless(target, prompt, late.tokens, greedy(target, prompt, MAX_NEW))
    assert late.stats.sources == {"dflash": late.stats.steps - late.stats.plain_steps}


def test_a_daemon_one_slot_found_silent_is_gone_for_every_slot(target, checkpoint, tmp_path, caplog):
    """Slots still attached when another found the daemon silent each waited out a propose's full
    timeout at their next step, one after another (2 s a slot), and the metrics called the drafter
    reachable throughout (an audit). Now a slot attached before the silence probes the daemon
    briefly, as a slot that never attached does, and none counts as attached."""
    from target_node.serving.metrics import drafter_state

    address = f"ipc://{tmp_path}/silent.sock"
    prompt = PROMPTS[1]
    reach, timing = Reachability(), LinkTiming(timeout_s=2.0, probe_timeout_s=0.2, retry_s=60.0)
    with draft_daemon(address, checkpoint) as daemon:
        proposers = [
            DFlashProposer(RemoteDraftBackend(address, target, timing=timing, reach=reach), NGramProposer())
            for _ in range(3)
        ]
        assert drafter_state(proposers)["slots_attached"] == 3
        daemon.send_signal(signal.SIGSTOP)
        try:
            results = [generate(target, prompt, p, DecodeOptions(MAX_NEW, adaptive=False)) for p in proposers]
        finally:
            daemon.send_signal(signal.SIGCONT)
        state = drafter_state(proposers)
        for proposer in proposers:
            proposer.backend.close()
    want = greedy(target, prompt, MAX_NEW)
    for result in results:
        assert_lossless(target, prompt, result.tokens, want)
    silences = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(silences) == 3 and "timed out after 2.00 s" in silences[0], silences
    assert all("hello timed out after 0.20 s" in line for line in silences[1:]), silences
    assert state["reachable"] is False and state["slots_attached"] == 0 and state["timeouts"] == 3


def test_a_probe_unanswered_leaves_the_attached_slots_attached(target, checkpoint, tmp_path):
    """A slot's short probe (hello, 0.25 s) unanswered by a daemon busy for a moment is no news of
    the daemon: counted as a silence, it detached every healthy slot, dropped the proposes they
    had sent and stopped their drafting for retry_s (a review)."""
    address = f"ipc://{tmp_path}/busy.sock"
    reach, timing = Reachability(), LinkTiming(timeout_s=2.0, probe_timeout_s=0.2, retry_s=60.0)
    with draft_daemon(address, checkpoint) as daemon:
        healthy = RemoteDraftBackend(address, target, timing=timing, reach=reach)
        probing = RemoteDraftBackend(address, target, timing=timing, reach=reach)
        probing.close()  # a slot whose session is gone (evicted, refused): it probes
        daemon.send_signal(signal.SIGSTOP)
        try:
            probing.begin_request()
        finally:
            daemon.send_signal(signal.SIGCONT)
        assert probing.counters["timeouts"] == 1 and not probing.attached
        assert healthy.attached
        healthy.ensure()  # no DrafterUnavailable: it drafts on
        healthy.close()


def test_a_drafter_restarted_with_another_checkpoint_is_a_new_drafter(target, checkpoint, tmp_path, caplog):
    """Restarted with another config: the request that notices finishes on the fallback, the next one
    drafts with a bridge rebuilt for it. Restarted with a drafter for another target: one log line,
    and the fallback drafts; never an error for the client."""
    address = f"ipc://{tmp_path}/swap.sock"
    prompt = PROMPTS[1]
    want = greedy(target, prompt, MAX_NEW)
    smaller = config_for_target(target.config, block_size=4, taps=2)
    other = save_drafter(random_drafter(smaller, seed=3, std=0.1), tmp_path / "other")
    foreign = config_for_target(tiny_target("llama", seed=0, layers=6).config, block_size=4)
    unfit = save_drafter(random_drafter(foreign, seed=3), tmp_path / "unfit")
    results, proposer = [], None
    for folder, requests in ((checkpoint, 1), (other, 2), (unfit, 2)):
        with draft_daemon(address, folder):
            if proposer is None:
                backend = RemoteDraftBackend(
                    address, target, timing=LinkTiming(timeout_s=1.0, probe_timeout_s=0.3, retry_s=60.0)
                )
                proposer = DFlashProposer(backend, NGramProposer())
            for _ in range(requests):
                results.append(
                    (generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False)), proposer.drafting)
                )
    backend.close()
    for result, _ in results:
        assert_lossless(target, prompt, result.tokens, want)
    (first, bridge), (noticed, _), (rebuilt, new_bridge), (unfit_noticed, _), (unfit_next, none) = results
    assert bridge.block_size == 8 and new_bridge.block_size == 4 and new_bridge is not bridge
    assert rebuilt.stats.sources == {"dflash": rebuilt.stats.steps - rebuilt.stats.plain_steps}
    assert "dflash" not in unfit_next.stats.sources and none is None
    assert backend.counters["changes"] == 1
    unfit_lines = [r for r in caplog.records if "does not fit this target" in r.getMessage()]
    assert len(unfit_lines) == 1, [r.getMessage() for r in unfit_lines]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_reduced_precision_wire_is_close_and_still_lossless(target, checkpoint, tmp_path, wire):
    address = f"ipc://{tmp_path}/{wire}.sock"
    drafter = load_drafter(checkpoint)
    cfg = drafter.config
    g = torch.Generator().manual_seed(1)
    features = torch.randn(12, cfg.feature_width, generator=g)
    noise = noise_block(target, cfg, g)
    with draft_daemon(address, checkpoint):
        remote = RemoteDraftBackend(address, target, wire_dtype=wire)
        assert remote.wire_dtype == wire
        remote.reset(0)
        got, _ = remote.draft(0, features, noise, 12, cfg.block_size - 1)
        local = LocalDraftBackend(drafter)
        want, _ = local.draft(0, features, noise, 12, cfg.block_size - 1)
        assert got.dtype == getattr(torch, wire) and not torch.equal(got.float(), want)
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
        half_bytes = remote.counters["bytes_out"]
        prompt = PROMPTS[0]
        result = generate(target, prompt, DFlashProposer(remote), DecodeOptions(MAX_NEW, adaptive=False))
        assert_lossless(target, prompt, result.tokens, greedy(target, prompt, MAX_NEW))
        remote.close()
    assert half_bytes < features.numel() * 4  # the features really travelled at 2 bytes each


def _in_process_daemon(service, address):
    """`service` served on `address` from a thread of this process: for a daemon made to misbehave."""
    from draft_node.daemon import serve

    return serving_in_thread(lambda where, stop: serve(service, where, stop), address)


def test_a_drafter_claiming_a_ring_of_two_to_the_forty_is_refused_and_the_target_drafts_without_it(
    target, checkpoint, tmp_path
):
    """The target sized each slot's feature ring by the drafter's word: a ring of 2**40 positions
    failed every request at its start (as `internal`), and never fell back. Now it is a misfit."""
    from draft_node.daemon import DraftService
    from draft_node.settings import DraftSettings

    class Claiming(DraftService):
        @property
        def info(self) -> dict:
            return {**super().info, "ring_capacity": 2**40}

    address = f"ipc://{tmp_path}/claiming.sock"
    # Started before the daemon (it is picked up once it answers), so the misfit meets a running target.
    backend = RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=5.0, probe_timeout_s=0.2, retry_s=0.0))
    with _in_process_daemon(Claiming(load_drafter(checkpoint), DraftSettings(ring_capacity=512)), address):
        with pytest.raises(DrafterMismatch, match="ring capacity 1099511627776 is over"):  # at a daemon's start
            RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=5.0))
        result = generate(target, PROMPTS[0], DFlashProposer(backend, NGramProposer()), DecodeOptions(MAX_NEW))
    backend.close()
    assert result.tokens == greedy(target, PROMPTS[0], MAX_NEW)
    assert "dflash" not in result.stats.sources and backend.unfit is not None


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_finite_but_huge_drafted_rows_are_a_miss_not_a_failed_step(target, checkpoint, tmp_path, sampled):
    """Rows of +-3e38 passed the NaN/Inf check, then overflowed in the target's head: a sampled
    step's softmax turned NaN and `multinomial` failed every request in the batch. Now rows over
    MAX_MAGNITUDE are refused like NaN ones, and the step drafts without them."""
    from draft_node.daemon import DraftService
    from draft_node.settings import DraftSettings
    from protocol.sampling import SamplingParams

    class Shouting(DraftService):
        def _proposal(self, msg, session, step, hidden, gate, draft_ms, predrafted=False):
            loud = hidden.float().sign() * 3e38
            return super()._proposal(msg, session, step, loud, gate, draft_ms, predrafted)

    sampling = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams()
    address = f"ipc://{tmp_path}/shouting.sock"
    with _in_process_daemon(Shouting(load_drafter(checkpoint), DraftSettings(ring_capacity=512)), address):
        backend = RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=5.0, retry_s=0.0))
        options = DecodeOptions(MAX_NEW, sampling=sampling, stop_on_eos=False)
        result = generate(target, PROMPTS[0], DFlashProposer(backend, NGramProposer()), options)
        backend.close()
    assert len(result.tokens) == MAX_NEW and backend.counters["errors"] > 0
    if not sampled:
        assert result.tokens == greedy(target, PROMPTS[0], MAX_NEW, stop_on_eos=False)


def test_keepalive_pongs_nobody_reads_never_crowd_out_a_reply(target, checkpoint, tmp_path):
    """A keepalive's pong is read by nobody: they piled up in the slot's read-ahead queue until,
    after hours idle, the daemon's reply to the next request found no room and timed out (an
    audit: 2,500 keepalives on ipc, 7 hours). Each keepalive now drops what waits unread first."""
    from draft_node.daemon import DraftService
    from draft_node.settings import DraftSettings
    from target_node.drafting.remote import REPLY_QUEUE

    address = f"ipc://{tmp_path}/idle.sock"
    with _in_process_daemon(DraftService(load_drafter(checkpoint), DraftSettings(ring_capacity=512)), address):
        backend = RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=2.0, retry_s=0.0, keepalive_s=0.0))
        try:
            for i in range(4000):  # ~11 hours of keepalives, in a second or two
                backend.keepalive()
                if i % 100 == 0:
                    time.sleep(0.01)  # the daemon answers as it would over hours
            time.sleep(0.5)
            backend.reset(0)
            assert backend.counters["timeouts"] == 0 and backend.client.receive_queue == REPLY_QUEUE
        finally:
            backend.close()


def test_a_draft_daemon_pushing_unasked_replies_makes_the_target_hold_only_its_queue(tmp_path):
    """A draft daemon (buggy or hostile) that pushes replies nobody asked for: ZeroMQ read up to
    1000 of them ahead per slot, of up to 256 MiB each (400 of 4 MB grew the target by 1.6 GB, an
    audit). The drafter's client now reads REPLY_QUEUE ahead, frames of at most REPLY_FRAME; past
    them the daemon's sends wait (refused here, where it asks not to block)."""
    import zmq

    from protocol import encode
    from protocol.transport import FRAME_OVERHEAD, Client
    from target_node.drafting.remote import REPLY_FRAME, REPLY_QUEUE

    address = f"ipc://{tmp_path}/pushing.sock"
    daemon = zmq.Context.instance().socket(zmq.ROUTER)
    daemon.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer refuses, rather than drops, what is sent
    daemon.setsockopt(zmq.SNDHWM, 1)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind(address)
    client = Client(address, max_message_bytes=REPLY_FRAME + FRAME_OVERHEAD, receive_queue=REPLY_QUEUE)
    try:
        client.send("ping", {})
        assert daemon.poll(2000)
        identity = daemon.recv_multipart()[0]
        junk = [identity, *encode("pong", 999, {"time": 0.0, "sessions": 0, "pid": 1}), b"x" * (1 << 20)]
        sent = send_until_refused(daemon, junk, most=400)
        assert 1 <= sent <= REPLY_QUEUE + 6, sent  # the queue, the daemon's one, what socket buffers hold
        assert client.discard_waiting() > 0
    finally:
        client.close()
        daemon.close(0)


def test_a_stopped_target_closes_its_sessions_so_one_restarted_at_once_drafts(target, checkpoint, tmp_path):
    """A target daemon stopped left its slots' sessions open on the draft daemon until its reclaim
    (30 s, when the table is full) or the idle timeout (600 s): one restarted at once, with the
    table full, was refused every session and served without drafts (an audit)."""
    from frontend.target_client import TargetClient
    from launch.local import daemon
    from target_node.drafting.factory import ProposerSettings, build_proposers
    from target_node.serving.daemon import TargetService
    from target_node.serving.settings import ServiceSettings

    drafter = f"ipc://{tmp_path}/draft.sock"
    args = ["--checkpoint", str(checkpoint), "--threads", "1", "--dtype", "float32", "--max-sessions", "1"]
    with daemon("draft daemon", "launch.draft_daemon", drafter, args, 60):
        for run in range(2):
            one_slot = tiny_target("qwen3", seed=4)
            proposers = build_proposers(ProposerSettings("remote", drafter), one_slot, 1)
            service = TargetService(one_slot, proposers, ServiceSettings(always_draft=True))
            address = f"ipc://{tmp_path}/target-{run}.sock"
            with serving_in_thread(service.serve, address):
                client = TargetClient(address, timeout_s=60)
                try:
                    done = client.generate(token_ids=PROMPTS[0], max_new_tokens=MAX_NEW)
                finally:
                    client.close()
            assert done["stats"]["sources"].get("dflash", 0) > 0, (run, done["stats"]["sources"])


def test_a_target_that_drafted_is_freed_with_its_draft_head():
    """The draft heads kept per target held their target: every target that drafted stayed alive
    (on a GPU, its memory too) after its last user let it go (an audit)."""
    import gc
    import weakref

    from target_node.drafting.bridge import draft_head
    from target_node.model.tiny import tiny_target

    target = tiny_target("llama", engine=False)
    head = draft_head(target, ())
    assert head.compact(torch.zeros(1, target.config.hidden_size)).shape == (1, target.vocab_size)
    gone = weakref.ref(target)
    del target, head
    gc.collect()
    assert gone() is None
