"""A request's output does not depend on what it was batched with.

Many sequences run in one engine forward per step (decoding.sequence.step): prompts of random
lengths arriving at random steps, prefilled in chunks beside others' decode steps, each with its
own drafter, greedy or seeded-sampled, chains and trees. Every output must equal the same request
decoded alone, token for token, in fp32 and bf16: the engine's rows are computed as if alone.
"""

import random

import pytest
import torch

from draft_node.checkpoint import config_for_target, random_drafter
from protocol.sampling import SamplingParams
from target_node.decoding.governor import Governor
from target_node.decoding.options import DecodeOptions
from target_node.decoding.pace import FEWEST, FIRST_CHUNK, PrefillPace
from target_node.decoding.sequence import Sequence, generate, step
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer
from target_node.model.target import TargetModel
from target_node.model.tiny import tiny_target

SLOTS = 4


@pytest.fixture(
    scope="module",
    params=[("llama", torch.float32), ("qwen3_sliding", torch.bfloat16), ("mistral", torch.float32)],
    ids=lambda p: f"{p[0]}-{str(p[1])[6:]}",
)
def target(request, one_thread):
    family, dtype = request.param
    model = tiny_target(family, seed=3, dtype=dtype, engine=False).model
    return TargetModel(model, slots=SLOTS)


