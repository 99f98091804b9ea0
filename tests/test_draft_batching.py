"""Sessions drafted together: each gets the bits of its step drafted alone.

A draft daemon drafts the proposes that arrive together in one pass (draft_node/kv_cache.py's
`propose`). That must change nothing a target can see: a seeded sampled request's output
depends on its drafts, and it must not depend on who else the daemon served that step.
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path

import pytest
import torch
from helpers import drafter_config

import dflash_kernels
from dflash_kernels import row_blocks
from draft_node import daemon as draft_daemon
from draft_node.checkpoint import load_drafter, random_drafter
from draft_node.config import FULL, SLIDING, in_dflash2
from draft_node.daemon import DraftService
from draft_node.kv_cache import DraftKVCache, DraftStep, OutOfOrderError, drafts_alone_in_one_pass, propose
from draft_node.settings import DraftSettings
from protocol import ErrorCode, Message, ProtocolError, decode, encode

SHIPPED = Path(__file__).resolve().parent.parent / "drafters" / "smollm2"


def _drafter(kind: str, dtype: torch.dtype):
    if kind == "shipped":  # the real checkpoint: real widths, where kernels pick their paths
        return load_drafter(SHIPPED, "cpu", dtype)
    cfg = drafter_config(block_size=4, layer_types=(FULL, SLIDING), sliding_window=6)
    if kind == "dflash2":
        cfg = in_dflash2(cfg, vocab_size=50, rank=8, top_k=4)
    return random_drafter(cfg, seed=3, std=0.3).to(dtype)


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["shipped", "tiny", "dflash2"])
def test_sessions_drafted_together_get_the_bits_of_each_alone(kind, dtype, path, monkeypatch):
    """path "torch": torch's matmul and norms in fixed row blocks, as on a GPU or a CPU without
    a compiler (torch's fp32 matmul over the pass's rows at once fails this test here)."""
    if path == "torch":
        monkeypatch.setattr(dflash_kernels, "available", lambda: False)
    elif not dflash_kernels.available():
        pytest.skip("no CPU kernels on this machine (no compiler)")
    drafter = _drafter(kind, dtype)
    assert drafts_alone_in_one_pass(drafter)  # the daemon's load check agrees
    cfg = drafter.config
    g = torch.Generator().manual_seed(0)
    capacity = 40
    contexts = [0, 3, 17, 39, 60]  # empty, short, long, full, wrapped
    alone = [DraftKVCache(drafter, capacity) for _ in contexts]
    for cache, n in zip(alone, contexts, strict=True):
        cache.append(0, torch.randn(n, cfg.feature_width, generator=g).to(dtype))
    together = [copy.deepcopy(cache) for cache in alone]
    for round_ in range(4):
        steps = []
        for i, cache in enumerate(alone):
            back = (i + round_) % 3  # rows resent after a rollback, or none
            start = max(0, cache.length - back)
            new = (i * 3 + round_) % (cfg.block_size + 1)  # 0 .. block_size new rows
            features = torch.randn(cache.length - start + new, cfg.feature_width, generator=g).to(dtype)
            noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g).to(dtype)
            steps.append((start, features, noise, 1 + (i + round_) % (cfg.block_size - 1)))
        want = [propose([DraftStep(c, *step)])[0] for c, step in zip(alone, steps, strict=True)]
        got = propose([DraftStep(c, *step) for c, step in zip(together, steps, strict=True)])
        for (h_want, g_want), (h_got, g_got) in zip(want, got, strict=True):
            assert torch.equal(h_got, h_want)
            assert (g_want is None and g_got is None) or torch.equal(g_got, g_want)
        for a, b in zip(alone, together, strict=True):
            assert a.length == b.length and torch.equal(a.positions, b.positions)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_step_out_of_order_changes_no_session():
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    caches = [DraftKVCache(drafter, 16) for _ in range(2)]
    for cache in caches:
        cache.append(0, torch.randn(5, cfg.feature_width))
    before = copy.deepcopy(caches)
    noise = torch.randn(cfg.block_size, cfg.hidden_size)
    steps = [DraftStep(caches[0], 5, torch.randn(1, cfg.feature_width), noise, 2)]
    steps.append(DraftStep(caches[1], 7, torch.randn(1, cfg.feature_width), noise, 2))  # a hole at 5, 6
    with pytest.raises(OutOfOrderError):
        propose(steps)
    for a, b in zip(before, caches, strict=True):
        assert a.length == b.length and torch.equal(a.keys, b.keys)
    with pytest.raises(ValueError, match="two steps of one session"):
        propose([steps[0], DraftStep(caches[0], 6, torch.randn(0, cfg.feature_width), noise, 2)])


def _request(type_, fields, tensors=None, peer="p", request_id=1):
    msg = decode(encode(type_, request_id, fields, tensors))
    msg.peer = peer
    return msg


def test_the_service_drafts_a_burst_together_and_answers_each_as_alone():
    """handle_all: proposes of distinct sessions in one pass, the rest in arrival order (heavy ones
    last), a bad propose answered with its error while the others of its burst are drafted."""
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    alone, together = (
        DraftService(drafter, DraftSettings(ring_capacity=32)),
        DraftService(drafter, DraftSettings(ring_capacity=32)),
    )
    mask = torch.randn(1, cfg.hidden_size)
    g = torch.Generator().manual_seed(1)
    burst = []
    for i in range(4):
        for service in (alone, together):
            service.handle(_request("open", {"session": f"s{i}"}, {"mask": mask}, request_id=100 + i))
        n = 3 + 2 * i
        tensors = {"features": torch.randn(n, cfg.feature_width, generator=g), "noise": torch.randn(1, cfg.hidden_size)}
        fields = {"session": f"s{i}", "start": 0, "position": n, "rows": 2}
        burst.append(_request("propose", fields, tensors, request_id=i))
    burst.insert(2, _request("ping", {}, request_id=50))
    nothing_new = {"features": torch.randn(0, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)}
    # s1's context ends at 5: a block at 9 leaves a hole; "nobody" was never opened.
    burst.append(_request("propose", {"session": "s1", "start": 9, "position": 9}, nothing_new, request_id=60))
    burst.append(_request("propose", {"session": "nobody", "start": 0, "position": 0}, nothing_new, request_id=61))
    replies = [decode(frames) for frames in together.handle_all(burst)]
    expected = [decode(alone.handle(msg)) for msg in burst]
    assert [r.type for r in replies] == [r.type for r in expected]
    assert [r.type for r in replies] == ["proposal"] * 2 + ["pong"] + ["proposal"] * 2 + ["error"] * 2
    for got, want in zip(replies, expected, strict=True):
        assert got.id == want.id
        if got.type == "proposal":
            assert torch.equal(got.tensor("hidden"), want.tensor("hidden"))
        if got.type == "error":
            assert got["code"] == want["code"]
    assert together.counters["requests"] == alone.counters["requests"]
    if together.together:
        # s0's 3 rows (within a block) go first, with the ping and the two refused; then the other
        # three's prompts (more rows than a block: heavy, after the rest) in one pass
        assert together.counters["batched"] == 3


def test_a_burst_of_full_ring_resends_is_drafted_in_passes_of_bounded_rows(monkeypatch):
    """32 sessions resending 4,096 rows each in one burst were one pass: 4 GB and 2.6x the time of
    drafting them one by one. A pass now takes at most max_pass_rows feature rows (a bigger
    propose alone); the bits are those of each alone, and small steps still share a pass."""
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    bounded, alone = (
        DraftService(drafter, DraftSettings(ring_capacity=64, max_pass_rows=100)),
        DraftService(drafter, DraftSettings(ring_capacity=64)),
    )
    passes = []
    real = draft_daemon.timed_pass
    monkeypatch.setattr(
        draft_daemon, "timed_pass", lambda steps, together: passes.append(len(steps)) or real(steps, together)
    )
    mask, g = torch.randn(1, cfg.hidden_size), torch.Generator().manual_seed(2)
    resends, steps = [], []
    for i, rows in enumerate([60, 30, 30, 150, 10, 64, 64]):
        for service in (bounded, alone):
            service.handle(_request("open", {"session": f"s{i}"}, {"mask": mask}, request_id=100 + i))
        tensors = {
            "features": torch.randn(rows, cfg.feature_width, generator=g),
            "noise": torch.randn(1, cfg.hidden_size),
        }
        resends.append(_request("propose", {"session": f"s{i}", "start": 0, "position": rows}, tensors, request_id=i))
        tensors = {"features": torch.randn(3, cfg.feature_width, generator=g), "noise": torch.randn(1, cfg.hidden_size)}
        steps.append(
            _request("propose", {"session": f"s{i}", "start": rows, "position": rows + 3}, tensors, request_id=i)
        )
    for burst in (resends, steps):
        passes.clear()
        replies = [decode(frames) for frames in bounded.handle_all(burst)]
        if bounded.together:
            assert passes == ([2, 1, 1, 2, 1] if burst is resends else [7]), passes  # 60+30 | 30 | 150 | 10+64 | 64
        for got, msg in zip(replies, burst, strict=True):
            want = decode(alone.handle(msg))
            assert got.type == want.type == "proposal" and torch.equal(got.tensor("hidden"), want.tensor("hidden"))


def test_a_device_where_a_pass_changes_bits_drafts_one_by_one(monkeypatch):
    """The load check sees a linear whose rows depend on the rows beside them, and the service
    then answers every propose of a burst alone: same replies, no pass of two."""
    drafter = _drafter("tiny", torch.float32)
    original = row_blocks.Linear.forward
    monkeypatch.setattr(row_blocks.Linear, "forward", lambda self, x: original(self, x) * (1 + 1e-3 * x.numel()))
    assert not drafts_alone_in_one_pass(drafter)
    service = DraftService(drafter, DraftSettings(ring_capacity=32))
    assert not service.together
    cfg = drafter.config
    mask = torch.randn(1, cfg.hidden_size)
    burst = []
    for i in range(3):
        service.handle(_request("open", {"session": f"s{i}"}, {"mask": mask}, request_id=100 + i))
        tensors = {"features": torch.randn(4, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)}
        burst.append(_request("propose", {"session": f"s{i}", "start": 0, "position": 4}, tensors, request_id=i))
    replies = [decode(frames) for frames in service.handle_all(burst)]
    assert [r.type for r in replies] == ["proposal"] * 3 and service.counters["batched"] == 0


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_a_targets_local_slots_draft_one_pass_per_step_and_decode_as_alone(dflash2):
    """In-process drafting in a batch: the slots' backends share a DraftPass, so a step's drafts
    are one pass; greedy and seeded-sampled requests give the tokens and acceptance they give alone."""
    from helpers import tiny_target

    from draft_node.checkpoint import config_for_target
    from protocol.sampling import SamplingParams
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import Sequence, generate, step
    from target_node.drafting.draft_pass import DraftPass
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.drafting.proposers import DFlashProposer
    from target_node.model.target import TargetModel

    single = tiny_target("qwen3", seed=4)
    batch = TargetModel(single.model, slots=4)
    cfg = config_for_target(single.config, block_size=6, taps=3, dflash2=dflash2)
    drafter = random_drafter(cfg, seed=1, std=0.1)
    prompts = [[5, 17, 42, 99, 3, 7], [200, 11, 11, 11, 250, 12, 13, 14], [9, 8, 7, 6, 5, 4, 3, 2, 1], [1, 2, 3]]
    sampling = [None, SamplingParams(temperature=0.9, seed=7), None, SamplingParams(temperature=0.7, top_k=20, seed=3)]

    def proposer(together=None):
        return DFlashProposer(LocalDraftBackend(drafter, 256, together))

    alone = [
        generate(batch, p, proposer(), DecodeOptions(30, adaptive=False, sampling=s))
        for p, s in zip(prompts, sampling, strict=True)
    ]
    together = DraftPass(drafter)
    sequences = [
        Sequence(batch, p, proposer(together), DecodeOptions(30, adaptive=False, sampling=s), slot=slot)
        for slot, (p, s) in enumerate(zip(prompts, sampling, strict=True))
    ]
    built, sent = [], []  # a step's request is built once: sent ahead, then taken by its propose
    for seq in sequences:
        seq.proposer._request = counted(seq.proposer._request, built)
        seq.proposer.backend.send_draft = counted(seq.proposer.backend.send_draft, sent)
    while not all(seq.done for seq in sequences):
        step(batch, [seq for seq in sequences if not seq.done])
    for seq, want in zip(sequences, alone, strict=True):
        got = seq.result()
        assert got.tokens == want.tokens and got.stats.histogram == want.stats.histogram
    proposals = sum(seq.proposer.backend.counters["proposals"] for seq in sequences)
    assert sent and len(built) == proposals
    if dflash_kernels.available():
        assert together.together and together.counters["batched"] > together.counters["passes"]


def counted(method, calls: list):
    """`method`, noting each call in `calls`."""

    def call(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    return call


def test_a_step_shares_its_drafting_time_evenly_among_the_sequences_that_drafted():
    """The first sequence to ask for its drafts waits for the whole pass, the others for none;
    each governor must see its share, or the first would think drafting costs it the pass."""
    from helpers import tiny_target

    from draft_node.checkpoint import config_for_target
    from target_node.decoding.options import DecodeOptions
    from target_node.decoding.sequence import Sequence, step
    from target_node.drafting.draft_pass import DraftPass
    from target_node.drafting.local_backend import LocalDraftBackend
    from target_node.drafting.proposers import DFlashProposer, NoProposer
    from target_node.model.target import TargetModel

    single = tiny_target("qwen3", seed=4)
    batch = TargetModel(single.model, slots=4)
    drafter = random_drafter(config_for_target(single.config, block_size=6, taps=3), seed=1, std=0.1)
    together = DraftPass(drafter)
    proposers = [DFlashProposer(LocalDraftBackend(drafter, 256, together)) for _ in range(3)] + [NoProposer()]
    sequences = [
        Sequence(batch, [5, 17, 42, 99, 3 + i], p, DecodeOptions(20, adaptive=False), slot=i)
        for i, p in enumerate(proposers)
    ]
    while any(seq.prefilling for seq in sequences):
        step(batch, sequences)
    before = [seq.stats.propose_s for seq in sequences]
    step(batch, sequences)
    spent = [seq.stats.propose_s - b for seq, b in zip(sequences, before, strict=True)]
    assert spent[0] == spent[1] == spent[2] > 0
    assert spent[3] < spent[0]  # plain: it drafted nothing, and keeps its own (tiny) time


def test_a_bug_admitting_one_propose_of_a_burst_costs_its_reply_only(monkeypatch):
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    service = DraftService(drafter, DraftSettings(ring_capacity=32))
    burst = []
    for i in range(3):
        service.handle(_request("open", {"session": f"s{i}"}, {"mask": torch.randn(1, cfg.hidden_size)}))
        tensors = {"features": torch.randn(2, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)}
        burst.append(_request("propose", {"session": f"s{i}", "start": 0, "position": 2}, tensors, request_id=i))
    admit = service.admit_propose

    def flaky(msg):
        if msg["session"] == "s1":
            raise RuntimeError("a bug")
        return admit(msg)

    monkeypatch.setattr(service, "admit_propose", flaky)
    replies = [decode(frames) for frames in service.handle_all(burst)]
    assert [r.type for r in replies] == ["proposal", "error", "proposal"]
    assert replies[1]["code"] == "internal" and "a bug" in replies[1]["message"]


class _TwoTargets:
    """One draft daemon (`service`, and `alone` to answer each request by itself) with target A's
    sessions a0, a1, a2 and target B's b and b2 open, each past a 3-row prompt."""

    def __init__(self) -> None:
        drafter = _drafter("tiny", torch.float32)
        self.cfg = drafter.config
        self.service, self.alone = (
            DraftService(drafter, DraftSettings(ring_capacity=32, max_pass_rows=16)) for _ in range(2)
        )
        self.g = torch.Generator().manual_seed(4)
        mask = torch.randn(1, self.cfg.hidden_size, generator=self.g)
        for name, peer in (("a0", "A"), ("a1", "A"), ("a2", "A"), ("b", "B"), ("b2", "B")):
            prompt = {"features": self.rows(3), "noise": self.noise()}
            for svc in (self.service, self.alone):
                assert decode(svc.handle(_request("open", {"session": name}, {"mask": mask}, peer=peer))).type == "ok"
                svc.handle(_request("propose", {"session": name, "start": 0, "position": 3}, prompt, peer=peer))

    def rows(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.cfg.feature_width, generator=self.g)

    def noise(self) -> torch.Tensor:
        return torch.randn(1, self.cfg.hidden_size, generator=self.g)

    def propose(self, name: str, start: int, rows: int, request_id: int) -> Message:
        """`rows` new rows at `start` (a step: 1 or 2; a ring resent after a restart: 16, a pass of its own)."""
        fields = {"session": name, "start": start, "position": start + rows}
        tensors = {"features": self.rows(rows), "noise": self.noise()}
        return _request("propose", fields, tensors, peer=name[0].upper(), request_id=request_id)

    def answer(self, burst: list[Message], more) -> tuple[list[int], list[Message]]:
        """The ids in the order `service` sent them, and its replies, each checked against `alone`'s."""
        by_index: dict[int, Message] = {}
        assert self.service.handle_all(list(burst), lambda i, r: by_index.setdefault(i, decode(r)), more) == []
        sent = [reply.id for reply in by_index.values()]
        replies = [by_index[i] for i in range(len(by_index))]
        want = [decode(self.alone.handle(msg)) for msg in burst]  # `more` appended its requests to burst
        for got, expected in zip(replies, want, strict=True):
            assert got.type == expected.type != "error" and got.id == expected.id
            assert torch.equal(got.tensor("hidden"), expected.tensor("hidden"))
        return sent, replies


