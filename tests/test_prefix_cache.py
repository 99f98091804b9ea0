"""The prefix cache: later prompts start from earlier requests' committed rows, bit for bit as if
they had prefilled them, within a byte bound, visible in the stats."""

import random
from contextlib import ExitStack, contextmanager

import pytest
import torch
from helpers import draft_daemon, greedy, serving_in_thread, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
from frontend.target_client import TargetClient
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import Sequence, step
from target_node.drafting.draft_pass import DraftPass
from target_node.drafting.feature_ring import FeatureRing
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer
from target_node.drafting.remote import LinkTiming, RemoteDraftBackend
from target_node.model.target import TargetModel
from target_node.serving.daemon import TargetService
from target_node.serving.prefix_cache import BLOCK, PrefixCache
from target_node.serving.settings import ServiceSettings

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = [random.Random(1).randrange(3, 250) for _ in range(40)]  # a system prompt every chat shares
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rows(n: int, fill: float = 0.0) -> torch.Tensor:
    """KV rows of n positions in the cache's layout, 1 layer of 1 head of width 4 (32 bytes a position)."""
    return torch.full((1, 2, 1, n, 4), fill)


# --- the cache alone ----------------------------------------------------------------------------


def test_the_longest_stored_prefix_is_found_and_extended_past_its_last_block():
    cache = PrefixCache(1 << 20)
    stored = list(range(100, 150))  # 50 tokens: 3 full blocks and 2 more
    cache.store(stored, rows(50), None, ())
    hit = cache.lookup(stored[:45] + [7, 8, 9], ())
    assert hit is not None and hit.length == 45  # block-aligned at 32, then token by token
    assert cache.lookup(stored, ()).length == 49  # never the last token: it must run
    assert cache.lookup([1] + stored, ()) is None
    assert cache.lookup(stored[:BLOCK], ()) is None  # its last token must run: less than a block left
    assert cache.to_dict()["hits"] == 2 and cache.to_dict()["lookups"] == 4


def test_of_chats_sharing_a_system_prompt_the_one_matching_furthest_is_found():
    """Several entries share the blocks of a system prompt; past the last whole block each
    matches a few tokens more. The latest stored was taken: a chat's next turn re-ran up to 15
    tokens of its previous turn when another chat came after it, and reported them uncached (an
    audit). The one matching furthest now serves, the latest stored among equals."""
    system = list(range(100, 132))  # two whole blocks, shared
    mine, other = system + [1, 2, 3, 4, 5, 6], system + [7, 8, 9, 10, 11, 12, 13]
    cache = PrefixCache(1 << 20)
    cache.store(mine, rows(len(mine), 1.0), None, ())
    cache.store(other, rows(len(other), 2.0), None, ())
    hit = cache.lookup(mine + [40, 41], ())
    assert hit.length == len(mine) and float(hit.kv[0, 0, 0, 0, 0]) == 1.0
    hit = cache.lookup(system + [50, 51], ())  # both match the system prompt alone: the latest serves
    assert hit.length == len(system) and float(hit.kv[0, 0, 0, 0, 0]) == 2.0


def test_a_drafter_that_reads_features_is_served_only_rows_stored_with_its_taps():
    cache = PrefixCache(1 << 20)
    tokens = list(range(40))
    cache.store(tokens, rows(40), None, ())
    assert cache.lookup(tokens + [1], (0, 2)) is None  # no features: a drafter would draft blind
    cache.store(tokens, rows(40), torch.zeros(40, 8), (0, 2))
    assert cache.lookup(tokens + [1], (0, 2)).features.shape == (40, 8)
    assert cache.lookup(tokens + [1], (1, 2)) is None


def test_a_longer_turn_replaces_the_entries_it_extends():
    cache = PrefixCache(1 << 20)
    history = list(range(30))
    cache.store(history, rows(30), None, ())
    cache.store(history + list(range(30, 70)), rows(70), None, ())
    cache.store(history[:20], rows(20), None, ())  # held already, by the longer one
    assert len(cache.entries) == 1 and cache.held == rows(70).numel() * 4


def test_a_flood_of_prefixes_stays_within_the_bound_and_keeps_the_newest():
    bound = 32 * 2000  # 2,000 positions
    cache = PrefixCache(bound)
    rng = random.Random(0)
    for i in range(3000):
        n = rng.randrange(16, 200)
        cache.store([i, *(rng.randrange(1000) for _ in range(n - 1))], rows(n), None, ())
        assert cache.held <= bound
    assert cache.counters["evicted"] > 2900
    assert sum(len(h) for h in cache.by_hash.values()) == sum(len(e.hashes) for e in cache.entries.values())
    cache.store([5] * 3000, rows(3000), None, ())  # bigger than the whole cache: not kept
    assert cache.held <= bound and cache.lookup([5] * 100, ()) is None