def requests(target, seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    drafter = random_drafter(config_for_target(target.config, block_size=8, taps=2), seed=seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        sampling = SamplingParams(temperature=0.8, top_k=40, seed=rng.randrange(1000)) if i % 3 == 2 else None
        kind = rng.choice(["dflash", "ngram"])
        out.append(
            dict(
                prompt=prompt,
                max_new=rng.randint(1, 30),
                sampling=sampling,
                tree_nodes=rng.choice([0, 6]),
                chunk=rng.choice([0, 5, 16]),
                arrive=rng.randint(0, 25),
                proposer=(lambda d=drafter: DFlashProposer(LocalDraftBackend(d)))
                if kind == "dflash"
                else NGramProposer,
            )
        )
    return out


def options(r) -> DecodeOptions:
    """A request's options, the same whether it runs alone or batched."""
    return DecodeOptions(
        r["max_new"], stop_on_eos=False, sampling=r["sampling"], tree_nodes=r["tree_nodes"], prefill_chunk=r["chunk"]
    )


def alone(target, r) -> list[int]:
    return generate(
        target,
        r["prompt"],
        r["proposer"](),
        options(r),
    ).tokens


def batched(target, reqs, pace: PrefillPace | None = None) -> dict[int, list[int]]:
    """A scheduler in a few lines: requests join at their arrival step into a free slot, all running
    ones step together, finished ones leave and free their slot."""
    waiting = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    running: dict[int, Sequence] = {}
    done, clock, widest = {}, 0, 0
    governor = Governor(max_nodes=8)  # shared, as in the daemon: its choices never change greedy output
    while waiting or running:
        free = [s for s in range(target.slots) if s not in {seq.slot for seq in running.values()}]
        while waiting and free and reqs[waiting[0]]["arrive"] <= clock:
            i = waiting.pop(0)
            r = reqs[i]
            running[i] = Sequence(
                target,
                r["prompt"],
                r["proposer"](),
                options(r),
                slot=free.pop(0),
                governor=governor,
            )
        if running:
            step(target, list(running.values()), pace)
            widest = max(widest, len(running))
        for i in [i for i, seq in running.items() if seq.done]:
            done[i] = running.pop(i).result().tokens
        clock += 1
    assert widest == target.slots  # the batch filled up: requests really ran side by side
    return done


@pytest.mark.parametrize("seed", [0, 1])
def test_every_request_decodes_as_it_would_alone(target, seed):
    reqs = requests(target, seed, 9)
    want = [alone(target, r) for r in reqs]
    got = batched(target, reqs)
    assert [got[i] for i in range(len(reqs))] == want
    assert max(r["arrive"] for r in reqs) > 0 and len({len(w) for w in want}) > 2


def test_prompt_chunks_sized_by_a_time_budget_change_no_output(target):
    """A pace with a budget no forward meets cuts every prompt into its smallest chunks, shared by
    the prompts in prefill together: still each request's output alone."""
    reqs = requests(target, 2, 9)
    want = [alone(target, r) for r in reqs]
    pace = PrefillPace(budget_s=1e-9, most=512)
    got = batched(target, reqs, pace)
    assert [got[i] for i in range(len(reqs))] == want
    assert pace.rows_per_s is not None and pace.chunk() == FEWEST


def test_prompts_in_prefill_together_share_the_budget_and_its_floor(target):
    """The floor of FEWEST rows was each prompt's: four prompts in prefill together put 64 prompt
    rows in every forward whatever the budget held, and a stream beside four 3,000-token prompts
    waited 0.37 s a token (p50) under a 150 ms budget (an audit). The floor is the forward's."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(4)]
    opts = DecodeOptions(3, stop_on_eos=False, prefill_chunk=512)
    want = [generate(target, p, NoProposer(), opts).tokens for p in prompts]
    seqs = [Sequence(target, p, NoProposer(), opts, slot=i) for i, p in enumerate(prompts)]
    pace = PrefillPace(budget_s=1e-9, most=512)  # no forward meets it: the smallest chunks
    prompt_rows, record = [], pace.record
    pace.record = lambda rows, rows_of_prompts, seconds: (
        prompt_rows.append(rows_of_prompts),
        record(rows, rows_of_prompts, seconds),
    )
    step(target, seqs, pace)  # nothing measured yet: FIRST_CHUNK rows, shared
    while not all(seq.done for seq in seqs):
        step(target, [seq for seq in seqs if not seq.done], pace)
    assert [seq.result().tokens for seq in seqs] == want
    assert prompt_rows[0] == FIRST_CHUNK and max(prompt_rows[1:]) <= FEWEST, prompt_rows
    pace = PrefillPace(budget_s=0.15, most=512)
    for _ in range(8):
        pace.record(rows=40, prompt_rows=32, seconds=0.26)  # ~154 rows/s: 23 rows fit the budget
    assert pace.chunk() == 23 and 4 * pace.chunk(prefilling=4) <= 23


def test_a_prompt_alone_takes_the_cap_and_is_paced_once_another_request_waits(target):
    """A forward's fixed cost paid per budget-sized chunk made a long prompt alone 40% slower to
    its first token; alone it pauses no one, so it takes --prefill-chunk rows, and the pace resumes
    as soon as a request waits or runs beside it. The output is the same either way."""
    rng = random.Random(1)
    prompt = [rng.randrange(3, 300) for _ in range(200)]
    want = generate(target, prompt, NoProposer(), DecodeOptions(4, stop_on_eos=False, prefill_chunk=64)).tokens
    pace = PrefillPace(budget_s=1e-9, most=64)
    seq = Sequence(target, prompt, NoProposer(), DecodeOptions(4, stop_on_eos=False, prefill_chunk=64), slot=0)
    chunks = []
    for waiting in (False, True, True, False, False, False, False, False, False, False, False, False):
        if seq.done:
            break
        prefilling = seq.prefilling
        step(target, [seq], pace, waiting=waiting)
        chunks.append(seq.chunk if prefilling else None)
    assert chunks[:3] == [64, FEWEST, FEWEST] and chunks[3] == 64, chunks
    assert seq.done and seq.result().tokens == want


def test_a_flood_of_hints_is_verified_a_paced_chunk_a_step(target):
    """A request may carry 16,384 hints, all right (its own output, learned from a first request): a
    step verifies at most a chunk of them, sized by the pace as a prompt's chunks are, so the request
    beside it keeps stepping instead of waiting out one forward of them all. Outputs stay their own."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(5)] for _ in range(2)]
    want = [
        generate(target, p, NoProposer(), DecodeOptions(n, stop_on_eos=False)).tokens
        for p, n in zip(prompts, (150, 30), strict=True)
    ]
    flood = DecodeOptions(150, stop_on_eos=False, hint_tokens=tuple(want[0]), prefill_chunk=512)
    seqs = [
        Sequence(target, prompts[0], NoProposer(), flood, slot=0),
        Sequence(target, prompts[1], NoProposer(), DecodeOptions(30, stop_on_eos=False, prefill_chunk=512), slot=1),
    ]
    pace = PrefillPace(budget_s=1e-9, most=512)
    widths, record = [], pace.record
    pace.record = lambda rows, prompt_rows, seconds: (widths.append(rows), record(rows, prompt_rows, seconds))
    step(target, seqs[:1], pace)  # its prompt alone: a chunk of 512 rows pauses no one
    assert seqs[0].chunk == 512 and not seqs[0].prefilling
    while not all(seq.done for seq in seqs):
        step(target, [seq for seq in seqs if not seq.done], pace)
    assert [seq.result().tokens for seq in seqs] == want
    assert seqs[0].result().stats.accepted > 100  # the hints were verified, not ignored
    assert max(widths[1:]) <= FIRST_CHUNK + 2, widths  # a chunk of hints, the flooding request's own token, the other's


def test_a_step_beside_another_requests_prompt_or_hints_is_not_timed_as_its_own(target):
    """Its seconds are mostly the other request's chunk: taken as this step's, a request beside a
    flood of hints saw its steps 10x slower than alone (a review), and its governor judged on that."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(5)] for _ in range(2)]
    hints = generate(target, prompts[0], NoProposer(), DecodeOptions(80, stop_on_eos=False)).tokens
    seqs = [
        Sequence(
            target, prompts[0], NoProposer(), DecodeOptions(80, stop_on_eos=False, hint_tokens=tuple(hints)), slot=0
        ),
        Sequence(target, prompts[1], NoProposer(), DecodeOptions(30, stop_on_eos=False), slot=1, governor=Governor()),
    ]
    for seq in seqs:  # both prompts in, so what follows is hints beside a plain decode
        step(target, [seq])
    timed, take = [], seqs[1].take
    seqs[1].take = lambda out: (timed.append(out.timed), take(out))
    step(target, seqs)  # the hints' chunk beside seqs[1]'s one row
    step(target, seqs[1:])  # seqs[1] alone
    assert timed == [False, True], timed


def test_the_pace_follows_the_measured_rate_and_grows_at_most_twofold():
    pace = PrefillPace(budget_s=0.2, most=1000)
    assert pace.chunk() == FIRST_CHUNK  # nothing measured yet
    pace.record(rows=70, prompt_rows=64, seconds=0.01)  # 7,000 rows/s: 1,400 fit the budget
    assert pace.chunk() == 2 * 64  # but one fast forward only doubles the chunk
    pace.record(rows=128, prompt_rows=128, seconds=0.0128)  # 10,000 rows/s, averaged to 8,500
    assert pace.chunk() == 256 and pace.chunk(prefilling=4) == 64
    for _ in range(5):
        pace.record(rows=1000, prompt_rows=1000, seconds=0.1)
    assert pace.chunk() == 1000  # the cap
    for _ in range(12):
        pace.record(rows=500, prompt_rows=500, seconds=1.0)  # a long context: 500 rows/s
    assert pace.chunk() == 100
    pace.record(rows=9, prompt_rows=0, seconds=0.001)  # decode-only forwards say nothing of prefill
    assert pace.chunk() == 100
    with pytest.raises(ValueError, match="budget"):
        PrefillPace(budget_s=0, most=10)


def test_a_batched_forward_is_the_same_rows_as_separate_forwards(target):
    """The layer below: several slots' parts in one forward give each part its own forward's bits."""
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 101, 102, 103, 104, 105, 106]]
    separate = []
    for slot, p in enumerate(prompts):
        target.reset(slot)
        separate.append(target.forward(p, (0, 2), slot=slot))
    for slot in range(len(prompts)):
        target.reset(slot)
    together = target.forward_batch([(slot, p, None) for slot, p in enumerate(prompts)], (0, 2))
    for (h1, f1), (h2, f2) in zip(separate, together, strict=True):
        assert torch.equal(h1, h2) and torch.equal(f1, f2)
    tree = [0, 0, 1]  # a tree part beside a chain part
    one = target.forward_batch([(0, [1, 2, 3, 4], tree), (1, [7, 8], None)], ())
    target.rollback(len(prompts[0]), 0)
    target.rollback(len(prompts[1]), 1)
    assert torch.equal(one[0][0], target.forward([1, 2, 3, 4], (), tree, slot=0)[0])
    assert torch.equal(one[1][0], target.forward([7, 8], (), None, slot=1)[0])


def test_slots_beyond_the_engines_are_refused(target):
    with pytest.raises(ValueError, match="slot"):
        target.forward([1, 2], slot=SLOTS)
    path = tiny_target("llama", engine=False)
    assert path.slots == 1
    with pytest.raises(ValueError, match="one sequence"):
        path.forward([1, 2], slot=1)


class BrokenProposer(NGramProposer):
    """A drafter with a bug: its proposals raise from the `fails_at`-th on (a fault injected)."""

    def __init__(self, fails_at: int) -> None:
        super().__init__()
        self.calls, self.fails_at = 0, fails_at

    def propose(self, tokens, max_tokens):
        self.calls += 1
        if self.calls >= self.fails_at:
            raise IndexError("a drafter's bug")
        return super().propose(tokens, max_tokens)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_drafter_that_raises_costs_its_request_its_drafts_and_nothing_else(target, sampled, caplog):
    """Drafting touches nothing the target holds, yet an exception in it (a drafter's, pre-draft
    naming past the drafter's rows: an audit) failed every request in the batch. Now the request
    whose drafting raised decodes on without drafts, its output the same as alone (greedy: the
    target's own), and the others never notice."""
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=5) if sampled else None
    # Drafting every step (no governor): its third propose raises whatever a governor would decide.
    opts = DecodeOptions(24, stop_on_eos=False, sampling=sampling, tree_nodes=6, adaptive=False)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    want = [generate(target, prompts[0], BrokenProposer(fails_at=3), opts).tokens]
    want.append(generate(target, prompts[1], NGramProposer(), opts).tokens)
    if not sampled:
        assert want[0] == generate(target, prompts[0], NoProposer(), opts).tokens
    broken = BrokenProposer(fails_at=3)
    seqs = [
        Sequence(target, prompts[0], broken, opts, slot=0),
        Sequence(target, prompts[1], NGramProposer(), opts, slot=1),
    ]
    with caplog.at_level("ERROR", logger="decoding"):
        while not all(seq.done for seq in seqs):
            step(target, [seq for seq in seqs if not seq.done])
    assert [seq.result().tokens for seq in seqs] == want
    assert broken.calls == 3 and seqs[0].drafting_failed and not seqs[1].drafting_failed  # no retry each step
    assert "drafting failed" in caplog.text and "a drafter's bug" in caplog.text


class BrokenPrefetch(NGramProposer):
    """A drafter elsewhere starts its drafts in `prefetch`, before the step plans: a bug there."""

    def prefetch(self, tokens, max_tokens):
        raise IndexError("a drafter's bug in prefetch")


def test_a_drafter_that_raises_as_it_starts_its_drafts_costs_only_its_requests_drafts(target, caplog):
    """The fallback covered planning but not `prepare`'s prefetch, where a remote drafter's drafts
    start (the ring read, the noise, the outcome named): a bug there still failed the batch (a review)."""
    opts = DecodeOptions(12, stop_on_eos=False)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    want = [generate(target, p, NoProposer(), opts).tokens for p in prompts]
    seqs = [Sequence(target, prompts[0], BrokenPrefetch(), opts, slot=0)]
    seqs.append(Sequence(target, prompts[1], NGramProposer(), opts, slot=1))
    with caplog.at_level("ERROR", logger="decoding"):
        while not all(seq.done for seq in seqs):
            step(target, [seq for seq in seqs if not seq.done])
    assert [seq.result().tokens for seq in seqs] == want
    assert seqs[0].drafting_failed and "a drafter's bug in prefetch" in caplog.text


class FailsToCommit(NGramProposer):
    """A proposer whose taking of a step's features raises at its `fails_at`-th commit: a bug in
    acceptance (finish_step), where the slot's state is in doubt, unlike a drafting failure."""

    def __init__(self, fails_at: int) -> None:
        super().__init__()
        self.commits, self.fails_at = 0, fails_at

    def commit(self, start, features):
        self.commits += 1
        if self.commits == self.fails_at:
            raise RuntimeError("a bug in taking the step's results")


def test_a_request_whose_step_results_raise_ends_alone_and_the_others_go_on(target, tmp_path):
    """One request's acceptance raising failed every request in the batch with it (left alone for
    sessions). Now that request ends with the error, in process and in the daemon, and the others'
    outputs are what they are alone."""
    from helpers import serving_in_thread

    from frontend.target_client import TargetClient
    from protocol.errors import ProtocolError
    from target_node.serving.daemon import TargetService
    from target_node.serving.settings import ServiceSettings

    opts = DecodeOptions(20, stop_on_eos=False)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    want = generate(target, prompts[1], NGramProposer(), opts).tokens
    with pytest.raises(RuntimeError, match="a bug"):
        generate(target, prompts[0], FailsToCommit(fails_at=4), opts)
    alone = generate(target, prompts[0], NGramProposer(), opts).tokens
    seqs = [
        Sequence(target, prompts[0], FailsToCommit(fails_at=4), opts, slot=0),
        Sequence(target, prompts[1], NGramProposer(), opts, slot=1),
    ]
    while not all(seq.done for seq in seqs):
        step(target, [seq for seq in seqs if not seq.done])
    assert isinstance(seqs[0].failed, RuntimeError) and seqs[1].failed is None
    assert seqs[1].result().tokens == want
    proposers = [FailsToCommit(fails_at=4), NGramProposer()]
    service = TargetService(target, proposers, ServiceSettings(prefix_cache_mb=0))
    address = f"ipc://{tmp_path}/fails.sock"
    with serving_in_thread(service.serve, address):
        client = TargetClient(address, timeout_s=60)
        try:  # the request in slot 0 ends with the error; the daemon serves on, in that slot too
            with pytest.raises(ProtocolError, match="a bug"):
                client.generate(token_ids=prompts[0], max_new_tokens=20, stream=False)
            assert client.generate(token_ids=prompts[0], max_new_tokens=20, stream=False)["token_ids"] == alone
            assert service.report()["requests"] == {"length": 1}
        finally:
            client.close()


def test_the_daemon_gives_each_request_a_fork_of_its_governor_and_takes_back_what_it_learned(target, tmp_path):
    """The wiring of the governor's fork and absorb: each request decides with its own governor,
    and what it learned (here, how deep its n-gram drafts were right) is the daemon's afterwards."""
    from helpers import serving_in_thread

    from frontend.target_client import TargetClient
    from target_node.serving.daemon import TargetService
    from target_node.serving.settings import ServiceSettings

    service = TargetService(target, [NGramProposer()], ServiceSettings(prefix_cache_mb=0))
    forks, fork = [], service.governor.fork
    service.governor.fork = lambda: forks.append(fork()) or forks[-1]
    untaught = list(service.governor.depth_tries)
    address = f"ipc://{tmp_path}/forks.sock"
    with serving_in_thread(service.serve, address):
        client = TargetClient(address, timeout_s=60)
        try:
            for _ in range(2):
                client.generate(token_ids=[7, 8, 9] * 6, max_new_tokens=24, stream=False)
        finally:
            client.close()
    assert len(forks) == 2 and all(f is not service.governor and f.costs is service.governor.costs for f in forks)
    assert service.governor.depth_tries == forks[-1].depth_tries != untaught


def test_a_recorder_that_fails_never_fails_the_request_it_records(target, tmp_path):
    """A recorder raising after a request's `done` sent that request an `error` too (two replies
    for one request: an audit); it is logged now, and the daemon serves on."""
    from helpers import serving_in_thread

    from frontend.target_client import TargetClient
    from target_node.serving.daemon import TargetService
    from target_node.serving.settings import ServiceSettings

    def broken_recorder(msg, prompt, result):
        raise NotADirectoryError("the record folder is a file")

    service = TargetService(target, [NGramProposer()], ServiceSettings(prefix_cache_mb=0), broken_recorder)
    address = f"ipc://{tmp_path}/recorder.sock"
    with serving_in_thread(service.serve, address):
        client = TargetClient(address, timeout_s=60)
        try:
            for prompt in ([5, 6, 7, 8], [9, 10, 11]):
                done = client.generate(token_ids=prompt, max_new_tokens=6, stream=False)
                assert done["token_ids"] == generate(target, prompt, NoProposer(), DecodeOptions(6)).tokens
            report = service.report()
        finally:
            client.close()
    assert sum(report["requests"].values()) == 2 and report["refused"] == {}