def test_a_step_s_propose_goes_before_other_targets_resends_and_predrafts_and_those_that_arrive_meanwhile():
    """One draft daemon, two targets. Target A's ring resends (more rows than a block) and its
    pre-drafts (speculative) arrived before target B's step propose; B's propose was answered after
    all of them, past B's --draft-timeout under eight resends of 4,096 rows (an audit: 2.2 s).
    Now the light requests of a burst go first, heavy ones a pass at a time, and what arrives
    between two heavy passes is taken in (`more`): B waits for at most one. Each session's own
    requests keep their order, and every reply is what the session's requests alone would get."""
    two = _TwoTargets()
    heads = torch.randn(6, two.cfg.hidden_size, generator=two.g)
    predraft = _request(
        "predraft", {"session": "a2", "position": 3, "known": [2, 2, 2]}, {"heads": heads}, peer="A", request_id=3
    )
    a0_step = two.propose("a0", 16, 1, 4)  # a0's own step after its resend: its start is the resend's end
    burst = [two.propose("a0", 0, 16, 1), two.propose("a1", 0, 16, 2), predraft, a0_step, two.propose("b", 3, 2, 5)]
    late = two.propose("b2", 3, 1, 6)
    calls = []

    def more(held, held_bytes):  # B's other slot's step arrives while A's first resend is drafted
        calls.append((held, held_bytes))
        taken = [late] if len(calls) == 1 else []
        burst.extend(taken)
        return taken

    sent, _ = two.answer(burst, more)
    assert sent[0] == 5  # B's step first, before A's resends and pre-draft
    assert sent.index(6) < sent.index(2) and sent.index(6) < sent.index(3)  # the late one after one heavy pass
    assert sent.index(4) > sent.index(1)  # a0's step after a0's resend
    assert len(sent) == 6 and calls and all(held <= draft_daemon.MAX_BURST for held, _ in calls)