def test_evicting_one_entry_keeps_a_prefix_another_entry_holds():
    cache = PrefixCache(32 * 130)
    first, second = SYSTEM + [1] * 20, SYSTEM + [2] * 20
    cache.store(first, rows(60), None, ())
    cache.store(second, rows(60), None, ())
    cache.store(list(range(500, 516)), rows(16), None, ())  # over the bound: the oldest (first) goes
    assert len(cache.entries) == 2
    hit = cache.lookup(SYSTEM + [3] * 5, ())
    assert hit is not None and hit.length == len(SYSTEM)


def test_colliding_block_hashes_cost_a_miss_never_the_daemon(monkeypatch):
    """Python hashes tuples of ints alike in every process, so a client could search offline for a
    prompt whose block hashes collide: two equal ones in one entry made evicting it raise KeyError
    out of the daemon's loop (an audit). Each cache now keys its hashes (BLAKE2b) with its own
    random key, and an entry whose hashes do collide is dropped cleanly; lookups compare
    tokens."""
    from target_node.serving import prefix_cache

    tokens = list(range(100, 148))
    one, other = PrefixCache(1 << 20), PrefixCache(1 << 20)
    assert prefix_cache.block_hashes(tokens, 48, one.key) != prefix_cache.block_hashes(tokens, 48, other.key)
    blocks = [tokens[:16], tokens[16:32], [7] * 16]  # under one key, blocks differing anywhere differ
    assert len({prefix_cache.block_hashes(b, 16, one.key)[0] for b in blocks}) == 3
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda tokens, limit, key=b"": [42] * (limit // BLOCK))
    cache = PrefixCache(1 << 20)
    cache.store(tokens, rows(48), None, ())
    assert cache.entries[next(iter(cache.entries))].hashes == [42, 42, 42]
    cache.store(tokens + list(range(20)), rows(68), None, ())  # replaces (drops) the colliding entry
    assert len(cache.entries) == 1 and cache.held == rows(68).numel() * 4
    assert cache.lookup([7] * 48 + [1], ()) is None  # same hashes, other tokens: a miss
    assert cache.lookup(tokens + [1], ()).length == 48
    cache.store(list(range(5000, 5100)), rows(32_760), None, ())  # evicts the colliding entry too
    assert len(cache.entries) == 1 and cache.lookup(tokens + [1], ()) is None


# --- on the engine -------------------------------------------------------------------------------


def run(target: TargetModel, seq: Sequence) -> Sequence:
    while not seq.done:
        step(target, [seq])
    return seq


@pytest.mark.parametrize("dtype", DTYPES)
def test_reused_rows_leave_the_slot_bit_for_bit_as_a_fresh_prefill_does(dtype):
    """The rows a hit copies in, and every row the request computes after them, equal a fresh
    prefill's in every bit: the cache of the slot that reused them against the slot that did not."""
    target = TargetModel(tiny_target("llama", seed=5, dtype=DTYPES[dtype]).model, slots=2)
    cache = PrefixCache(64 << 20)
    first = run(target, Sequence(target, SYSTEM + [7, 8], NoProposer(), DecodeOptions(20, stop_on_eos=False), slot=0))
    tokens, kv, features, _ = first.committed()
    cache.store(tokens, kv, features, ())
    prompt = SYSTEM + [7, 8] + first.output.tokens + [40, 41, 42]
    hit = cache.lookup(prompt, ())
    assert hit is not None and hit.length == len(SYSTEM) + 2 + 19
    reused = Sequence(target, prompt, NoProposer(), DecodeOptions(12, stop_on_eos=False), slot=1)
    reused.reuse(hit.length, hit.kv, hit.features)
    run(target, reused)
    fresh = run(target, Sequence(target, prompt, NoProposer(), DecodeOptions(12, stop_on_eos=False), slot=0))
    assert reused.output.tokens == fresh.output.tokens and reused.stats.cached_tokens == hit.length
    held = target.length_of(1)
    assert held == target.length_of(0) == len(prompt) + 11
    kv = target.engine.cache.kv
    assert torch.equal(kv[:, :, 1, :, :held], kv[:, :, 0, :, :held])


# --- through the daemon -------------------------------------------------------------------------


@contextmanager
def served(target: TargetModel, proposers: list, cache_bytes: int, tmp_path, name: str, tree: int = 0):
    settings = ServiceSettings(always_draft=True, tree_nodes=tree, prefix_cache_mb=cache_bytes / (1 << 20))
    service = TargetService(target, proposers, settings)
    address = f"ipc://{tmp_path}/{name}.sock"
    with serving_in_thread(service.serve, address):
        client = TargetClient(address, timeout_s=120)
        try:
            yield client, service
        finally:
            client.close()


def chat(client: TargetClient, turns: int, sampling: dict, seed: int = 0) -> list[dict]:
    """A conversation of token ids: each turn's prompt is the history, its answer and a new question."""
    rng = random.Random(seed)
    history, replies = list(SYSTEM), []
    for _ in range(turns):
        history += [rng.randrange(3, 250) for _ in range(rng.randrange(3, 12))]
        done = client.generate(token_ids=history, max_new_tokens=24, sampling=sampling, stream=False)
        replies.append(done)
        history += done["token_ids"]
    return replies


def assert_each_turn_greedy(target: TargetModel, replies: list[dict], seed: int = 0) -> None:
    """Each turn of a `chat` is the target's own greedy answer to its history."""
    rng = random.Random(seed)
    history = list(SYSTEM)
    for reply in replies:
        history += [rng.randrange(3, 250) for _ in range(rng.randrange(3, 12))]
        assert reply["token_ids"] == greedy(target, history, 24)
        history += reply["token_ids"]


def drafting(target: TargetModel, slots: int, ring: int = 4096) -> list[DFlashProposer]:
    drafter = random_drafter(config_for_target(target.config, block_size=8, taps=2), seed=4)
    together = DraftPass(drafter)
    return [DFlashProposer(LocalDraftBackend(drafter, ring, drafting_pass=together)) for _ in range(slots)]


@pytest.mark.parametrize("mode", ["chain", "seeded"])
def test_a_chat_longer_than_the_drafters_ring_still_starts_from_its_last_turn(mode, tmp_path):
    """Past the ring's capacity the proposer held no features from position 0, so each entry was
    stored without them and a drafting request never started from it: every later turn re-ran the
    whole chat (an audit). An entry now keeps the ring's last rows, and a hit fills the ring as a
    prefill of the prefix would: the drafts proposed and accepted are those without the cache."""
    target = TargetModel(tiny_target("llama", seed=5).model, slots=1)
    sampling = {"temperature": 0.8, "seed": 11} if mode == "seeded" else {}
    runs = {}
    for cached in (True, False):
        cache = (64 << 20) if cached else 0
        with served(target, drafting(target, 1, ring=48), cache, tmp_path, f"ring-{mode}-{cached}") as (client, svc):
            runs[cached] = chat(client, 5, sampling)
            if cached:  # one entry for the chat: each turn's took the earlier rows of the one it extends
                assert len(svc.prefix_cache.entries) == 1
    for hit, miss in zip(runs[True], runs[False], strict=True):
        assert hit["token_ids"] == miss["token_ids"]
        assert (hit["stats"]["proposed"], hit["stats"]["accepted"]) == (
            miss["stats"]["proposed"],
            miss["stats"]["accepted"],
        )
    history = len(SYSTEM) + sum(r["stats"]["new_tokens"] for r in runs[True][:1])
    assert history > 48  # the ring had wrapped by the second turn
    assert all(r["stats"]["cached_tokens"] > 48 for r in runs[True][1:])


def test_an_entry_whose_features_start_past_0_serves_only_what_they_reach():
    """Features of positions [32, 64): an asker reading 32 positions back may start from all 64
    positions, not from fewer (its prefill would have left it rows before 32), nor one that reads
    the whole context back; and it stands in for no entry whose features start earlier."""
    cache = PrefixCache(1 << 20)
    tokens = list(range(64))
    cache.store(tokens, rows(64), torch.ones(32, 8), (0, 2), features_from=32)
    cache.store(tokens[:32], rows(32), torch.zeros(32, 8), (0, 2))
    assert len(cache.entries) == 2  # the shorter one serves prefixes the longer cannot
    hit = cache.lookup(tokens + [1], (0, 2), reach=32)
    assert hit.length == 64 and hit.features_from == 32 and float(hit.features[0, 0]) == 1.0
    hit = cache.lookup(tokens[:50] + [1], (0, 2), reach=32)
    assert hit.length == 32 and hit.features_from == 0  # the shorter entry's, from 0
    assert cache.lookup(tokens + [1], (0, 2)).length == 32  # reading all the way back: from 0 only
    assert cache.lookup(tokens + [1], ()).length == 64  # no drafter: the rows alone
    # Stored the other way round, the longer one takes the shorter one's earlier rows and replaces it.
    again = PrefixCache(1 << 20)
    again.store(tokens[:32], rows(32), torch.zeros(32, 8), (0, 2))
    again.store(tokens, rows(64), torch.ones(32, 8), (0, 2), features_from=32)
    (entry,) = again.entries.values()
    assert entry.features_from == 0 and entry.features.shape == (64, 8) and float(entry.features[40, 0]) == 1.0
    hit = again.lookup(tokens[:50] + [1], (0, 2), reach=32)
    assert hit.length == 50 and hit.name == ""  # no draft daemon kept a context under its name
    # Several it extends: it reaches back as far as the furthest, and holds them all.
    chained = PrefixCache(1 << 20)
    chained.store(tokens[:48], rows(48), torch.zeros(24, 8), (0, 2), features_from=24)
    chained.store(tokens[:32], rows(32), torch.zeros(32, 8), (0, 2))
    chained.store(tokens, rows(64), torch.ones(16, 8), (0, 2), features_from=48)
    (entry,) = chained.entries.values()
    assert entry.features_from == 0 and entry.features.shape == (64, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["chain", "tree", "seeded"])
def test_a_chat_with_the_cache_is_the_chat_without_it_bit_for_bit(dtype, mode, tmp_path):
    """Each turn starts from the previous turn's rows (its answer included), and the output, the
    drafts proposed and the drafts accepted are those of the same chat without the cache."""
    target = TargetModel(tiny_target("llama", seed=5, dtype=DTYPES[dtype]).model, slots=2)
    sampling = {"temperature": 0.8, "seed": 11} if mode == "seeded" else {}
    tree = 6 if mode == "tree" else 0
    runs, reports = {}, {}
    for cached in (True, False):
        cache = (64 << 20) if cached else 0
        with served(target, drafting(target, 2), cache, tmp_path, f"{mode}-{cached}", tree) as (client, service):
            runs[cached] = chat(client, 4, sampling)
            reports[cached] = service.report()
    with_cache, without = runs[True], runs[False]
    assert [r["token_ids"] for r in with_cache] == [r["token_ids"] for r in without]
    for hit, miss in zip(with_cache, without, strict=True):
        assert (hit["stats"]["proposed"], hit["stats"]["accepted"]) == (
            miss["stats"]["proposed"],
            miss["stats"]["accepted"],
        )
    reused = [r["stats"]["cached_tokens"] for r in with_cache]
    assert reused[0] == 0 and all(n > len(SYSTEM) for n in reused[1:])
    assert all(r["stats"]["cached_tokens"] == 0 for r in without)
    stats = reports[True]
    assert stats["prefix_cache"]["hits"] == 3 and stats["cached_prompt_tokens"] == sum(reused)
    assert reports[False]["prefix_cache"] is None
    if mode != "seeded":
        assert_each_turn_greedy(target, with_cache)


def test_a_cache_that_fails_to_store_costs_its_shortcut_not_the_answer(tmp_path, monkeypatch):
    """Storing rows is a shortcut for later requests: where it raises, the daemon (whose loop the
    prompt's store ran in unguarded) serves on and every answer is the greedy one."""
    target = TargetModel(tiny_target("llama", seed=5).model, slots=1)

    def broken(*args, **kwargs):
        raise RuntimeError("no room")

    monkeypatch.setattr(PrefixCache, "store", broken)
    with served(target, [NoProposer()], 64 << 20, tmp_path, "broken") as (client, service):
        for prompt in (SYSTEM + [1], SYSTEM + [2]):
            done = client.generate(token_ids=prompt, max_new_tokens=8, stream=False)
            assert done["token_ids"] == greedy(target, prompt, 8) and done["stats"]["cached_tokens"] == 0


def test_a_request_starts_from_the_prompt_of_one_still_running(tmp_path):
    target = TargetModel(tiny_target("llama", seed=5).model, slots=2)
    first, second = SYSTEM + [9, 8, 7], SYSTEM + [9, 8, 6, 5]
    with served(target, [NoProposer(), NoProposer()], 64 << 20, tmp_path, "running") as (client, _):
        stream = client.stream(token_ids=first, max_new_tokens=200)
        next(stream)  # its first token: its prompt is in, and its rows stored while it decodes on
        other = TargetClient(f"ipc://{tmp_path}/running.sock", timeout_s=60)
        try:
            done = other.generate(token_ids=second, max_new_tokens=10, stream=False)
        finally:
            other.close()
        rest = list(stream)
    assert done["stats"]["cached_tokens"] == len(SYSTEM) + 2
    assert done["token_ids"] == greedy(target, second, 10)
    assert rest[-1]["finish_reason"] == "length" and rest[-1]["stats"]["cached_tokens"] == 0


def test_under_pressure_the_cache_holds_its_bound_and_every_answer_is_exact(tmp_path):
    """A cache with room for about two prompts, and many clients' prompts through it."""
    target = TargetModel(tiny_target("llama", seed=5).model, slots=2)
    per_position = target.engine.cache.bytes_per_position()
    bound = per_position * 130
    rng = random.Random(3)
    with served(target, [NoProposer(), NoProposer()], bound, tmp_path, "pressure") as (client, service):
        cache = service.prefix_cache
        assert cache.max_bytes == bound
        for i in range(16):
            prompt = (SYSTEM if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(20, 70))]
            done = client.generate(token_ids=prompt, max_new_tokens=8, stream=False)
            assert done["token_ids"] == greedy(target, prompt, 8)
            assert cache.held <= bound
        stats = service.report()["prefix_cache"]
    assert stats["evicted"] > 0 and stats["bytes"] <= bound and stats["hits"] > 0