def test_steps_arriving_without_end_do_not_starve_another_targets_resends():
    """Light requests go first, but not always: a target stepping steadily (a propose arriving
    during every pass) kept another target's resends waiting for as long as it stepped. After a
    round of light ones the oldest request goes, so each resend waits for at most one round."""
    two = _TwoTargets()
    burst = [two.propose("a0", 0, 16, 1), two.propose("a1", 0, 16, 2), two.propose("b", 3, 1, 100)]
    steps = iter(range(1, 12))

    def more(held, held_bytes):  # b's next step arrives during every pass, 11 of them
        step = next(steps, None)
        taken = [] if step is None else [two.propose("b", 3 + step, 1, 100 + step)]
        burst.extend(taken)
        return taken

    sent, _ = two.answer(burst, more)
    b_steps = [i for i in sent if i >= 100]
    assert b_steps == sorted(b_steps) and len(b_steps) >= 3, sent  # b's steps in their order
    assert sent.index(1) <= 3 and sent.index(2) <= 5, sent  # each resend a round after the light one before it
    # once nothing heavy waits the burst ends: b's later steps are the next burst's (none lost here)
    assert b_steps[-1] == 100 + next(steps) - 1


def test_keep_and_restore_wait_for_a_heavy_request_before_them_whatever_its_session():
    """A kept prefix's name reaches across sessions: a restore must not pass the keep (or the
    resend a keep follows) that came before it, nor its session's propose the restore. Nor may an
    undecodable request's error pass a heavy reply: it names no session, and its connection's
    reader drops a reply that is not the one it waits for."""
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    service = DraftService(drafter, DraftSettings(ring_capacity=32))
    mask = torch.randn(1, cfg.hidden_size)
    for name in ("x", "y"):
        service.handle(_request("open", {"session": name}, {"mask": mask}))
    resend = _request(
        "propose",
        {"session": "x", "start": 0, "position": 12},
        {"features": torch.randn(12, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)},
        request_id=1,
    )
    keep = _request("keep", {"session": "x", "name": "n", "rows": 12}, request_id=2)
    restore = _request("restore", {"session": "y", "name": "n", "rows": 12}, request_id=3)
    ping = _request("ping", {}, request_id=4)
    after = _request(  # y's next rows, at the end of the prefix restored
        "propose",
        {"session": "y", "start": 12, "position": 13},
        {"features": torch.randn(1, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)},
        request_id=5,
    )
    by_index: dict[int, Message] = {}
    garbled = ProtocolError(ErrorCode.BAD_FIELD, "undecodable", request_id=6)
    burst = [resend, keep, restore, ping, garbled, after]
    service.handle_all(burst, send=lambda i, r: by_index.setdefault(i, decode(r)))
    assert [reply.id for reply in by_index.values()] == [4, 1, 2, 3, 6, 5]
    assert (
        by_index[1]["rows"] == 12
        and by_index[2]["rows"] == 12
        and by_index[5].type == "proposal"
        and by_index[4].type == "error"
    )