def test_a_hit_after_the_draft_daemon_restarted_drafts_remotely_from_the_stored_features(tmp_path):
    """The third turn of a chat starts from stored rows after the draft daemon was replaced: the
    new daemon gets the prefix's feature rows from the cache entry, drafts, and the output is exact."""
    target = tiny_target("qwen3", seed=4)
    cfg = config_for_target(target.config, block_size=8, taps=2)
    checkpoint = save_drafter(random_drafter(cfg, seed=1, std=0.1), tmp_path / "drafter")
    address = f"ipc://{tmp_path}/draft.sock"
    with ExitStack() as first_daemon:
        first_daemon.enter_context(draft_daemon(address, checkpoint))
        backend = RemoteDraftBackend(
            address, target, timing=LinkTiming(timeout_s=1.0, probe_timeout_s=0.2, retry_s=0.2)
        )
        proposer = DFlashProposer(backend, NGramProposer())
        with served(target, [proposer], 64 << 20, tmp_path, "restart") as (client, _):
            history = list(SYSTEM)
            for turn in range(3):
                if turn == 2:  # a new draft daemon on the same address, with none of the old sessions
                    first_daemon.close()
                    first_daemon.enter_context(draft_daemon(address, checkpoint))
                history += [100 + turn, 101 + turn, 102 + turn]
                done = client.generate(token_ids=history, max_new_tokens=24, stream=False)
                assert done["token_ids"] == greedy(target, history, 24)
                history += done["token_ids"]
        backend.close()
    stats = done["stats"]
    assert stats["cached_tokens"] > len(SYSTEM) and stats["sources"].get("dflash", 0) > 0
    assert backend.counters["restore_misses"] >= 1  # the new daemon held none of the old one's