def test_an_open_waits_for_a_heavy_request_before_it_whatever_its_session():
    """A slot reaches across sessions and peers: an `open` that passed a heavy request went before
    the `close` behind it (its session's) that freed the slot it needed, and was answered busy."""
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    service = DraftService(drafter, DraftSettings(ring_capacity=32, max_sessions=2))
    mask = torch.randn(1, cfg.hidden_size)
    for name in ("x", "y"):
        assert decode(service.handle(_request("open", {"session": name}, {"mask": mask}, peer="B"))).type == "ok"
    resend = _request(
        "propose",
        {"session": "x", "start": 0, "position": 12},
        {"features": torch.randn(12, cfg.feature_width), "noise": torch.randn(1, cfg.hidden_size)},
        peer="B",
        request_id=1,
    )
    close = _request("close", {"session": "x"}, peer="B", request_id=2)
    opened = _request("open", {"session": "z"}, {"mask": mask}, peer="C", request_id=3)
    replies = [decode(r) for r in service.handle_all([resend, close, opened])]
    assert [r.type for r in replies] == ["proposal", "ok", "ok"], [r.fields for r in replies]


def test_a_burst_that_runs_on_holds_no_request_it_has_answered():
    """While heavy work keeps arriving a burst runs on, round after round; it held every request
    and reply it had answered until its end (a whole ring resent is 22 MiB), unbounded in time."""
    two = _TwoTargets()
    made: list[weakref.ref] = []
    alive: list[int] = []

    def more(held, held_bytes):  # a ping arrives during every pass and a resend every other, 40 times
        # No gc.collect(): a request is freed when its last reference goes (40 collections took 7.9 s
        # of the suite), and one kept alive by a cycle would hold its tensors as long: a failure too.
        alive.append(sum(ref() is not None for ref in made))
        if len(alive) > 40:
            return []
        taken = [_request("ping", {}, peer="B", request_id=len(alive))]
        if len(alive) % 2:
            taken.append(two.propose("a1", 0, 16, 1000 + len(alive)))
        made.extend(weakref.ref(msg) for msg in taken)
        return taken

    sent: list[int] = []
    burst = [two.propose("a0", 0, 16, 1), two.propose("a1", 0, 16, 2)]
    kept = two.service.handle_all(burst, lambda i, r: sent.append(decode(r).id), more)
    assert len(alive) > 40 and max(alive) <= 4, alive  # what waits, not all 60 taken in
    assert kept == []  # nor the replies it sent
    assert len(sent) == 2 + len(made)