def test_a_remote_drafter_restores_a_kept_prefix_and_drafts_as_if_sent_every_row(tmp_path):
    """Over a real draft daemon, two slots: each turn's hit restores the drafter's context kept
    under the entry's name (from whichever slot kept it), so the prefix's feature rows stay home;
    the drafts proposed and accepted, and the output, are those of the chat without the cache."""
    target = TargetModel(tiny_target("qwen3", seed=4).model, slots=2)
    cfg = config_for_target(target.config, block_size=8, taps=2)
    checkpoint = save_drafter(random_drafter(cfg, seed=1, std=0.1), tmp_path / "drafter")
    address = f"ipc://{tmp_path}/draft.sock"
    runs, sent, restores = {}, {}, {}
    with draft_daemon(address, checkpoint):
        for cached in (True, False):
            backends = [RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=5.0)) for _ in range(2)]
            proposers = [DFlashProposer(b, NoProposer()) for b in backends]
            cache = (64 << 20) if cached else 0
            with served(target, proposers, cache, tmp_path, f"remote-{cached}") as (client, _):
                runs[cached] = chat(client, 4, {})
            sent[cached] = sum(b.counters["bytes_out"] for b in backends)
            restores[cached] = [sum(b.counters[k] for b in backends) for k in ("restores", "restore_misses")]
            for backend in backends:
                backend.close()
    for hit, miss in zip(runs[True], runs[False], strict=True):
        assert hit["token_ids"] == miss["token_ids"]
        for count in ("proposed", "accepted"):
            assert hit["stats"][count] == miss["stats"][count]
    assert all(r["stats"]["cached_tokens"] > len(SYSTEM) for r in runs[True][1:])
    assert sent[True] < 0.6 * sent[False]  # the prefixes' feature rows did not travel again
    assert restores == {True: [3, 0], False: [0, 0]}  # a restore at each later turn, each a hit