def test_idle_sessions_are_evicted_on_the_clock_during_a_burst_that_runs_on(monkeypatch):
    """Idle sessions were looked for only between bursts: while heavy work kept arriving a burst
    ran on, and a gone target's sessions (a ring's keys and values each) stayed as long. They go on
    the clock now, inside a burst too, at most once per IDLE_CHECK_S however many rounds run, and
    never one with a request waiting in the burst."""
    drafter = _drafter("tiny", torch.float32)
    cfg = drafter.config
    now = [1000.0]
    service = DraftService(
        drafter, DraftSettings(ring_capacity=32, max_pass_rows=16, idle_timeout=60), clock=lambda: now[0]
    )
    g, width = torch.Generator().manual_seed(5), cfg.feature_width

    def propose(name: str, start: int, rows: int, request_id: int) -> Message:
        tensors = {"features": torch.randn(rows, width, generator=g), "noise": torch.randn(1, cfg.hidden_size)}
        fields = {"session": name, "start": start, "position": start + rows}
        return _request("propose", fields, tensors, peer=name.upper(), request_id=request_id)

    mask = torch.randn(1, cfg.hidden_size)
    for name in ("a", "w", "gone"):
        opened = service.handle(_request("open", {"session": name}, {"mask": mask}, peer=name.upper()))
        assert decode(opened).type == "ok" and decode(service.handle(propose(name, 0, 3, 1))).type == "proposal"
    checks = []
    real = service.evict_idle
    monkeypatch.setattr(service, "evict_idle", lambda busy=(): checks.append(now[0]) or real(busy))
    # w's step waits behind its own resend, which waits behind a's: w is idle as long as "gone".
    burst = [propose("a", 0, 16, 10), propose("w", 0, 16, 11), propose("w", 16, 1, 12)]
    gone_during = []

    def more(held, held_bytes):  # a's resends arrive during every pass, 30 of them
        now[0] += 100.0 if len(gone_during) == 0 else 0.01  # past idle_timeout once, then a moment a round
        gone_during.append(("GONE", "gone") not in service.sessions)
        return [] if len(gone_during) > 30 else [propose("a", 0, 16, 100 + len(gone_during))]

    replies = [decode(r) for r in service.handle_all(burst, more=more)]
    assert any(gone_during), "the idle session outlived a burst that ran on"
    assert ("GONE", "gone") not in service.sessions and service.counters["evicted"] == 1
    assert {r.type for r in replies} == {"proposal"} and len(replies) == 3 + 30  # w's step found its session
    assert 1 <= len(checks) <= 2, checks  # the first round, then once past the jump: not once a round