def test_a_draft_daemon_that_claims_more_restored_rows_than_asked_costs_only_its_own_drafts(tmp_path):
    """`kept.rows` comes from the draft daemon: a count over what was asked for used to be trusted,
    and reading that many rows of the feature ring raised IndexError, which ended every request in
    the batch as `internal`, on every later prefix hit. Now it counts as none restored: the rows
    are sent, drafting goes on, and the output is the target's own."""
    from draft_node.daemon import DraftService, serve
    from draft_node.settings import DraftSettings
    from protocol import encode

    target = TargetModel(tiny_target("qwen3", seed=4).model, slots=2)
    cfg = config_for_target(target.config, block_size=8, taps=2)
    service = DraftService(random_drafter(cfg, seed=1, std=0.1), DraftSettings(ring_capacity=512))
    service.on_restore = lambda msg: encode("kept", msg.id, {"rows": 2**31 - 1})
    address = f"ipc://{tmp_path}/lying.sock"
    with serving_in_thread(lambda where, stop: serve(service, where, stop), address):
        backends = [RemoteDraftBackend(address, target, timing=LinkTiming(timeout_s=5.0)) for _ in range(2)]
        proposers = [DFlashProposer(b, NoProposer()) for b in backends]
        with served(target, proposers, 64 << 20, tmp_path, "lied-to") as (client, _):
            replies = chat(client, 3, {})
        for backend in backends:
            backend.close()
    assert all(r["stats"]["cached_tokens"] > len(SYSTEM) for r in replies[1:])  # the lie was heard
    assert sum(b.counters["errors"] for b in backends) >= 2
    assert sum(r["stats"]["sources"].get("dflash", 0) for r in replies[1:]) > 0  # drafting went on
    assert_each_turn_greedy(target, replies)


def test_a_feature_ring_may_begin_past_0_and_never_holds_what_it_lost():
    """A hit past the ring's capacity brings only the rows a prefill of the prefix leaves: the ring
    begins there. Positions it wrapped past stay gone when a rewrite below its end shortens it (a
    review: `oldest` came back down over slots later positions held)."""
    ring = FeatureRing(8, 2, torch.float32, "cpu")
    ring.write(100, torch.arange(60, dtype=torch.float32).view(30, 2))  # positions [100, 130): the last 8 held
    assert (ring.oldest, ring.length) == (122, 130)
    assert torch.equal(ring.read(122, 130)[:, 0], torch.arange(44, 60, 2, dtype=torch.float32))
    ring.write(127, torch.zeros(1, 2))  # a step rolled back to 127
    assert (ring.oldest, ring.length) == (122, 128)
    with pytest.raises(IndexError):
        ring.read(120, 128)
    with pytest.raises(ValueError, match="from 122"):
        ring.write(121, torch.zeros(1, 2))
    ring.reset()
    ring.write(0, torch.ones(3, 2))
    assert (ring.oldest, ring.length) == (0, 3)


def test_entries_are_held_in_host_memory_whatever_device_computed_them():
    """The cache's budget is a share of host memory; on a GPU its entries took device memory
    instead (an audit). Rows on another device are copied to the host as they are stored: here a
    tensor on the meta device stands for a GPU's, and its copy to the host is what is asked for."""
    asked = []

    class OnDevice(torch.Tensor):
        def to(self, *args, **kwargs):
            asked.append(args[0] if args else kwargs.get("device"))
            return torch.Tensor.to(torch.Tensor.as_subclass(self, torch.Tensor), *args, **kwargs)

    cache = PrefixCache(1 << 20)
    kv, features = rows(32).as_subclass(OnDevice), torch.zeros(32, 8).as_subclass(OnDevice)
    cache.store(list(range(32)), kv, features, (0, 2))
    assert asked == ["cpu", "cpu"] and len(cache.entries) == 1