def test_a_peers_requests_after_an_undecodable_one_wait_for_its_error():
    """An undecodable request names no session, so it waits for any heavy request before it; the
    requests its connection sent after it did not, and went first: its reader, waiting for the
    error's id, dropped the reply after it as stale and timed out on it. They wait with it now
    (the transport names an undecodable request's peer); another peer's steps still go first."""
    two = _TwoTargets()
    garbled = ProtocolError(ErrorCode.BAD_FIELD, "predraft: budget_ms must be at least 0", request_id=2)
    garbled.peer = "B"  # as the transport names it
    burst = [two.propose("a0", 0, 16, 1), garbled, two.propose("b", 3, 1, 3), two.propose("a1", 3, 1, 4)]
    by_index: dict[int, Message] = {}
    two.service.handle_all(burst, send=lambda i, r: by_index.setdefault(i, decode(r)))
    sent = [reply.id for reply in by_index.values()]
    assert sent.index(2) < sent.index(3), sent  # B's step after B's error
    assert sent[0] == 4, sent  # A's step is not held back by B's mistake
    assert by_index[1].type == "error" and by_index[1]["code"] == "bad_field"
    assert by_index[0].type == by_index[2].type == by_index[3].type == "proposal"


def test_a_sessions_requests_before_its_reopen_are_not_drafted(monkeypatch):
    """A target that timed out on a request drops its socket and later re-opens its session (the
    same name, the same peer) and resends its context: the requests it gave up on were still drafted
    when their turn came, a whole ring's pass each, though the open wipes what they did and nobody
    reads their replies (the target skips them as stale), while the daemon was already too loaded
    to answer in time. Proposes and pre-drafts that only an `open` of their session follows are
    answered at once with an error now, in their order; what the reopened session drafts is as
    alone, and another target's step is served as before."""
    two = _TwoTargets()
    drafted = []
    real = draft_daemon.timed_pass
    monkeypatch.setattr(
        draft_daemon,
        "timed_pass",
        lambda steps, together: drafted.extend(s.features.shape[0] for s in steps) or real(steps, together),
    )
    heads = torch.randn(4, two.cfg.hidden_size, generator=two.g)
    gave_up = [  # a0's step, a pre-draft after it and its resend, all timed out at the target
        two.propose("a0", 3, 1, 1),
        _request(
            "predraft", {"session": "a0", "position": 4, "known": [2, 2]}, {"heads": heads}, peer="A", request_id=2
        ),
        two.propose("a0", 0, 16, 3),
    ]
    mask = torch.randn(1, two.cfg.hidden_size, generator=two.g)
    reopen = [_request("open", {"session": "a0"}, {"mask": mask}, peer="A", request_id=4), two.propose("a0", 0, 16, 5)]
    burst = [*gave_up, two.propose("b", 3, 1, 6), *reopen]
    by_index: dict[int, Message] = {}
    two.service.handle_all(burst, send=lambda i, r: by_index.setdefault(i, decode(r)))
    sent = [reply.id for reply in by_index.values()]
    a0 = [i for i in sent if i != 6]
    assert a0 == sorted(a0) and len(sent) == 6, sent  # a0's replies in their order
    assert [by_index[i].type for i in range(3)] == ["error"] * 3 and by_index[0]["code"] == "out_of_order"
    assert drafted == [1, 16], drafted  # b's step and the resend after the open: nothing given up on
    want = [decode(two.alone.handle(msg)) for msg in (burst[3], *reopen)]
    for got, expected in zip([by_index[3], by_index[4], by_index[5]], want, strict=True):
        assert got.type == expected.type != "error"
        if got.type == "proposal":
            assert torch.equal(got.tensor("hidden"), expected.tensor("hidden"))
