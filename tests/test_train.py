"""Drafter training: it learns, it round-trips, it resumes exactly, and it trains what inference runs."""

import calendar
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import greedy, long_ago, signals_as_in_a_terminal, tiny_target

import training.features as features_module
from answers.store import Answer, AnswerStore, AnswerStoreError, read_shard, shard_paths, write_shard
from draft_node import kernel_path
from draft_node.checkpoint import config_for_target, load_drafter, random_drafter, save_draft_vocab, save_drafter
from draft_node.config import FULL, SLIDING, CheckpointError
from launch.common import named_dtype
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer
from training.average import average_drafters
from training.batches import Batch, Sample, draft_vocabulary, make_batch
from training.drafter_starts import export_drafter
from training.estimate import by_kind, estimate, kind_table
from training.features import DiskReserve, FeatureCache, LiveFeatures, feature_folder
from training.generate import GenerateOptions, RefillGenerator
from training.generate import generate as generate_answers
from training.prompts import JOB_WEIGHTS, Ask, HeldOut
from training.trainer import Trainer, TrainingError, TrainOptions, acceptance_weights, mix_weights, train
from training.variety import answer_kind


class _TokenTarget:
    """Turns are token-id strings, so the tiny tokenizer-less target can 'chat'."""

    class _Tokenizer:
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def __init__(self, target):
        self.target, self.tokenizer = target, self._Tokenizer()

    def __getattr__(self, name):  # the engine, the model, eos ids: the wrapped target's
        return getattr(self.target, name)

    def encode_chat(self, messages):
        return [int(t) for m in messages for t in m["content"].split()]


def _openings(count: int, seed: int = 0, follow_every: int = 0, held: int = 0) -> list[Ask]:
    """`count` one-turn jobs of random token ids, the first `held` of them in the held-out split."""
    gen = torch.Generator().manual_seed(seed)
    names = (f"job-{seed}-{i}" for i in itertools.count())
    held_names = [n for n in itertools.islice(names, 10_000) if Answer(n, n, "", [], [], 0).held_out][:held]
    plain = (n for n in names if not Answer(n, n, "", [], [], 0).held_out)
    out = []
    for i in range(count):
        ids = torch.randint(3, 300, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
        then = "5 6 7" if follow_every and i % follow_every == 0 else ""
        job = held_names[i] if i < len(held_names) else next(plain)
        out.append(Ask(job, "answer", (("user", " ".join(map(str, ids))),), then))
    return out


pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = dict(opts=GenerateOptions(batch=8, max_new=48, held_out=HeldOut([])), log=lambda m: None)


@pytest.fixture(scope="module")
def setup(one_thread, tmp_path_factory):
    target = tiny_target(layers=4, slots=8)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    store = AnswerStore(tmp_path_factory.mktemp("answers"))
    features = FeatureCache(tmp_path_factory.mktemp("features"), cfg.feature_width)
    openings = _openings(56, held=8)
    generate_answers(
        _TokenTarget(target), store, iter(openings), features=features, layer_ids=cfg.target_layer_ids, **QUIET
    )
    return target, cfg, store, features


def opts(**kw):
    base = dict(lr=5e-3, warmup=10, steps=400, batch=8, anchors=8, val_answers=8, eval_every=0, save_every=0)
    base.update(kw)
    return TrainOptions(**base)


def test_store_round_trips_resumes_and_keeps_its_split(setup, tmp_path):
    target, cfg, store, features = setup
    assert len(store) == 56 and all(a.answer_tokens >= 1 for a in store.answers)
    # What the answers' bits depend on, beside each (bf16 answers of one CPU differed from another's).
    assert {a.made_by for a in store.answers} == {target.numerics} and target.numerics.startswith("float32 engine on ")
    again = AnswerStore(store.folder)  # reopening keeps every answer, byte for byte
    assert [a.__dict__ for a in again.answers] == [a.__dict__ for a in store.answers]
    held = {a.key for a in again.answers if a.held_out}
    assert len(held) == 8
    # Append more: a new shard, the old answers untouched, nothing done twice.
    shards = sorted(store.folder.glob("*.jsonl.xz"))
    more = _openings(56, held=8) + _openings(30, seed=1)
    made = generate_answers(_TokenTarget(target), again, iter(more), **QUIET)
    assert made == 30 and len(again) == 86
    assert sorted(store.folder.glob("*.jsonl.xz"))[: len(shards)] == shards
    grown = AnswerStore(store.folder)
    assert len(grown) == 86
    assert held == {a.key for a in grown.answers[:56] if a.held_out}  # an answer never changes sides
    assert grown.answer_tokens == sum(len(a.tokens) - a.prompt_len for a in grown.answers)
    keys_only = AnswerStore(store.folder, hold=False)  # generation's: keys and totals, not the answers
    assert (len(keys_only), keys_only.answer_tokens, keys_only.keys) == (86, grown.answer_tokens, grown.keys)
    assert keys_only.answers == [] and list(keys_only.stored()) == grown.answers == list(grown.stored())


def test_shards_started_in_one_second_read_back_in_the_order_written(tmp_path, monkeypatch):
    """A random tag decides the order of two shards named in the same second; reopening must
    still read the older shard's answers first (CI once saw the newer shard sort first)."""
    import answers.store as answer_store

    tags = iter(["f" * 32, "0" * 32, "8" * 32])
    monkeypatch.setattr(answer_store.uuid, "uuid4", lambda: type("U", (), {"hex": next(tags)})())
    stopped_clock(monkeypatch, answer_store, calendar.timegm((2026, 12, 2, 12, 56, 18)))

    def answer(i: int) -> Answer:
        return Answer(f"k{i}", f"j{i}", "text", [["user", str(i)]], tokens=[1, 2, 3], prompt_len=1)

    written = []
    for i in range(3):  # three runs, each its own store and shard, all in one second
        store = AnswerStore(tmp_path, shard_records=1)
        assert store.add(answer(i))
        store.flush()
        written.append(f"k{i}")
    names = sorted(p.name for p in tmp_path.glob("*.jsonl.xz"))
    assert len(names) == 3 and names[0] == "20261202-125618-ffffffff.jsonl.xz"
    assert [a.key for a in AnswerStore(tmp_path).answers] == written


def stopped_clock(monkeypatch, module, seconds: float, real=time.gmtime) -> None:
    """`module`'s UTC wall clock reads `seconds` from now on (other dates convert as ever)."""
    monkeypatch.setattr(module.time, "gmtime", lambda secs=None: real(seconds if secs is None else secs))


def test_shards_named_after_the_clock_stepped_back_keep_their_length_and_order(tmp_path, monkeypatch):
    """A shard's name must sort after the last one's: with the clock stepped back an hour each name
    extended the last by 9 characters, and the 24th was too long to write (an audit). Now each is
    stamped a second after the last, as long as any other."""
    import answers.store as answer_store

    def answer(i: int) -> Answer:
        return Answer(f"k{i}", f"j{i}", "text", [["user", str(i)]], tokens=[1, 2, 3], prompt_len=1)

    now = calendar.timegm((2026, 12, 2, 12, 0, 0))
    stopped_clock(monkeypatch, answer_store, now)
    first = AnswerStore(tmp_path, shard_records=1)
    first.add(answer(0))
    first.flush()
    stopped_clock(monkeypatch, answer_store, now - 3600)
    store = AnswerStore(tmp_path, shard_records=1)
    for i in range(1, 40):
        assert store.add(answer(i))
    store.flush()
    names = [p.name for p in sorted(tmp_path.glob("*.jsonl.xz"))]
    assert len(names) == 40 and {len(name) for name in names} == {len(names[0])}
    assert names[0].startswith("20261202-120000-") and names[-1].startswith("20261202-120039-")
    assert [a.key for a in AnswerStore(tmp_path).answers] == [f"k{i}" for i in range(40)]


def test_a_store_of_gzip_shards_reads_on_and_grows_in_xz_and_xz_is_smaller(tmp_path):
    """Shards written before 2026-12-05 (gzip), or by an older checkout elsewhere, stay readable in
    their place in the order; new ones are xz, and the same answers take fewer bytes, since a
    conversation's follow-up repeats its earlier turns beyond gzip's 32 KB window."""
    import gzip
    import json
    import random
    from dataclasses import asdict

    def answer(i: int, turns: int) -> Answer:
        said = random.Random(i)
        ids = [said.randrange(49152) for _ in range(300 * turns)]  # a follow-up repeats the turns before
        return Answer(f"k{i}-{turns}", f"j{i}", "text", [["user", str(i)]], tokens=[1, *ids], prompt_len=1)

    old = [answer(i, t) for t in (1, 2, 3) for i in range(40)]  # turns far apart, as generation writes them
    with gzip.open(tmp_path / "20261201-000000-abcd.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(asdict(a), separators=(",", ":")) + "\n" for a in old)
    store = AnswerStore(tmp_path)
    assert [a.key for a in store.answers] == [a.key for a in old]
    assert store.add(answer(99, 1)) and not store.add(old[0])  # a key in the old shard is done
    store.flush()
    names = [p.name for p in shard_paths(tmp_path)]
    assert names[0] == "20261201-000000-abcd.jsonl.gz" and names[1].endswith(".jsonl.xz") and len(names) == 2
    assert [a.key for a in AnswerStore(tmp_path).answers] == [a.key for a in old] + ["k99-1"]
    write_shard(tmp_path / "again.jsonl.xz", old)
    assert read_shard(tmp_path / "again.jsonl.xz") == old
    assert (tmp_path / "again.jsonl.xz").stat().st_size < 0.8 * (
        tmp_path / "20261201-000000-abcd.jsonl.gz"
    ).stat().st_size


def test_a_shard_a_newer_version_wrote_reads_without_its_new_fields_and_a_broken_one_still_fails(tmp_path):
    """An older checkout sharing a store dropped every shard written after a field was added
    (`made_by`: TypeError, the whole shard unreadable: an audit). A field it does not know is left
    out; a field it needs, missing, or a line that is no record, still refuses the shard."""
    import json
    import lzma

    known = {"key": "k1", "job": "j1", "stage": "text", "messages": [["user", "hi"]], "tokens": [1, 2, 3]}

    def shard(name: str, *records) -> Path:
        with lzma.open(tmp_path / name, "wt") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
        return tmp_path / name

    newer = shard("newer.jsonl.xz", known | {"prompt_len": 1, "made_by": "bf16", "a_later_field": [1]})
    assert read_shard(newer) == [Answer(**known, prompt_len=1, made_by="bf16")]
    for broken in (known, ["a", "list"]):  # prompt_len missing; not a record
        with pytest.raises(AnswerStoreError, match="not a readable answer shard"):
            read_shard(shard("broken.jsonl.xz", broken))


def test_a_shard_line_past_the_limit_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    """A shard is read line by line, and a line of any length was read whole: 61 KB of xz made 883
    MB before the shard was refused, and 6 MB of it would ask for 88 GB (an audit). A line past the
    limit refuses the shard, a valid answer on it too; the index's first look at a shard skips it."""
    import answers.store
    from answers.index import first_model

    monkeypatch.setattr(answers.store, "MAX_LINE_CHARS", 1000, raising=False)
    fine = Answer(key="k", job="j", stage="text", messages=[["user", "hi"]], tokens=[1, 2], prompt_len=1, model="m")
    write_shard(tmp_path / "fine.jsonl.xz", [fine, fine])
    assert read_shard(tmp_path / "fine.jsonl.xz") == [fine, fine] and first_model(tmp_path / "fine.jsonl.xz") == "m"
    import json
    from dataclasses import asdict

    exactly = len(json.dumps(asdict(fine), separators=(",", ":")))  # a line of the limit's length, its newline past it
    monkeypatch.setattr(answers.store, "MAX_LINE_CHARS", exactly, raising=False)
    assert read_shard(tmp_path / "fine.jsonl.xz") == [fine, fine]
    monkeypatch.setattr(answers.store, "MAX_LINE_CHARS", 1000, raising=False)
    long = Answer(**{**fine.__dict__, "key": "k" * 2000})  # a valid answer on a line of 2,100 characters
    write_shard(tmp_path / "long.jsonl.xz", [fine, long])
    with pytest.raises(AnswerStoreError, match="a line longer than 1000 characters"):
        read_shard(tmp_path / "long.jsonl.xz")
    write_shard(tmp_path / "first.jsonl.xz", [long])
    assert first_model(tmp_path / "first.jsonl.xz") == ""


@pytest.mark.parametrize("hold", [True, False])
def test_a_crash_mid_conversation_resumes_with_its_next_turn(setup, tmp_path, hold):
    """Resumed from a store that holds its answers (training's) or only their keys and totals
    (generation's, which held 5 GB for 300,000 answers it never read again: an audit)."""
    target, cfg, store, features = setup
    tiny = _TokenTarget(target)
    folder = tmp_path / "answers"
    openings = _openings(12, seed=2, follow_every=3)  # jobs 0, 3, 6, 9 have a second turn
    generate_answers(tiny, AnswerStore(folder), iter(openings), **QUIET)
    full = AnswerStore(folder)
    followups = [a for a in full.answers if a.stage == "followup"]
    assert len(full) == 16 and len(followups) == 4
    assert all(len(a.messages) == 3 and a.messages[1][0] == "assistant" for a in followups)
    # Drop the follow-ups, as if generation died before they were answered: a resumed run
    # with no new openings answers exactly those.
    for path in folder.glob("*.jsonl.xz"):
        path.unlink()
    cut = AnswerStore(folder)
    for a in full.answers:
        if a.stage != "followup":
            cut.add(a)
    cut.flush()
    resumed = AnswerStore(folder, hold=hold)
    assert len(resumed) == 12 and (resumed.answers == []) == (not hold)
    assert generate_answers(tiny, resumed, iter([]), **QUIET) == 4
    assert {a.key for a in AnswerStore(folder).answers} == {a.key for a in full.answers}


def test_a_feature_fill_stops_at_its_deadline_and_counts_what_it_added(setup, tmp_path, monkeypatch):
    """A time-boxed fill (--feature-minutes) stops between batches; what it filled is the store's
    first window in store order, not the shortest answers of the whole store."""
    target, cfg, store, _ = setup
    some = store.answers[:12]
    late = FeatureCache(tmp_path / "late", cfg.feature_width)
    assert late.fill(some, target, cfg.target_layer_ids, deadline=time.monotonic() - 1, log=None) == 0
    assert len(late) == 0
    monkeypatch.setattr(features_module, "WINDOW", 4)
    clock = iter([0.0, 0.0, 1e12])  # time for two checks of the deadline: one batch, then time is up
    monkeypatch.setattr(features_module.time, "monotonic", lambda: next(clock, 1e12))
    part = FeatureCache(tmp_path / "part", cfg.feature_width)
    added = part.fill(some, target, cfg.target_layer_ids, batch_tokens=10**6, deadline=0.5, log=None)
    assert added == len(part) == 4 and {a.key for a in some[:4]} == set(part.index)


def test_a_feature_fill_stops_before_the_disk_is_full(setup, tmp_path, monkeypatch):
    """On a fast device the fill outruns the disk (5.8 KB a token): it stops between batches while
    `keep_free` bytes are left, keeping what it wrote, and says why."""
    target, cfg, store, _ = setup
    some = store.answers[:12]
    monkeypatch.setattr(features_module, "WINDOW", 4)
    free = iter([10**12, 10**12])  # room at the start and for one batch, then the disk is nearly full
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda _: shutil_usage(next(free, 10)))
    said = []
    part = FeatureCache(tmp_path / "part", cfg.feature_width)
    added = part.fill(some, target, cfg.target_layer_ids, batch_tokens=10**6, keep_free=1000, log=said.append)
    assert added == len(part) == 4 and {a.key for a in some[:4]} == set(part.index)
    assert said[-1] == "features: the disk is nearly full with 8 of 12 answers left"


def test_a_disk_that_starts_with_less_than_keep_free_still_takes_a_fill_that_fits(setup, tmp_path, monkeypatch):
    """A small or busy disk (CI's has had under 4 GiB free) keeps half of what was free at the start,
    not a fixed 4 GiB it never had: the fill runs until half the room is gone."""
    target, cfg, store, _ = setup
    some = store.answers[:12]
    monkeypatch.setattr(features_module, "WINDOW", 4)
    free = iter([3 * 2**30, 3 * 2**30, 2 * 2**30])  # start, two batches, then below half the start
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda _: shutil_usage(next(free, 2**30)))
    said = []
    part = FeatureCache(tmp_path / "part", cfg.feature_width)
    added = part.fill(some, target, cfg.target_layer_ids, batch_tokens=10**6, log=said.append)
    assert added == len(part) == 8 and {a.key for a in some[:8]} == set(part.index)
    assert said[-1] == "features: the disk is nearly full with 4 of 12 answers left"


def test_a_caches_disk_reserve_is_a_tenth_of_the_disk_or_4_gib_or_half_the_room_there_is(tmp_path, monkeypatch):
    gb = 10**9
    for total, free, floor in [(1000 * gb, 400 * gb, 100 * gb), (10 * gb, 9 * gb, 4 * 2**30), (10 * gb, 2 * gb, gb)]:
        usage = shutil_usage(free)._replace(total=total)
        monkeypatch.setattr(features_module.shutil, "disk_usage", lambda _, usage=usage: usage)
        assert DiskReserve(tmp_path).floor == floor
    assert DiskReserve(tmp_path, keep_free=1000).floor == 1000


def test_generation_stops_keeping_features_before_the_disk_is_full_and_goes_on_answering(setup, tmp_path, monkeypatch):
    """A generator left running for hours wrote 5.8 KB of rows a token until the disk was full (and
    the next CI run on that disk failed): past the cache's reserve it keeps answering, stores no
    more rows, and says so once; the rows it kept are whole."""
    target, cfg, _, _ = setup
    free = iter([2 * 10**9, 10**9, 10**9])  # the reserve is 1e9 (half the start); two answers fit, then full
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda _: shutil_usage(next(free, 10)))
    store = AnswerStore(tmp_path / "answers")
    features = FeatureCache(tmp_path / "features", cfg.feature_width)
    said = []
    quiet = dict(QUIET, log=said.append)
    done = generate_answers(
        _TokenTarget(target),
        store,
        iter(_openings(12, seed=5)),
        features=features,
        layer_ids=cfg.target_layer_ids,
        **quiet,
    )
    assert done == len(store) == 12 and len(features) == 2
    for key in features.index:
        answer = next(a for a in store.answers if a.key == key)
        assert features.get(key).shape == (len(answer.tokens) - 1, cfg.feature_width)
    assert sum("the disk is nearly full" in line for line in said) == 1


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(total=2 * free, used=free, free=free)


def test_features_recomputed_from_ids_are_the_bits_generation_captured_and_serving_taps(setup, tmp_path):
    """Prefill on the engine, generation's decode steps and a serving forward compute each row as if
    alone: one answer's features are the same bits whichever computed them (after fp16 storage)."""
    target, cfg, store, features = setup
    assert len(features) == len(store)
    again = FeatureCache(tmp_path / "fresh", cfg.feature_width)
    some = store.answers[:40]
    assert again.fill(some, target, cfg.target_layer_ids, batch_tokens=256, log=None) == 40
    for a in some:
        captured, recomputed = features.get(a.key), again.get(a.key)
        assert captured.shape == recomputed.shape == (len(a.tokens) - 1, cfg.feature_width)
        assert torch.equal(recomputed, captured), a.key
    target.reset()
    _, served = target.forward(some[0].tokens[:-1], cfg.target_layer_ids)
    assert torch.equal(features.get(some[0].key), served.to(torch.float16).float())


def test_off_the_engine_a_fill_is_one_padded_forward_whose_rows_are_each_answers_alone(setup, tmp_path):
    """Off the engine (as on a GPU today) answers of different lengths share one right-padded
    forward, and the padding after an answer changes none of its rows beyond rounding."""
    _, cfg, store, features = setup
    target = tiny_target(layers=4, engine=False)
    some = store.answers[:12]
    calls = []
    real = target.path.features_batch
    target.path.features_batch = lambda tokens, taps: calls.append(len(tokens)) or real(tokens, taps)
    batched = FeatureCache(tmp_path / "batched", cfg.feature_width)
    assert batched.fill(some, target, cfg.target_layer_ids, batch_tokens=10**6, log=None) == 12
    assert calls == [12] and len({len(a.tokens) for a in some}) > 1
    for a in some:
        target.reset()
        _, alone = target.forward(a.tokens[:-1], cfg.target_layer_ids)
        got = batched.get(a.key)
        assert got.shape == alone.shape
        assert torch.allclose(got, alone.to(torch.float16).float(), rtol=2e-3, atol=2e-3), a.key


def test_bf16_features_filled_by_prefill_are_the_bits_bf16_generation_captured(tmp_path):
    """The same in bf16, the dtype a native-bf16 machine serves and now trains in."""
    target = tiny_target(layers=2, slots=4, dtype=torch.bfloat16)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    store = AnswerStore(tmp_path / "answers")
    captured = FeatureCache(tmp_path / "captured", cfg.feature_width)
    gen = dict(QUIET, opts=GenerateOptions(batch=4, max_new=24, held_out=HeldOut([])))
    taps = cfg.target_layer_ids
    generate_answers(_TokenTarget(target), store, iter(_openings(6, held=0)), features=captured, layer_ids=taps, **gen)
    filled = FeatureCache(tmp_path / "filled", cfg.feature_width)
    assert filled.fill(store.answers, target, taps, log=None) == len(store) == 6
    for a in store.answers:
        assert torch.equal(filled.get(a.key), captured.get(a.key)), a.key


def test_features_live_in_a_folder_per_dtype(tmp_path):
    """bf16 features (a bf16-serving machine's) never mix with fp32 ones; fp32 keeps its old folder."""
    fp32 = feature_folder(tmp_path, "/m/SmolLM2", (1, 8), torch.float32)
    bf16 = feature_folder(tmp_path, "/m/SmolLM2", (1, 8), torch.bfloat16)
    assert fp32 == tmp_path / "features" / "SmolLM2-taps1-8"
    assert bf16 == tmp_path / "features" / "SmolLM2-taps1-8-bfloat16"


def test_training_lowers_loss_and_beats_a_random_drafter(setup, tmp_path):
    target, cfg, store, features = setup
    trainer = train(
        target, cfg, store.answers, features, opts(out=tmp_path / "out"), tmp_path / "state.pt", log=lambda m: None
    )
    first, last = sum(trainer.history[:20]) / 20, sum(trainer.history[-20:]) / 20
    assert last < first * 0.7, (first, last)
    trained = trainer.evaluate(trainer.train_records, anchors=8)
    trainer.drafter.load_state_dict(random_drafter(cfg, seed=3).state_dict())
    trainer.scale = torch.ones_like(trainer.scale)
    baseline = trainer.evaluate(trainer.train_records, anchors=8)
    assert trained["tau"] > baseline["tau"] + 0.3, (trained, baseline)

    # The exported checkpoint loads, and speculative output stays the target's own greedy output.
    drafter = load_drafter(tmp_path / "out")
    # Always draft (no governor), so acceptance measures the drafter.
    accepted = 0
    for a in store.answers[:4]:
        prompt = a.tokens[: a.prompt_len]
        result = generate(target, prompt, DFlashProposer(LocalDraftBackend(drafter)), DecodeOptions(40, adaptive=False))
        assert result.tokens == greedy(target, prompt, 40)
        accepted += result.stats.accepted
    assert accepted > 0


def test_training_under_bf16_autocast_runs_the_drafter_in_bf16_and_learns(setup, tmp_path):
    """--autocast (TrainOptions.autocast): the drafter's matmuls run in bf16, the loss and the weights
    stay fp32, and it learns as the fp32 run does, within bf16's rounding."""
    target, cfg, store, features = setup
    seen = []
    runs = {}
    for on in (False, True):
        trainer = Trainer(target, cfg, store.answers, features, opts(steps=60, autocast=on))
        hook = trainer.drafter.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        runs[on] = [trainer.train_step() for _ in range(60)]
        hook.remove()
        assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
    assert set(seen[: len(seen) // 2]) == {torch.float32} and set(seen[len(seen) // 2 :]) == {torch.bfloat16}
    fp32, bf16 = runs[False], runs[True]
    assert sum(bf16[-10:]) < 0.95 * sum(bf16[:10]) and sum(fp32[-10:]) < 0.95 * sum(fp32[:10])  # they learn
    assert abs(sum(bf16[-10:]) - sum(fp32[-10:])) / sum(fp32[-10:]) < 0.05  # as fp32 does
    from training.stages import autocast

    assert autocast("off", "cuda") is False and autocast("on", "cpu") is True


def test_init_from_a_checkpoint_continues_where_it_left(setup, tmp_path):
    target, cfg, store, features = setup
    first = train(
        target,
        cfg,
        store.answers,
        features,
        opts(steps=150, out=tmp_path / "out"),
        tmp_path / "a.pt",
        log=lambda m: None,
    )
    before = first.evaluate(first.val_records)
    # A fresh run started from the exported checkpoint (scale folded in, bf16) predicts as well.
    second = Trainer(target, cfg, store.answers, features, opts(steps=150))
    second.init_from(load_drafter(tmp_path / "out"))
    after = second.evaluate(second.val_records)
    assert after["loss"] == pytest.approx(before["loss"], rel=0.02)
    fresh = Trainer(target, cfg, store.answers, features, opts(steps=150)).evaluate()
    assert after["loss"] < fresh["loss"] - 0.1


def test_a_drafter_grown_from_a_checkpoint_starts_out_equal_to_it_and_then_learns(setup, tmp_path):
    target, cfg, store, features = setup
    train(
        target,
        cfg,
        store.answers,
        features,
        opts(steps=60, out=tmp_path / "out"),
        tmp_path / "a.pt",
        log=lambda m: None,
    )
    shallow = Trainer(target, cfg, store.answers, features, opts())
    shallow.init_from(load_drafter(tmp_path / "out"))
    deep_cfg = replace(cfg, num_hidden_layers=2, layer_types=(FULL, FULL))
    deep = Trainer(target, deep_cfg, store.answers, features, opts(steps=40))
    deep.init_from(load_drafter(tmp_path / "out"))
    batch = deep.batch(0)
    with torch.no_grad():
        torch.testing.assert_close(deep.logits(batch)[0], shallow.logits(batch)[0], atol=1e-5, rtol=1e-5)
    before = deep.evaluate()["loss"]
    for _ in range(40):
        deep.train_step()
    assert deep.evaluate()["loss"] < before
    added = dict(deep.drafter.named_parameters())
    assert added["layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # the new layer took part
    with pytest.raises(ValueError, match="--init drafter has config"):  # shrinking is not growing
        Trainer(target, cfg, store.answers, features, opts()).init_from(deep.drafter)


def test_a_drafter_can_start_from_the_targets_own_layers(setup, tmp_path):
    """`--init target:2,3`: each drafter layer starts as that target decoder layer (a drafter layer
    has a target layer's shapes), then learns."""
    target, cfg, store, features = setup
    deep_cfg = replace(cfg, num_hidden_layers=2, layer_types=(FULL, FULL))
    log = []
    trainer = train(target, deep_cfg, store.answers, features, opts(steps=30, init="target:2,3"), tmp_path / "t.pt",
                    log=log.append)  # fmt: skip
    assert any("decoder layers [2, 3]" in line for line in log)
    fresh = Trainer(target, deep_cfg, store.answers, features, opts())
    fresh.init_from_target(target.model, [2, 3])
    theirs = target.model.get_decoder().layers[3].state_dict()
    mine = dict(fresh.drafter.named_parameters())
    for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert torch.equal(mine[f"layers.1.{name}"], theirs[name].float())
    assert torch.equal(mine["layers.0.self_attn.q_norm.weight"], torch.ones(cfg.head_dim))  # llama has none
    assert trainer.history[-1] < trainer.history[0]
    with pytest.raises(ValueError, match="3 target layers named for a drafter of 2"):
        fresh.init_from_target(target.model, [0, 1, 2])


def trained(setup, o: TrainOptions, steps: int, state: Path | None = None) -> Trainer:
    """A trainer `steps` steps into the run `o` asks for, its state saved at `state` where given."""
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, o)
    for _ in range(steps):
        trainer.train_step()
    if state is not None:
        trainer.save(state, None)
    return trainer


def test_resume_replays_the_same_run(setup, tmp_path):
    target, cfg, store, features = setup
    o = opts(steps=12, warmup=4)
    straight = trained(setup, o, 12)
    trained(setup, o, 6, tmp_path / "state.pt")
    resumed = train(
        target, cfg, store.answers, features, replace(o, resume=True), tmp_path / "state.pt", log=lambda m: None
    )
    assert resumed.step == 12
    assert resumed.history == pytest.approx(straight.history, rel=1e-6, abs=1e-7)


def test_a_resumed_run_goes_on_with_its_time_budget_and_schedule(setup, tmp_path, monkeypatch):
    """--minutes is the run's whole budget: a resumed run trains what is left of it, on the cosine
    where it stopped. (Its clock restarted: a run resumed after half its budget went back to its
    peak lr and trained the whole budget again.) A clock that moves 5 s a step stands in for time."""
    import training.trainer as trainer_module

    target, cfg, store, features = setup
    clock = [1000.0]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: clock[0])
    step = Trainer.train_step

    def timed_step(self, *args, **kwargs):
        clock[0] += 5.0
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    state, quiet = tmp_path / "state.pt", (lambda m: None)
    budget = opts(steps=10**6, warmup=2, minutes=1.0)  # 60 s: 12 steps of 5 s
    first = train(target, cfg, store.answers, features, replace(budget, steps=6), state, log=quiet)
    assert first.step == 6 and first.seconds == pytest.approx(30.0)
    resumed = train(target, cfg, store.answers, features, replace(budget, resume=True), state, log=quiet)
    straight = train(target, cfg, store.answers, features, budget, tmp_path / "straight.pt", log=quiet)
    assert resumed.step == straight.step == 12 and resumed.seconds == pytest.approx(60.0)
    assert resumed.positions == straight.positions > first.positions > 0


@pytest.mark.parametrize("layer_types", [(FULL,), (FULL, SLIDING)])
def test_train_forward_equals_inference_forward(setup, layer_types):
    target, cfg0, store, features = setup
    cfg = config_for_target(
        target.config,
        num_layers=len(layer_types),
        block_size=4,
        mask_token_id=0,
        layer_types=list(layer_types),
        sliding_window=5 if SLIDING in layer_types else None,
    )
    drafter = random_drafter(cfg, seed=1, std=0.2)
    scale = torch.rand(cfg.feature_width) + 0.5
    trainer = Trainer(target, cfg0, store.answers, features, opts())
    records = trainer.train_records[:3]
    batch = make_batch(records, trainer.features, cfg, 5, 320, torch.Generator().manual_seed(0))
    noise = torch.randn(*batch.block_tokens.shape, cfg.hidden_size)
    with torch.no_grad():
        rows = drafter.forward_anchors(batch.features.float(), batch.anchors, noise, scale)
    plain = export_drafter(drafter, scale)
    checked = 0
    for i in range(len(records)):
        for j, a in enumerate(batch.anchors[i].tolist()):
            if (batch.labels[i, j] < 0).all():
                continue  # padding anchor
            feats = batch.features[i, :a].float()
            want = plain(feats, torch.arange(a), noise[i, j], a)
            torch.testing.assert_close(rows[i, j], want, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 6


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    records = [Sample([9, 9, 5, 5, 5, 7], 2, 0), Sample([9, 1, 5, 7, 7, 7, 7], 1, 5)]
    # Prompt tokens (9) do not count: answers hold 5 x4, 7 x5, 1 x1.
    assert draft_vocabulary(records, 2) == [7, 5]
    assert draft_vocabulary(records, 10) == [7, 5, 1]


def test_loss_is_over_the_draft_vocabulary_the_drafter_proposes_from(setup, tmp_path):
    from draft_node.checkpoint import load_draft_vocab

    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(draft_vocab=16))
    assert trainer.vocab.tolist() == draft_vocabulary(trainer.train_records, 16)
    batch = trainer.batch(0)
    logits, slots, labelled = trainer.logits(batch)
    assert logits.shape == (int(labelled.sum()), 16)
    labels = batch.labels[labelled]
    inside = torch.isin(labels, trainer.vocab)
    assert (~inside).any() and inside.any()  # the tiny answers use more than 16 tokens
    assert (slots[~inside] == -100).all()
    assert (trainer.vocab[slots[inside]] == labels[inside]).all()
    # Logits are the LM-head rows of exactly those tokens.
    noise = torch.nn.functional.embedding(batch.block_tokens, trainer.embed)
    hidden = trainer.drafter.forward_anchors(batch.features.float(), batch.anchors, noise, trainer.scale)
    hidden = hidden[labelled].to(trainer.head.dtype)
    full_head = target.model.get_output_embeddings().weight.to(trainer.head.dtype)
    torch.testing.assert_close(logits, (hidden @ full_head.T).float()[:, trainer.vocab])
    assert torch.isfinite(trainer.loss(batch))
    trainer.save(tmp_path / "state.pt", tmp_path / "out")
    assert load_draft_vocab(tmp_path / "out") == trainer.vocab.tolist()


def test_held_out_answers_are_chosen_by_job_and_never_trained_on(setup):
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(val_answers=1000))
    held = [a for a in store.answers if a.held_out]
    assert len(trainer.val_records) == len(held) > 0
    train_offsets = {r.offset for r in trainer.train_records}
    assert not train_offsets & {r.offset for r in trainer.val_records}
    # Every turn of a job lands on the same side.
    a = Answer("k1", "job-7", "answer", [["user", "x"]], [1, 2, 3], 1)
    b = Answer("k2", "job-7", "followup", [["user", "x"], ["assistant", "y"], ["user", "z"]], [1, 2, 3], 1)
    assert a.held_out == b.held_out


def test_launch_train_runs_each_stage_on_a_saved_target(setup, tmp_path):
    """The command users run: features by prefill for answers from elsewhere, a short training run, vocab."""
    from launch.train import main

    target, cfg, store, features = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    out = tmp_path / "drafter"
    common = [
        "--model",
        str(model_dir),
        "--store",
        str(store.folder),
        "--name",
        "tiny-test",
        "--block-size",
        "4",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    main(
        [
            *common,
            "--stage",
            "train",
            "--steps",
            "30",
            "--batch",
            "4",
            "--anchors",
            "4",
            "--eval-every",
            "0",
            "--draft-vocab",
            "64",
            "--cache",
            str(tmp_path / "cache"),
        ]
    )
    drafter = load_drafter(out)
    assert drafter.config.block_size == 4 and len(drafter.draft_vocab) == 64
    save_drafter(drafter, tmp_path / "copy")  # the written checkpoint is the public format
    assert Path(tmp_path / "copy" / "model.safetensors").is_file()
    assert load_drafter(tmp_path / "copy").draft_vocab == drafter.draft_vocab  # and keeps the vocabulary
    # Distillation fills a cache of its own, with the target's last layer after the drafter's taps.
    main(
        [
            *common,
            "--stage",
            "train",
            "--steps",
            "3",
            "--distill",
            "0.5",
            "--cache",
            str(tmp_path / "cache"),
            "--restart",
        ]
    )
    taps = (*drafter.config.target_layer_ids, target.config.num_hidden_layers - 1)
    folder = feature_folder(tmp_path / "cache", model_dir, taps, named_dtype("auto", "cpu"))
    wide = FeatureCache(folder, len(taps) * target.config.hidden_size)
    assert len(wide) == len(AnswerStore(store.folder)) and wide.array().shape[0] == wide.rows  # every answer
    # Live features train on every answer and store none: the same run with a cache folder of its own.
    live_cache, live_out = tmp_path / "live-cache", tmp_path / "live-drafter"
    live = [*common[:-4], "--out", str(live_out), "--threads", "1", "--stage", "train", "--steps", "3"]
    main([*live, "--distill", "0.5", "--features", "live", "--cache", str(live_cache)])
    assert load_drafter(live_out).config.block_size == 4
    assert "features: live" in (live_cache / "train" / "tiny-test" / "train.log").read_text()
    assert not FeatureCache(feature_folder(live_cache, model_dir, taps, named_dtype("auto", "cpu")), wide.width).rows


def test_recorded_traffic_becomes_training_data(setup, tmp_path):
    """A real target daemon run with --record; launch.train trains on what it recorded."""
    from frontend.target_client import TargetClient
    from launch.local import daemon
    from launch.train import main

    target, cfg, store, features = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    recorded = tmp_path / "traffic"
    address = f"ipc://{tmp_path}/target.sock"
    args = ["--model", str(model_dir), "--proposer", "none", "--record", str(recorded), "--threads", "1"]
    prompts = [[5 + i, 17, 42, 99, 3, 7 + i] for i in range(12)]
    with daemon("target daemon", "launch.target_daemon", address, args, 120):
        client = TargetClient(address, timeout_s=60)
        answers = [client.generate(token_ids=p, max_new_tokens=24, stream=False)["token_ids"] for p in prompts]
        client.close()
    traffic = AnswerStore(recorded)
    assert len(traffic) == 12 and all(a.stage == "traffic" for a in traffic.answers)
    assert [a.tokens for a in traffic.answers] == [p + a for p, a in zip(prompts, answers, strict=True)]
    out = tmp_path / "drafter"
    empty = tmp_path / "no-store"
    empty.mkdir()  # an empty store: a missing one is refused as a typo
    main(
        [
            "--model",
            str(model_dir),
            "--store",
            str(empty),
            "--data",
            str(recorded),
            "--stage",
            "train",
            "--block-size",
            "4",
            "--steps",
            "5",
            "--batch",
            "2",
            "--anchors",
            "2",
            "--eval-every",
            "0",
            "--draft-vocab",
            "0",
            "--out",
            str(out),
            "--cache",
            str(tmp_path / "cache"),
            "--threads",
            "1",
        ]
    )
    assert load_drafter(out).config.block_size == 4
    log = (tmp_path / "cache" / "train" / "smollm2" / "train.log").read_text()
    assert "features: 12 answers filled by prefill" in log
    trained, held = re.search(r"train: (\d+) answers .*, (\d+) held out", log).groups()
    assert int(trained) + int(held) == 12 and int(trained) >= 9


WRITER = """
import sys, time, torch
import training.features as features_module
from training.features import FeatureCache
cache = FeatureCache(sys.argv[1], width=6)
tag = int(sys.argv[2])
time.sleep(max(0.0, float(sys.argv[3]) - time.time()))  # both start writing at once
for i in range(200):
    cache.add(f"{tag}-{i}", torch.full((1 + i % 7, 6), i + tag / 4))  # exact in fp16
"""


def test_two_processes_filling_one_feature_cache_keep_every_row_under_its_key(tmp_path):
    """Two generators on two cores share one cache: each answer's rows must be its own."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    go = str(time.time() + 8)  # after both have imported torch
    command = [sys.executable, "-c", WRITER, str(tmp_path)]
    writers = [subprocess.Popen([*command, str(tag), go], env=env) for tag in (1, 2)]
    assert [w.wait(120) for w in writers] == [0, 0]
    cache = FeatureCache(tmp_path, width=6, readonly=True)
    assert len(cache) == 400
    for tag in (1, 2):
        for i in range(200):
            rows = cache.get(f"{tag}-{i}")
            assert rows.shape == (1 + i % 7, 6) and bool((rows == i + tag / 4).all()), (tag, i)


def test_two_fillers_of_one_cache_compute_an_answer_once_and_keep_no_dead_rows(tmp_path):
    """Two training runs filling one cache each computed every answer, and the second copy of each
    stayed in the rows file, referenced by nothing, for good (an audit: 326,974 rows, 163,487 used)."""
    width, computed = 6, []

    class Target:  # what fill asks of a target: its prefill slots and the tapped rows
        prefill_slots = 4

        def prefill_features(self, tokens, layer_ids):
            computed.extend(len(t) for t in tokens)
            return [torch.full((len(t), width), float(len(t))) for t in tokens]

    answers = [Answer(f"k{i}", "j", "text", [["user", "hi"]], list(range(3 + i)), 1) for i in range(6)]
    first, second = FeatureCache(tmp_path, width), FeatureCache(tmp_path, width)  # both open before either fills
    assert first.fill(answers[:4], Target(), (0,), log=None) == 4
    assert second.fill(answers, Target(), (0,), log=None) == 2  # the first's four are its already
    second.add("k0", torch.zeros(2 + 0, width))  # an add of a key another filled is one no-op too
    assert sorted(computed) == [2, 3, 4, 5, 6, 7]
    again = FeatureCache(tmp_path, width, readonly=True)
    assert len(again) == 6 and (tmp_path / "features.f16").stat().st_size == sum(computed) * width * 2
    assert torch.equal(again.get("k5"), torch.full((7, width), 7.0))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_generation_answers_each_prompt_as_greedy_decoding_alone(one_thread, arch):
    """Slots refilled mid-flight, prompts of every length joining running rows and the drained
    tail leave every answer equal to the target's greedy answer to that prompt alone, bit for
    bit, with the same features."""
    target = tiny_target(arch, layers=2, slots=4)
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 5, 2, 4] + torch.randint(2, 90, (20,), generator=gen).tolist()  # longer prompts join later
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]
    alone = [greedy(target, p, 70, stop_on_eos=False) for p in prompts]
    eos = {alone[0][9], alone[1][30], alone[2][50]}  # answers end at different steps
    want = [a[: next((k + 1 for k, t in enumerate(a) if t in eos), len(a))] for a in alone]
    assert len({len(w) for w in want}) > 3
    queue = iter(enumerate(prompts))
    got, rows = {}, {}

    def done(i, tokens, prompt_len, finish, features):
        got[i], rows[i] = tokens[prompt_len:], features

    target.eos_ids = frozenset(eos)
    RefillGenerator(target, batch=4, max_new=70, layer_ids=(0, 1)).run(lambda: next(queue, None), done)
    assert [got[i] for i in range(len(prompts))] == want
    for i in (0, 7, 13):
        target.reset()
        _, served = target.forward(prompts[i] + want[i][:-1], (0, 1))
        assert torch.equal(rows[i], served)


def test_averaging_two_drafters_mixes_their_weights_and_their_vocabularies(setup, tmp_path):
    from launch.train import main

    target, cfg, store, features = setup
    first, second = random_drafter(cfg, seed=1), random_drafter(cfg, seed=2)
    first.draft_vocab, second.draft_vocab = [5, 6, 7], [7, 8]
    for name, drafter in (("a", first), ("b", second)):
        save_drafter(drafter, tmp_path / name)
        save_draft_vocab(tmp_path / name, drafter.draft_vocab)
    main(
        ["--stage", "average", "--init", str(tmp_path / "a"), "--average-with", str(tmp_path / "b")]
        + ["--weight", "0.25", "--save-dtype", "float32", "--out", str(tmp_path / "c"), "--cache", str(tmp_path)]
    )
    mixed = load_drafter(tmp_path / "c")
    want = {k: 0.75 * v + 0.25 * second.state_dict()[k] for k, v in first.state_dict().items()}
    for k, v in mixed.state_dict().items():
        torch.testing.assert_close(v, want[k])
    assert mixed.draft_vocab == [7, 8, 5, 6]  # the second's order first, then what only the first had
    second.draft_vocab = []  # a drafter proposing from every token makes the average do so too
    assert average_drafters(first, second, 0.5).draft_vocab == []
    deeper = random_drafter(replace(cfg, num_hidden_layers=2, layer_types=(FULL, FULL)))
    with pytest.raises(CheckpointError, match="differ in num_hidden_layers 1 vs 2, layer_types"):  # one line
        average_drafters(first, deeper, 0.5)


def test_a_grown_drafter_drafts_the_same_bits_at_the_deeper_drafters_cost(setup, tmp_path):
    """--stage grow: the added layers add exactly nothing, so a daemon timing a deeper drafter
    drafts what the shallow one does (docs/deployment.md's depth study)."""
    from draft_node.kv_cache import DraftKVCache
    from launch.train import main

    target, cfg, store, features = setup
    shallow = random_drafter(cfg, seed=5, std=0.1)
    shallow.draft_vocab = [3, 4, 9]
    save_drafter(shallow, tmp_path / "a")
    save_draft_vocab(tmp_path / "a", shallow.draft_vocab)
    grow = ["--stage", "grow", "--init", str(tmp_path / "a"), "--save-dtype", "float32", "--cache", str(tmp_path)]
    main([*grow, "--layers", "3", "--out", str(tmp_path / "g")])
    deep = load_drafter(tmp_path / "g")
    assert deep.config.num_hidden_layers == 3 and deep.draft_vocab == [3, 4, 9]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, cfg.feature_width, generator=g)
    noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g)
    drafted = []
    for drafter in (load_drafter(tmp_path / "a"), deep):
        cache = DraftKVCache(drafter, capacity=32)
        cache.append(0, rows)
        drafted.append(cache.draft_rows(noise, 12, cfg.block_size - 1)[0])
    assert torch.equal(drafted[0], drafted[1])
    with pytest.raises(SystemExit, match="cannot grow a 3-layer drafter to 2 layers"):
        main([*grow[:3], str(tmp_path / "g"), *grow[4:], "--layers", "2", "--out", str(tmp_path / "h")])


def test_a_job_mix_draws_each_kind_at_its_share(setup, monkeypatch):
    kinds = ["ask"] * 90 + ["code"] * 10 + ["starter"] * 20
    weights = mix_weights(kinds, {"ask": 0.5, "code": 0.5, "math": 0.2})  # no math answers: its share goes
    share = {k: float(sum(w for w, kind in zip(weights, kinds, strict=True) if kind == k)) for k in set(kinds)}
    assert share["starter"] == pytest.approx(20 / 120)  # not in the mix: its share of the records
    assert share["ask"] == pytest.approx(share["code"]) == pytest.approx((1 - 20 / 120) / 2)
    # The trainer's stream draws by them: 1 answer in 8 is code, and code is half of what it draws.
    target, cfg, store, features = setup
    answers = [replace(a, job=f"0-{i}-{'code' if i % 8 == 0 else 'ask'}") for i, a in enumerate(store.answers)]
    drawn = []
    monkeypatch.setattr("training.trainer.make_batch", lambda chosen, *a, **k: drawn.extend(chosen))
    for mix, code_share in (
        ("answers", 1 / 8),
        ("jobs", JOB_WEIGHTS["code"] / (JOB_WEIGHTS["code"] + JOB_WEIGHTS["ask"])),
    ):
        trainer, drawn[:] = Trainer(target, cfg, answers, features, opts(mix=mix)), []
        for step in range(300):
            trainer.batch(step)
        coded = {r.key for r in trainer.train_records if r.key in {a.key for a in answers if a.job.endswith("code")}}
        assert sum(r.key in coded for r in drawn) / len(drawn) == pytest.approx(code_share, abs=0.04), mix


def test_an_estimate_by_kind_adds_each_kinds_blocks_and_tables_them():
    answers = [
        Answer("a", "3-17-ask", "answer", [], [], 0),
        Answer("b", "3-17-ask", "questions", [], [], 0),
        Answer("c", "starter-0a1b2c3d", "answer", [], [], 0),
        Answer("d", "4-2-ask", "answer", [], [], 0),
    ]
    assert [answer_kind(a) for a in answers] == ["ask", "ask/questions", "starter", "ask"]
    records = [Sample([1, 2, 3], 1, 0, key) for key in ("a", "b", "d")]  # "c" had no features
    by = by_kind(answers, records, [[3, 4], [14, 2], [1, 6]])
    assert by == {
        "ask": {"answers": 2, "blocks": 10, "tau": 1.4},
        "ask/questions": {"answers": 1, "blocks": 2, "tau": 8.0},
    }
    rows = kind_table({"old": by, "new": {"ask": {"answers": 2, "blocks": 10, "tau": 1.55}}})
    assert rows[2:] == ["| ask | 2 | 10 | 1.400 | 1.550 |", "| ask/questions | 1 | 2 | 8.000 | - |"]


def test_the_offline_estimate_scores_every_drafter_on_the_same_blocks(setup, tmp_path):
    target, cfg, store, features = setup
    train(target, cfg, store.answers, features, opts(out=tmp_path / "out"), tmp_path / "s.pt", log=lambda m: None)
    trained, untrained = load_drafter(tmp_path / "out"), random_drafter(cfg, seed=3)
    first = estimate(target, trained, store.answers, features, anchors=8)
    assert estimate(target, trained, store.answers, features, anchors=8) == first
    other = estimate(target, untrained, store.answers, features, anchors=8)
    assert sum(first["histogram"]) == sum(other["histogram"]) > 100  # the same blocks, every answer's
    assert first["tau"] > other["tau"] + 0.3
    # Split by answer kind, the same blocks and the same drafts accepted, kind by kind.
    kinds = first["by_kind"].values()
    assert sum(k["blocks"] for k in kinds) == sum(first["histogram"])
    accepted = sum(i * n for i, n in enumerate(first["histogram"]))
    assert sum(round((k["tau"] - 1) * k["blocks"]) for k in kinds) == accepted > 0
    # Through the drafter's own vocabulary: proposing only a token no answer has accepts nothing.
    said = {t for a in store.answers for t in a.tokens}
    trained.draft_vocab = [next(t for t in range(target.model.config.vocab_size) if t not in said)]
    assert estimate(target, trained, store.answers, features, anchors=8)["tau"] == 1.0


def test_a_selector_trained_on_a_backbone_chains_its_drafts_better(setup, tmp_path, monkeypatch):
    """DFlash2 from a trained DFlash drafter: identity convolutions draft exactly as the backbone,
    and the selector, trained on the backbone's rows alone, raises the walk's chain tau over the
    first choices' on the blocks it learned from; the export loads and stays lossless."""
    from target_node.drafting.selector import Selector, SelectorSpec
    from training.drafter_starts import as_dflash2
    from training.selector import chain_tau, fit, positions

    target, cfg, store, features = setup
    train(target, cfg, store.answers, features, opts(steps=150, out=tmp_path / "dflash"), tmp_path / "s.pt", log=print)
    backbone = load_drafter(tmp_path / "dflash").float()
    drafter = as_dflash2(backbone, target.vocab_size, rank=16, top_k=8)
    features_in = torch.randn(9, cfg.feature_width)
    noise = torch.randn(cfg.block_size, cfg.hidden_size)
    same = drafter(features_in, torch.arange(9), noise, 9)
    fast = backbone(features_in, torch.arange(9), noise, 9)  # on the CPU kernels, where DFlash2 has torch's path
    with monkeypatch.context() as torch_only:
        torch_only.setattr(kernel_path, "serves", lambda drafter: False)
        assert torch.equal(same, backbone(features_in, torch.arange(9), noise, 9))  # the same operations: the same bits
    torch.testing.assert_close(same, fast, rtol=1e-4, atol=1e-4)

    trainer = Trainer(target, drafter.config, store.answers, features, opts(draft_vocab=0))
    trainer.init_from(drafter)
    picker = Selector(SelectorSpec(16, 8, target.vocab_size), *trainer.drafter.codebooks())
    data = positions(trainer, picker, (trainer.batch(i) for i in range(8)))
    before = chain_tau(trainer, trainer.drafter, trainer.train_records)
    losses = fit(trainer.drafter, data, steps=300, lr=1e-2)
    after = chain_tau(trainer, trainer.drafter, trainer.train_records)
    print(before, after, losses[0], losses[-1])
    assert sum(losses[-20:]) / 20 < 0.8 * losses[0]
    assert before["selector"] == pytest.approx(before["chain"], abs=0.02)  # small random codebooks: ~ first choices
    assert after["selector"] > after["chain"] and after["chain"] == before["chain"]

    out = save_drafter(export_drafter(trainer.drafter, trainer.scale), tmp_path / "dflash2")
    loaded = load_drafter(out)
    assert loaded.config.dflash2
    scored = estimate(target, loaded, store.answers, features, anchors=8)  # offline, the walk beside the chain
    assert scored["selector_tau"] > scored["tau"] > 1.0
    for a in store.answers[:3]:
        prompt = a.tokens[: a.prompt_len]
        result = generate(target, prompt, DFlashProposer(LocalDraftBackend(loaded)), DecodeOptions(30, adaptive=False))
        assert result.tokens == greedy(target, prompt, 30)


def test_launch_train_makes_a_dflash2_drafter_from_a_dflash_one(setup, tmp_path):
    """`--format dflash2 --init DFLASH`: the backbone starts out drafting exactly as the DFlash
    drafter (identity convolutions), its convolutions then learn with it, and its selector learns
    on its outputs; the checkpoint loads as DFlash2 and decodes losslessly."""
    from launch.train import main

    target, cfg, store, features = setup
    dflash = tmp_path / "dflash"
    train(target, cfg, store.answers, features, opts(steps=60, out=dflash), tmp_path / "a.pt", log=lambda m: None)
    v2_cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0, dflash2=True)
    before, after = (Trainer(target, c, store.answers, features, opts()) for c in (cfg, v2_cfg))
    before.init_from(load_drafter(dflash))
    after.init_from(load_drafter(dflash))
    with torch.no_grad():
        batch = before.batch(0)
        assert torch.equal(after.logits(batch)[0], before.logits(batch)[0])

    model_dir, out = tmp_path / "model", tmp_path / "dflash2"
    target.model.save_pretrained(model_dir)
    main(
        ["--model", str(model_dir), "--store", str(store.folder), "--cache", str(tmp_path / "cache"), "--name", "v2",
         "--block-size", "4", "--threads", "1", "--stage", "train", "--format", "dflash2", "--init", str(dflash),
         "--out", str(out), "--steps", "40", "--lr", "5e-3", "--warmup", "5", "--batch", "4", "--anchors", "8",
         "--eval-every", "0", "--draft-vocab", "0", "--selector-rank", "16", "--selector-batches", "4",
         "--selector-steps", "80", "--selector-lr", "1e-2"]
    )  # fmt: skip
    drafter = load_drafter(out)
    assert drafter.config.dflash2 and drafter.config.selector_rank == 16
    conv = dict(drafter.named_parameters())
    assert conv["layers.0.attention_conv.base_kernel"][:, 1].abs().sum() > 0  # the second tap learned
    assert conv["layers.0.mlp_conv.kernel_projection.weight"].abs().sum() > 0  # and the dynamic part
    log = (tmp_path / "cache" / "train" / "v2" / "train.log").read_text()
    first, last = re.search(r"selector: loss ([\d.]+) -> ([\d.]+)", log).groups()
    assert float(last) < float(first)
    for a in store.answers[:3]:
        prompt = a.tokens[: a.prompt_len]
        result = generate(target, prompt, DFlashProposer(LocalDraftBackend(drafter)), DecodeOptions(30, adaptive=False))
        assert result.tokens == greedy(target, prompt, 30)


def test_torchrun_on_two_ranks_trains_as_one_process_and_resumes_on_one(setup, tmp_path):
    """`torchrun --nproc_per_node 2 -m launch.train` (gloo, real processes): each rank takes half of
    every batch, so the run follows one process's loss curve and weights up to the order of float
    sums (losses within 1e-4, weights within 1e-4 of their norm; 1e-6 measured); its checkpoint is
    the public format, and its state resumes in a one-process run as the one-process run's own
    state does."""
    target, _, store, _ = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    root = Path(__file__).resolve().parent.parent

    def start(name: str, ranks: int, steps: int, *extra: str) -> subprocess.Popen:
        args = ["--model", model_dir, "--store", store.folder, "--name", name, "--cache", tmp_path / "cache"]
        args += ["--stage", "train", "--block-size", "4", "--steps", steps, "--batch", 5, "--anchors", 4]
        args += ["--lr", "5e-3", "--warmup", 2, "--eval-every", 0, "--save-every", 0, "--draft-vocab", 64]
        args += ["--threads", 1, "--out", tmp_path / name, "--autocast", "off", *extra]  # fp32 on any CPU
        args += ["--format", "dflash2", "--selector-batches", 2, "--selector-steps", 3]  # the selector: on rank 0
        launcher = [sys.executable]
        if ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        # torchrun's own folders (torchelastic_*) go here, not into /tmp for good, one a run (an audit).
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
        command = [*launcher, "-m", "launch.train", *map(str, args)]
        return subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finished(name: str, proc: subprocess.Popen) -> dict:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-3000:]
        return torch.load(tmp_path / "cache" / "train" / name / "state.pt", weights_only=False)

    def run(name: str, ranks: int, steps: int, *extra: str) -> dict:
        return finished(name, start(name, ranks, steps, *extra))

    def log(name: str) -> str:
        return (tmp_path / "cache" / "train" / name / "train.log").read_text()

    two = run("two", 2, 12)  # first: its two ranks fill the feature cache, half each
    one = run("one", 1, 12)
    assert len(two["history"]) == len(one["history"]) == 12
    assert two["history"] == pytest.approx(one["history"], rel=1e-4)
    assert two["positions"] == one["positions"]  # rank 0's share times two counted 3 sequences as 2.5 (an audit)
    # The selector learns on rank 0 from whole batches (it took rank 0's shares: 110 positions of 253, an audit).
    selector = [re.search(r"selector: \d+ draft positions", log(name)).group() for name in ("two", "one")]
    assert selector[0] == selector[1], selector
    assert one["history"][-1] < one["history"][0]
    for name, weight in one["drafter"].items():  # Adam magnifies float noise in near-zero gradients
        drift = (two["drafter"][name] - weight).norm() / weight.norm().clamp_min(1e-6)
        assert drift < 1e-4, (name, float(drift))
    assert load_drafter(tmp_path / "two").config == load_drafter(tmp_path / "one").config

    # Side by side (one thread each, on the cache both runs filled): each resumes its own state.
    resuming = {name: start(name, 1, 20, "--resume") for name in ("two", "one")}
    try:
        resumed_two, resumed_one = (finished(name, proc) for name, proc in resuming.items())
    finally:
        for proc in resuming.values():
            proc.kill()
            proc.wait()
    assert resumed_two["step"] == resumed_one["step"] == 20
    assert resumed_two["history"][12:] == pytest.approx(resumed_one["history"][12:], rel=1e-4)


def test_each_rank_builds_its_share_of_the_batch_one_process_draws(setup):
    """The ranks' batches, put together, are the one-process batch: same sequences, same anchors,
    same context rows (each rank takes rows up to its own last anchor)."""
    from training.distributed import Ranks

    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(batch=5))
    whole = trainer.batch(7)
    parts = []
    for rank in (0, 1):
        trainer.ranks = Ranks(rank, 2)  # what a rank's trainer reads to build its batch
        parts.append(trainer.batch(7))
    assert [p.anchors.shape[0] for p in parts] == [3, 2]
    for name in ("anchors", "block_tokens", "labels"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name)), name
    rows = [row for p in parts for row in p.features]
    for i, row in enumerate(rows):
        span = min(row.shape[0], whole.features.shape[1])
        assert torch.equal(row[:span], whole.features[i, :span])


def test_blocks_given_known_tokens_hold_the_targets_tokens_there_and_learn_only_the_rest(setup):
    """Pre-drafting's block form (issue 31): some slots after the anchor hold the target's own
    next tokens instead of masks, carry no loss, and leave at least one slot to learn."""
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts())
    records = trainer.train_records[:6]
    plain = make_batch(records, trainer.features, cfg, 5, 320, torch.Generator().manual_seed(0))
    given = make_batch(records, trainer.features, cfg, 5, 320, torch.Generator().manual_seed(0), known=1.0)
    assert (plain.block_tokens[..., 1:] == cfg.mask_token_id).all()
    seen = 0
    for i, r in enumerate(records):
        for j, a in enumerate(given.anchors[i].tolist()):
            toks, labels = given.block_tokens[i, j], given.labels[i, j]
            if (plain.labels[i, j] < 0).all() or (plain.labels[i, j, 1:] >= 0).sum() < 2:
                continue  # a padding anchor, or too near the end for a given slot
            k = next(m for m in range(1, cfg.block_size) if labels[m] >= 0) - 1  # given slots: no loss
            assert 1 <= k <= cfg.block_size - 2 and toks[1 : k + 1].tolist() == r.tokens[a + 1 : a + k + 1]
            assert (labels[1 : k + 1] == -100).all() and (labels[k + 1 :] >= 0).any()
            assert labels[k + 1 :].tolist() == plain.labels[i, j, k + 1 :].tolist()
            seen += 1
    assert seen >= 10


def test_batches_built_ahead_by_threads_train_the_same_bits_as_built_in_step(setup, tmp_path):
    """A batch depends only on (seed, step), so loader threads change when it is built, not what it is."""
    target, cfg, store, features = setup
    runs = {}
    for threads in (0, 3):
        o = opts(steps=10, warmup=3, loader_threads=threads)
        runs[threads] = train(target, cfg, store.answers, features, o, tmp_path / f"s{threads}.pt", log=lambda m: None)
    assert runs[3].history == runs[0].history
    for a, b in zip(runs[0].drafter.parameters(), runs[3].drafter.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_batch_stream_gives_each_step_its_own_batch_in_order_through_a_flood_of_steps():
    from training.loader import BatchStream

    built = []

    def build(step: int) -> tuple[int, int]:
        built.append(step)
        time.sleep(0.0005 * (step % 3))  # threads finish out of order
        return step, step * step

    with BatchStream(build, 5, workers=4) as stream:
        assert [stream.take(s) for s in range(5, 2005)] == [(s, s * s) for s in range(5, 2005)]
        assert len(stream.pending) == stream.ahead  # a bounded queue: `ahead` batches, no more
        assert stream.take(4000) == (4000, 16_000_000)  # a jump (a resume elsewhere) restarts there
    assert max(built) < 4000 + 1 + stream.ahead and built.count(4000) == 1
    with BatchStream(build, 0, workers=0) as inline:  # no threads: built when taken
        built.clear()
        assert inline.take(7) == (7, 49) and built == [7]


def test_a_run_with_a_time_budget_ends_its_schedule_with_the_budget(setup):
    """--minutes with more --steps than fit: the cosine follows the clock, so the run still ends at
    the low learning rate, not at the peak where its steps would have left it."""
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(steps=100_000, warmup=2, minutes=1.0))
    for _ in range(3):
        trainer.train_step()
    assert trainer.schedule.get_last_lr()[0] == pytest.approx(5e-3, rel=1e-3)  # step 3 of 100,000: the peak
    trainer.time_spent = 0.5
    assert trainer._lr_factor(trainer.step) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    trainer.time_spent = 1.0
    assert trainer._lr_factor(trainer.step) == pytest.approx(0.1)


@pytest.fixture(scope="module")
def wide_features(setup, tmp_path_factory):
    """The setup's answers with the target's last layer cached after the drafter's taps."""
    target, cfg, store, _ = setup
    taps = (*cfg.target_layer_ids, target.config.num_hidden_layers - 1)
    cache = FeatureCache(tmp_path_factory.mktemp("wide"), len(taps) * target.config.hidden_size)
    cache.fill(store.answers, target, taps, log=None)
    return cache


def test_acceptance_weights_are_the_mean_gradient_of_the_expected_accepted_length():
    """D-PACE's weight of slot i is d E / d log p_i, E = sum_k prod_{j<=k} p_j, averaged over the
    batch's blocks and given to slot i of every block: checked against autograd, unlabelled slots
    and labels outside the draft vocabulary counted as sure misses."""
    gen = torch.Generator().manual_seed(0)
    labelled = torch.rand(3, 5, 8, generator=gen) > 0.15
    labelled[..., 0] = True
    slots = torch.randint(0, 50, (int(labelled.sum()),), generator=gen)
    slots[torch.rand(len(slots), generator=gen) < 0.1] = -100
    ce = torch.rand(len(slots), generator=gen) * 3
    log_p = torch.full(labelled.shape, -1e9, dtype=torch.float64)  # unlabelled or outside: p = 0
    log_p[labelled] = torch.where(slots >= 0, -ce, -1e9).double()
    log_p[..., 0] = 0.0  # the anchor is given
    log_p.requires_grad_(True)
    expected = log_p.exp().cumprod(-1)[..., 1:].sum()
    (grad,) = torch.autograd.grad(expected, log_p)
    per_slot = grad.reshape(-1, 8).mean(0) * (torch.arange(8) >= 1)
    want = per_slot.expand(3, 5, 8)[labelled] * (slots >= 0)
    got = acceptance_weights(ce, slots, labelled)
    assert torch.allclose(got.double(), want, atol=1e-6)
    assert (got[slots < 0] == 0).all() and got.max() <= 7
    # A block the drafter gets wrong at its first slot still weighs its first slot as the others do.
    first = torch.zeros_like(labelled)
    first[..., 1] = True
    firsts = acceptance_weights(ce, slots, labelled)[first[labelled]]
    assert torch.allclose(firsts[slots[first[labelled]] >= 0], firsts.max())


def test_a_run_with_acceptance_weights_learns(setup):
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(slot_weights="acceptance", lr=3e-3, steps=30))
    before = trainer.loss(trainer.batch(0))
    for _ in range(30):
        trainer.train_step()
    assert trainer.loss(trainer.batch(0)) < before
    with pytest.raises(ValueError, match="slot_weights"):
        Trainer(target, cfg, store.answers, features, opts(slot_weights="flat"))


def test_distillation_targets_the_targets_own_distribution_at_each_slot(setup, wide_features):
    """The teacher of slot k is the target's distribution after position a+k-1: its own logits
    there, whose argmax is the label the target chose (greedy answers)."""
    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, wide_features, opts(distill=1.0, draft_vocab=0))
    records = trainer.train_records[:6]
    batch = make_batch(records, trainer.features, cfg, 5, 320, torch.Generator().manual_seed(0))
    logits, slots, labelled = trainer.logits(batch)
    teacher = trainer.teacher_logprobs(batch, labelled)
    assert teacher.shape == logits.shape
    agree = (teacher.argmax(-1) == slots).float().mean()
    assert agree > 0.95, agree  # a row off by one would agree by chance only
    expected = torch.zeros(batch.labels.shape + (teacher.shape[1],))
    with torch.no_grad():
        for i, r in enumerate(records):
            out = target.model(torch.tensor([r.tokens]), output_hidden_states=True)
            pos = (batch.anchors[i, :, None] + torch.arange(cfg.block_size) - 1).clamp(0, len(r.tokens) - 2)
            expected[i] = out.logits[0].float().log_softmax(-1)[pos]
            # The row is the final norm's output (what the head reads), not the last layer's input to it.
            torch.testing.assert_close(batch.teacher[i].float(), out.hidden_states[-1][0][pos], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(teacher, expected[labelled], atol=0.02, rtol=0)  # the cache's rows are fp16
    # The context rows of a wide cache are the narrow cache's, bit for bit, and so is the scale.
    plain = Trainer(target, cfg, store.answers, features, opts())
    same = plain.train_records[:6]
    assert [r.key for r in same] == [r.key for r in records]
    narrow = make_batch(same, plain.features, cfg, 5, 320, torch.Generator().manual_seed(0))
    assert torch.equal(narrow.features, batch.features) and narrow.teacher is None
    torch.testing.assert_close(trainer.scale, plain.scale)


def test_distillation_alone_teaches_the_drafter_the_targets_tokens(setup, wide_features, tmp_path):
    """With the whole loss the KL from the target's distribution (no cross-entropy on its tokens),
    the drafter still learns to draft what the target chooses. The tiny random target's
    distributions are flat (entropy 4.5 nats of 5.8, top token 0.10), so its argmax is a faint
    signal in them and the gain is smaller than cross-entropy's."""
    target, cfg, store, _ = setup
    run = opts(distill=1.0, steps=300, out=tmp_path / "out")
    trainer = train(target, cfg, store.answers, wide_features, run, tmp_path / "state.pt", log=lambda m: None)
    first, last = sum(trainer.history[:20]) / 20, sum(trainer.history[-20:]) / 20
    assert last < first * 0.9, (first, last)
    trained = trainer.evaluate(trainer.train_records, anchors=8)
    trainer.drafter.load_state_dict(random_drafter(cfg, seed=3).state_dict())
    baseline = trainer.evaluate(trainer.train_records, anchors=8)
    assert trained["tau"] > baseline["tau"] + 0.04, (trained["tau"], baseline["tau"])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mamba2"])
def test_the_last_layers_tap_is_the_final_norms_output_the_head_reads(one_thread, arch):
    """Distillation's teacher is the last layer's tap through the head, so that tap must be the final
    norm's output in every family. Mamba 2 leaves the embeddings out of its hidden states (its taps sit
    one index lower), and its last layer's tap was the un-normed row: the teacher's logits were
    another model's (an audit)."""
    target = tiny_target(arch)
    last, tokens = target.config.num_hidden_layers - 1, list(range(3, 20))
    final, served = target.forward(tokens, (last,))
    torch.testing.assert_close(served, final)
    torch.testing.assert_close(target.prefill_features([tokens], (last,))[0], final)


def test_distillation_refuses_a_cache_without_the_targets_last_layer(setup):
    target, cfg, store, features = setup
    with pytest.raises(ValueError, match="last layer"):
        Trainer(target, cfg, store.answers, features, opts(distill=0.5))


def test_live_features_are_the_cached_rows_and_train_the_same_steps(setup, wide_features):
    """Features computed by the target on each batch (--features live) are the rows the cache holds,
    bit for bit, on the engine (one forward computes both), the teacher's rows too; so with one
    scale and one start the two sources train the same steps."""
    target, cfg, store, features = setup
    cached = Trainer(target, cfg, store.answers, features, opts())
    live = Trainer(target, cfg, store.answers, LiveFeatures(target, cfg.target_layer_ids), opts())
    assert [r.key for r in live.train_records] == [r.key for r in cached.train_records]
    batch = live.batch(0)
    assert batch.features is None and batch.context is not None
    live.block_rows(batch)
    assert torch.equal(batch.features, cached.batch(0).features)
    taps = (*cfg.target_layer_ids, target.config.num_hidden_layers - 1)
    teach = Trainer(target, cfg, store.answers, LiveFeatures(target, taps), opts(distill=0.5))
    wide = Trainer(target, cfg, store.answers, wide_features, opts(distill=0.5))
    for step in (0, 3):
        want, got = wide.batch(step), teach.batch(step)
        teach.block_rows(got)
        assert torch.equal(got.features, want.features) and torch.equal(got.teacher, want.teacher)
    live.scale = cached.scale.clone()
    for _ in range(4):
        assert live.train_step() == cached.train_step()
    for a, b in zip(live.drafter.parameters(), cached.drafter.parameters(), strict=True):
        assert torch.equal(a, b)


def test_live_features_in_forwards_of_bounded_rows_are_each_sequence_alone(setup, monkeypatch):
    """A flood of sequences, short, empty and longer than a forward's rows, each gets its own rows
    (as prefill of it alone computes them), in forwards within the row bound and the engine's slots."""
    target, cfg, store, _ = setup
    source = LiveFeatures(target, cfg.target_layer_ids, batch_tokens=64)
    calls = []
    real = target.prefill_features

    def counted(token_lists, taps):
        calls.append([len(t) for t in token_lists])
        return real(token_lists, taps)

    sequences = [a.tokens[: (i * 7) % 90] for i, a in enumerate(itertools.islice(itertools.cycle(store.answers), 60))]
    monkeypatch.setattr(target, "prefill_features", counted)
    rows = source.rows(sequences)
    monkeypatch.undo()
    assert all(len(c) <= target.prefill_slots and (len(c) == 1 or len(c) * max(c) <= 64) for c in calls)
    assert sum(len(c) for c in calls) == sum(1 for s in sequences if s)
    for tokens, got in zip(sequences, rows, strict=True):
        assert got.shape == (len(tokens), source.width) and got.dtype == torch.float16
        if tokens:
            assert torch.equal(got, target.prefill_features([tokens], cfg.target_layer_ids)[0].to(torch.float16))


def test_off_the_engine_live_features_are_padded_forwards_that_train(setup):
    """Off the engine (the GPU path today) a batch's live rows come from right-padded forwards: the
    cached rows up to rounding, the teacher's too, and a run on them learns."""
    _, cfg, store, features = setup
    target = tiny_target(layers=4, engine=False)  # the setup's weights (seeded), on the transformers path
    taps = (*cfg.target_layer_ids, target.config.num_hidden_layers - 1)
    live = Trainer(target, cfg, store.answers, LiveFeatures(target, taps, batch_tokens=256), opts(distill=0.5))
    cached = Trainer(target, cfg, store.answers, features, opts())
    batch = live.batch(0)
    live.block_rows(batch)
    want = cached.batch(0).features
    assert batch.features.shape == want.shape and batch.teacher.shape[:3] == batch.labels.shape
    torch.testing.assert_close(batch.features.float(), want.float(), rtol=5e-3, atol=5e-3)
    losses = [live.train_step() for _ in range(60)]
    assert sum(losses[-10:]) < 0.95 * sum(losses[:10]), losses


# --- a training user's mistakes and accidents (an audit) ---------------------------------------


def test_a_feature_cache_refuses_another_targets_rows_and_lost_rows(tmp_path):
    """A cache folder is named after the model folder's name: another model of that name trained
    on the first one's rows, and one of another width cut the file in half. Rows missing under the
    index were padded with zeros, and the run trained to NaN. Now: another target or width is
    refused (recorded in meta.json; a cache from before it, by its rows file's size), the last few
    entries a crash left without rows are dropped to be filled again, and more lost is refused."""
    from training.features import LOST_ENTRIES, MAX_ROWS, FeatureCacheError

    one, two = tmp_path / "a" / "model", tmp_path / "b" / "model"
    for folder, size in ((one, 10), (two, 20)):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"hidden_size": size}))
    folder = tmp_path / "cache"
    cache = FeatureCache(folder, 6, model=one)
    for i in range(2 * LOST_ENTRIES):
        cache.add(f"k{i}", torch.full((MAX_ROWS, 6), float(i)))
    with pytest.raises(FeatureCacheError, match="another target"):
        FeatureCache(folder, 6, model=two)
    with pytest.raises(FeatureCacheError, match="wide"):
        FeatureCache(folder, 8, model=one)
    (folder / "meta.json").unlink()  # a cache from before meta.json
    size = cache.rows_path.stat().st_size
    with pytest.raises(FeatureCacheError, match="not this width's cache"):
        FeatureCache(folder, 3)  # narrower: its rows would have been cut in half
    with pytest.raises(FeatureCacheError, match="not this width's cache"):
        FeatureCache(folder, 12)  # wider: every entry's rows past the end
    assert cache.rows_path.stat().st_size == size
    small = FeatureCache(tmp_path / "small", 10)
    small.add("s", torch.ones(50, 10))
    (small.folder / "meta.json").unlink()
    with pytest.raises(FeatureCacheError, match="not this width's cache"):
        FeatureCache(small.folder, 8)  # a little narrower, a small cache: its tail alone tells
    assert small.rows_path.stat().st_size == 50 * 10 * 2 and not (small.folder / "meta.json").exists()
    assert len(FeatureCache(folder, 6, model=one)) == 2 * LOST_ENTRIES  # its own width: recorded now
    with open(cache.rows_path, "r+b") as fh:
        fh.truncate(size - 12)  # the last entry's last row lost
    again = FeatureCache(folder, 6, model=one)
    assert len(again) == 2 * LOST_ENTRIES - 1 and cache.rows_path.stat().st_size == size - MAX_ROWS * 12
    assert float(again.get(f"k{2 * LOST_ENTRIES - 2}")[-1, 0]) == 2 * LOST_ENTRIES - 2
    with open(cache.rows_path, "r+b") as fh:
        fh.truncate(MAX_ROWS * 12)  # all but one entry's rows lost
    with pytest.raises(FeatureCacheError, match="rows were lost"):
        FeatureCache(folder, 6, model=one)


def test_a_feature_cache_index_survives_a_failed_rewrite(tmp_path, monkeypatch):
    cache = FeatureCache(tmp_path, 6)
    for i in range(5):
        cache.add(f"k{i}", torch.full((2, 6), float(i)))

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the rewrite syncs its file before the rename
    with pytest.raises(OSError):
        FeatureCache(tmp_path, 6)  # the rewrite fails after writing part of it
    monkeypatch.undo()
    again = FeatureCache(tmp_path, 6)
    assert len(again) == 5 and float(again.get("k4")[0, 0]) == 4.0


def test_a_loss_that_is_no_number_stops_the_run_before_it_saves(setup, tmp_path, monkeypatch):
    """--gamma 0 (or a bad cache) gave a NaN loss, and the run saved NaN weights with exit 0."""

    target, cfg, store, features = setup
    parts = Trainer._weighted_loss_parts

    def goes_wrong(self, *args, **kwargs):
        total, weight = parts(self, *args, **kwargs)
        return (total * float("nan"), weight) if self.step >= 3 else (total, weight)

    monkeypatch.setattr(Trainer, "_weighted_loss_parts", goes_wrong)
    out, state = tmp_path / "out", tmp_path / "state.pt"
    with pytest.raises(TrainingError, match="nan at step 4"):
        train(target, cfg, store.answers, features, opts(steps=10, save_every=1, out=out), state, log=lambda m: None)
    saved = torch.load(state, weights_only=False)
    assert saved["step"] == 3 and all(bool(t.isfinite().all()) for t in saved["drafter"].values())
    assert not (out / "model.safetensors").exists() or load_drafter(out).fc.weight.isfinite().all()


def test_a_save_the_disk_refuses_is_logged_mid_run_and_one_error_at_the_end(setup, tmp_path, monkeypatch):
    """A full disk ended `dflash-train` in a traceback at its next save (an audit). A periodic save
    it refuses is logged and training goes on (the weights are in memory, the next save tries
    again); the last save's failure is a TrainingError (one line from the command) that names the
    folder; the state saved before stays whole. torch.save's own error on a full disk is the
    RuntimeError raised here (seen on a 256 KB tmpfs)."""
    target, cfg, store, features = setup
    real_save, full = torch.save, [False]

    def save(obj, path, *args, **kwargs):
        if full[0]:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    real_step, said = Trainer.train_step, []

    def train_step(self, batch):
        full[0] = self.step >= 2  # the disk fills after the second save
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    state = tmp_path / "state.pt"
    with pytest.raises(TrainingError, match=f"step 6: cannot save into {tmp_path} .*unexpected pos.*MiB free there"):
        train(target, cfg, store.answers, features, opts(steps=6, save_every=2), state, log=said.append)
    refused = [line for line in said if "cannot save" in line]
    assert len(refused) == 2 and all(line.endswith("training goes on") for line in refused), said
    assert refused[0].startswith("step 4: cannot save into") and refused[1].startswith("step 6:"), said
    assert torch.load(state, weights_only=False)["step"] == 2  # the last good save, whole
    assert not list(tmp_path.glob("*.tmp"))


def test_a_log_the_disk_refuses_leaves_the_lines_on_the_terminal(tmp_path, capsys):
    from training.stages import log_to

    (tmp_path / "train.log").mkdir()  # a log that cannot be appended to (as root too)
    log = log_to(tmp_path / "train.log")
    log("step 1")
    log("step 2")
    printed = capsys.readouterr().out.splitlines()
    assert [line[9:] for line in printed if "step" in line] == ["step 1", "step 2"]
    assert sum("cannot append to" in line for line in printed) == 1, printed


def test_a_signal_mid_run_stops_it_after_the_step_under_way_and_saves(setup, tmp_path, monkeypatch):
    """SIGTERM or Ctrl-C ended a run at once, with nothing saved since the last --save-every (an
    audit). Heard during a step, it now stops the run after that step, saved, and the handlers
    are the caller's again; a second Ctrl-C ends it at once."""
    import signal

    from training.stopping import Stopped

    target, cfg, store, features = setup
    real_step, before = Trainer.train_step, signal.getsignal(signal.SIGTERM)

    def signalled_at(step: int, *signals: int):
        def train_step(self, batch):
            loss = real_step(self, batch)
            if self.step == step:
                for signum in signals:
                    os.kill(os.getpid(), signum)
            return loss

        return train_step

    monkeypatch.setattr(Trainer, "train_step", signalled_at(3, signal.SIGTERM))
    state, out, said = tmp_path / "state.pt", tmp_path / "out", []
    with pytest.raises(Stopped, match="stopped by SIGTERM after step 3; its state is saved") as stopped:
        train(target, cfg, store.answers, features, opts(steps=50, out=out), state, log=said.append)
    assert stopped.value.signum == signal.SIGTERM and "stopping after step 3: saving" in said
    assert torch.load(state, weights_only=False)["step"] == 3 and load_drafter(out) is not None
    assert signal.getsignal(signal.SIGTERM) is before
    # One heard during the last step stops the run too: it ended as a finished run, exit 0 (a review).
    monkeypatch.setattr(Trainer, "train_step", signalled_at(4, signal.SIGHUP))
    with signals_as_in_a_terminal(), pytest.raises(Stopped, match="stopped by SIGHUP after step 4"):
        train(target, cfg, store.answers, features, opts(steps=4), tmp_path / "last.pt", log=said.append)
    monkeypatch.setattr(Trainer, "train_step", signalled_at(2, signal.SIGINT, signal.SIGINT))
    with signals_as_in_a_terminal(), pytest.raises(KeyboardInterrupt):
        train(target, cfg, store.answers, features, opts(steps=50), tmp_path / "twice.pt", log=said.append)
    assert not (tmp_path / "twice.pt").exists()


def test_dflash_train_stopped_by_sigterm_saves_and_says_so_in_one_line(setup, tmp_path):
    target, _, store, _ = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    args = ["--model", model_dir, "--store", store.folder, "--name", "cut", "--cache", tmp_path / "cache"]
    args += ["--stage", "train", "--block-size", "4", "--steps", 100000, "--batch", 5, "--anchors", 4]
    args += ["--eval-every", 0, "--save-every", 0, "--threads", 1, "--out", tmp_path / "out", "--autocast", "off"]
    err = _train_stopped_by_sigterm(args, once=" step 1 | loss")
    step = int(re.search(r"dflash-train: stopped by SIGTERM after step (\d+);", err.strip().splitlines()[-1]).group(1))
    assert torch.load(tmp_path / "cache/train/cut/state.pt", weights_only=False)["step"] == step


def _train_stopped_by_sigterm(args: list, once: str) -> str:
    """`dflash-train args` sent SIGTERM once it prints a line holding `once`: its stderr, once it
    has ended with SIGTERM's exit code and no traceback."""
    import signal

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "launch.train", *map(str, args)]
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if once in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    return err


def test_generation_stopped_by_sigterm_writes_out_the_answers_it_finished(chat_model_dir, tmp_path):
    """The store writes out once a minute: SIGTERM (systemd, `timeout`, torchrun's stop) ended a
    generation run at once and lost every answer since (an audit: 100 answers, no store at all)."""
    import json

    starter = tmp_path / "starter.jsonl"
    starter.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(400)))
    args = ["--model", chat_model_dir, "--stage", "gen", "--store", tmp_path / "store", "--cache", tmp_path / "cache"]
    args += ["--starter", starter, "--gen-minutes", 5, "--threads", 1, "--max-new", 8, "--gen-batch", 16]
    _train_stopped_by_sigterm(args, once=" answers 100 | ")
    assert len(AnswerStore(tmp_path / "store")) >= 100


def test_answers_whose_prompt_fills_max_len_are_not_trained_on():
    from training.batches import samples

    answers = [Answer(f"k{n}", "j", "answer", [], list(range(40)), n) for n in (31, 30, 10)]

    # 31: no anchor with a label after it within 32 tokens
    assert [s.prompt_len for s in samples(answers, None, max_len=32)] == [30, 10]
    assert len(samples(answers, None)) == 3


def test_ranks_train_on_the_answers_every_rank_holds(monkeypatch):
    """Ranks that opened a growing store or cache at different moments drew batches from different
    answers; they now agree on the keys all of them hold."""
    from training import distributed

    held = [{"a", "b", "c"}, {"a", "c", "d"}]
    monkeypatch.setattr(distributed.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), held))
    assert distributed.Ranks(1, 2).common({"a", "c", "d"}) == {"a", "c"}
    assert distributed.Ranks().common({"x"}) == {"x"}


def test_blocks_given_known_tokens_are_drawn_for_the_whole_batch_on_any_rank_count(setup):
    from training.distributed import Ranks

    target, cfg, store, features = setup
    trainer = Trainer(target, cfg, store.answers, features, opts(batch=5, known=0.5))
    whole = trainer.batch(7)
    parts = []
    for rank in (0, 1):
        trainer.ranks = Ranks(rank, 2)
        parts.append(trainer.batch(7))
    assert bool((whole.labels[..., 1:] == -100).any())  # some blocks were given tokens
    for name in ("block_tokens", "labels"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name)), name


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--gamma", "0"], "--gamma: must be more than 0"),
        (["--batch", "0"], "--batch: must be at least 1"),
        (["--known", "2"], "--known: must be at least 0 and at most 1"),
        (["--lr", "nan"], "--lr: must be more than 0"),
        (["--data", "/nowhere/at/all"], "--data /nowhere/at/all: no such folder"),
    ],
)
def test_launch_train_refuses_flags_that_would_train_nothing_or_nan(flags, says, capsys):
    from launch.train import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(flags)
    assert exit.value.code == 2 and says in capsys.readouterr().err


def test_launch_train_ends_a_users_mistake_in_one_line(setup, tmp_path, capsys):
    """A --resume with no saved state started afresh and overwrote --out; a truncated shard, an
    --init that is no drafter, a vocabulary of nothing: each a traceback or silence before."""
    from launch.train import main

    target, cfg, store, features = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    common = ["--model", str(model_dir), "--block-size", "4", "--threads", "1", "--cache", str(tmp_path / "cache")]
    common += ["--stage", "train", "--steps", "2", "--batch", "2", "--anchors", "2", "--eval-every", "0"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "20260101-000000-00000000.jsonl.xz").write_bytes(shard_paths(store.folder)[0].read_bytes()[:60])
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--store", str(store.folder), "--name", "typo", "--resume"], "--resume: no saved state"),
        (["--store", str(broken)], "not a readable answer shard"),
        (["--store", str(store.folder), "--init", str(tmp_path)], "config.json"),
        (["--store", str(empty), "--stage", "vocab"], "no answer tokens"),
    ]
    for flags, says in cases:
        with pytest.raises(SystemExit) as exit:
            main([*common, *flags])
        err = capsys.readouterr().err
        assert exit.value.code == 1 and says in err and "Traceback" not in err, err


def test_a_rank_ends_with_the_torchrun_that_started_it_even_killed(tmp_path):
    """A torchrun ended by SIGKILL (or a crash) left its ranks training, rewriting state.pt and
    --out, for good (an audit). Here rank 0 of 2 waits at the rendezvous (its store listening)
    when its launcher is killed: it ends too."""
    import signal
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank = "import sys; sys.path.insert(0, sys.argv[1]); from training.distributed import start; start('cpu')"
    launcher = (
        "import os, subprocess, sys\n"
        "env = dict(os.environ, WORLD_SIZE='2', RANK='0', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1')\n"
        f"env['MASTER_PORT'] = '{port}'\n"
        f"child = subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]], env=env)\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, "-c", launcher, root], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())

    def running() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # armed before it listens
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the rank never listened")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(), "the rank outlived its torchrun"
    finally:
        if running():
            os.kill(pid, signal.SIGKILL)


def test_a_second_run_of_one_name_is_refused_while_the_first_works(tmp_path):
    """Two runs of one --name trained side by side, each rewriting the other's state.pt and drafter,
    their lines mixed in one train.log (an audit)."""
    from basics.files import claimed
    from launch.train import parse_args, run_options
    from training.distributed import ONE
    from training.stages import run_stages

    flags = ["--stage", "variety", "--cache", str(tmp_path), "--store", str(tmp_path), "--name", "busy"]
    work = tmp_path / "train" / "busy"
    work.mkdir(parents=True)
    with claimed(work) as first:  # as the first run's process holds it
        assert first
        with pytest.raises(TrainingError, match="--name busy: another run works in"):
            run_stages(run_options(parse_args(flags)), ONE)
    run_stages(run_options(parse_args(flags)), ONE)  # the first is done: this one runs


def test_a_batch_smaller_than_the_ranks_is_refused_before_any_work(tmp_path):
    """--batch 1 on two ranks left one of them an empty share, which crashed inside a reshape."""
    from launch.train import parse_args, run_options
    from training.distributed import Ranks
    from training.stages import run_stages

    flags = ["--stage", "train", "--batch", "1", "--cache", str(tmp_path), "--store", str(tmp_path)]
    with pytest.raises(TrainingError, match="--batch 1 gives 2 ranks"):
        run_stages(run_options(parse_args(flags)), Ranks(0, 2))


def test_a_models_identity_is_its_weights_not_its_save(tmp_path):
    """Re-saved under another transformers version: the same target. Fine-tuned to the same shape
    and file sizes: another (config bytes and file sizes alone called it the same: a review)."""
    from training.features import model_identity

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"hidden_size": 8, "transformers_version": "5.0.0"}
    (folder / "config.json").write_text(json.dumps(config))
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    base = model_identity(folder)
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": "5.24.0"}))
    assert model_identity(folder) == base
    weights.write_bytes(bytes(3 << 20)[:-1] + b"\x01")  # the same size, another last weight
    assert model_identity(folder) != base


def test_a_cache_stamped_by_the_first_identity_scheme_is_taken_for_its_own_target_and_restamped(tmp_path):
    """A feature cache stamped before the identity hashed the weights' ends (2026-12-06) was
    refused after the upgrade as another target's: its rows had to be filled again (an audit). Its
    own target's cache is taken and restamped; another target's is still refused."""
    from training.features import IDENTITY_SCHEME, FeatureCacheError, first_identity, model_identity

    models = []
    for n in (8, 16):
        folder = tmp_path / f"model{n}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"hidden_size": n}))
        (folder / "model.safetensors").write_bytes(bytes(n))
        models.append(folder)
    mine, other = models
    for owner in models:
        cache = tmp_path / f"cache-{owner.name}"
        cache.mkdir()
        (cache / "meta.json").write_text(json.dumps({"width": 4, "model": first_identity(owner)}))
        if owner == other:
            with pytest.raises(FeatureCacheError, match="another target's features"):
                FeatureCache(cache, 4, model=mine)
            continue
        FeatureCache(cache, 4, model=mine)
        meta = json.loads((cache / "meta.json").read_text())
        assert meta == {"width": 4, "model": model_identity(mine), "identity": IDENTITY_SCHEME}
        FeatureCache(cache, 4, model=mine)  # and again, stamped by the scheme of now
    # Weights written since the first scheme's stamp (a fine-tune of one shape saved in place, which that
    # scheme cannot tell from its base) are another model's: refused, not restamped (a review).
    (tmp_path / "cache-late").mkdir()
    (tmp_path / "cache-late" / "meta.json").write_text(json.dumps({"width": 4, "model": first_identity(mine)}))
    stamped = (tmp_path / "cache-late" / "meta.json").stat().st_mtime
    os.utime(mine / "model.safetensors", (stamped + 60, stamped + 60))
    with pytest.raises(FeatureCacheError, match="another target's features"):
        FeatureCache(tmp_path / "cache-late", 4, model=mine)


def test_a_resumed_run_learns_at_the_rate_its_options_now_ask_for(setup, tmp_path):
    """A new --lr on --resume was ignored: the saved rates went on (an audit)."""
    target, cfg, store, features = setup
    o = opts(steps=12, warmup=4)
    first = trained(setup, o, 6, tmp_path / "state.pt")
    lrs = {}
    for lr in (o.lr, o.lr / 10):
        resumed = Trainer(target, cfg, store.answers, features, replace(o, lr=lr, resume=True))
        resumed.load_state(torch.load(tmp_path / "state.pt", weights_only=False))
        lrs[lr] = resumed.optimizer.param_groups[0]["lr"]
        assert resumed.schedule.base_lrs[0] == lr
    assert lrs[o.lr / 10] == pytest.approx(lrs[o.lr] / 10) and lrs[o.lr] == first.optimizer.param_groups[0]["lr"]


def test_a_record_folder_that_exists_keeps_its_mode_and_a_readable_one_is_warned_of(tmp_path, caplog):
    """`--record .` made the working directory 0700, locking others out, even on a run that then
    refused its model (an audit). A folder that exists keeps its mode; where others may read it,
    the operator is told."""
    from answers.traffic import record_folder

    shared = tmp_path / "project"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with caplog.at_level("WARNING", logger="traffic"):
        record_folder(str(shared))
    assert shared.stat().st_mode & 0o777 == 0o755 and "others may read this folder" in caplog.text
    caplog.clear()
    record_folder(str(tmp_path / "new" / "rec"))
    assert (tmp_path / "new" / "rec").stat().st_mode & 0o777 == 0o700 and not caplog.text


def test_the_traffic_recorder_keeps_greedy_answers_privately_and_its_failures_to_itself(tmp_path):
    """`--record` into a folder it cannot write started, then answered every request `done` and
    then `error` (two replies); recorded files were world-readable; sampled answers, which are no
    greedy answers of the target's, went into training data (an audit)."""
    from answers.traffic import TrafficError, TrafficRecorder
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TrafficError, match="cannot write there"):
        TrafficRecorder(str(blocker / "rec"), "tiny")
    recorder = TrafficRecorder(str(tmp_path / "rec"), "tiny", "float32 engine on a CPU")
    assert (tmp_path / "rec").stat().st_mode & 0o777 == 0o700
    done = Result([7, 8], "", "length", Stats())
    for i, sampling in enumerate(({}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.0})):
        fields = {"prompt": "", "messages": [{"role": "user", "content": f"q{i}"}], "sampling": sampling}
        recorder(Message("generate", i, fields), [1, 2, i], done)
    recorder.close()
    recorded = AnswerStore(tmp_path / "rec").answers
    assert [a.messages[0][1] for a in recorded] == ["q0", "q2"] and all(a.model == "tiny" for a in recorded)
    assert {a.made_by for a in recorded} == {"float32 engine on a CPU"}


def test_a_quiet_recorder_writes_out_what_it_holds(tmp_path, monkeypatch):
    """Written out now and then, not after each request: the daemon ticks it between steps, so
    requests before a quiet spell reach the disk without waiting for the next one or the stop."""
    import answers.traffic as traffic
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    now = [1000.0]
    monkeypatch.setattr(traffic.time, "monotonic", lambda: now[0])
    recorder = traffic.TrafficRecorder(str(tmp_path / "rec"), "tiny")
    message = Message("generate", 1, {"prompt": "hi", "messages": [], "sampling": None})
    recorder(message, [1, 2], Result([7], "", "length", Stats()))
    assert len(AnswerStore(tmp_path / "rec")) == 0  # not yet: the serving loop is not held up
    now[0] += traffic.FLUSH_EVERY_S
    recorder.tick()
    recorder.writing.result()  # written on the recorder's thread
    assert len(AnswerStore(tmp_path / "rec")) == 1


def test_the_recorder_writes_on_a_thread_of_its_own_one_write_at_a_time(tmp_path, monkeypatch, caplog):
    """Each write rewrote the open shard on the serving thread: with long chats one tick stalled
    every running request for up to 15 s (an audit). A write now runs beside the serving loop; a
    tick while one runs starts none; a failed write is logged and the next one writes it all."""
    import threading

    import answers.traffic as traffic
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    now, release, calls, write = [1000.0], threading.Event(), [], traffic.write_shard
    monkeypatch.setattr(traffic.time, "monotonic", lambda: now[0])

    def slow_disk(path, answers, preset):
        calls.append(len(answers))
        assert release.wait(30)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        write(path, answers, preset)

    monkeypatch.setattr(traffic, "write_shard", slow_disk)
    recorder = traffic.TrafficRecorder(str(tmp_path / "rec"), "tiny")

    def serve(i):
        message = Message("generate", i, {"prompt": f"q{i}", "messages": [], "sampling": None})
        recorder(message, [1, 2], Result([7, i], "", "length", Stats()))
        now[0] += traffic.FLUSH_EVERY_S
        recorder.tick()

    serve(1)  # returns while its write waits on the disk
    serve(2)  # the write still runs: no second one
    assert not release.is_set() and len(calls) <= 1
    release.set()
    with caplog.at_level("ERROR", logger="traffic"):
        recorder.writing.result()
        assert calls == [1] and "No space left on device" in caplog.text
        recorder.tick()
        recorder.close()
    assert calls == [1, 2] and [a.prompt_len for a in AnswerStore(tmp_path / "rec").answers] == [2, 2]


def test_a_full_shard_whose_write_failed_is_written_again(tmp_path, monkeypatch):
    """A shard is written once more as it fills, then never again: one failed write there lost its
    answers for good (a review). It is kept and written again at the next tick."""
    import answers.traffic as traffic
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    now, write, failures = [1000.0], traffic.write_shard, [1]
    monkeypatch.setattr(traffic.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(traffic, "SHARD_RECORDS", 2)

    def disk_full_once(path, answers, preset):
        if failures and len(answers) == 2:  # the first shard, full
            failures.pop()
            raise OSError(28, "No space left on device")
        write(path, answers, preset)

    monkeypatch.setattr(traffic, "write_shard", disk_full_once)
    recorder = traffic.TrafficRecorder(str(tmp_path / "rec"), "tiny")
    for i in range(3):  # the third opens the second shard, which writes the first out
        message = Message("generate", i, {"prompt": f"q{i}", "messages": [], "sampling": None})
        recorder(message, [1, 2], Result([7, i], "", "length", Stats()))
    recorder.writing.result()
    assert not failures and len(AnswerStore(tmp_path / "rec")) == 0
    now[0] += traffic.FLUSH_EVERY_S
    recorder.tick()
    recorder.close()
    assert [a.tokens[-1] for a in AnswerStore(tmp_path / "rec").answers] == [0, 1, 2]


def test_a_long_outage_drops_the_oldest_unwritten_shards_and_a_removed_folder_comes_back_private(
    tmp_path, monkeypatch, caplog
):
    """Shards the disk refused were all held to write again: a long outage grew the daemon without
    a bound. Past MAX_HELD_TOKENS the oldest are dropped, logged; the newest are written once the
    disk takes them, into a folder made again 0700 where it was removed (it came back 0755: an
    audit)."""
    import shutil

    import answers.traffic as traffic
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    write, full = traffic.write_shard, [True]

    def disk(path, answers, preset):
        if full[0]:
            raise OSError(28, "No space left on device")
        write(path, answers, preset)

    monkeypatch.setattr(traffic, "write_shard", disk)
    monkeypatch.setattr(traffic, "SHARD_RECORDS", 2)
    monkeypatch.setattr(traffic, "MAX_HELD_TOKENS", 20)  # two shards of two 5-token answers
    recorder = traffic.TrafficRecorder(str(tmp_path / "rec"), "tiny")
    with caplog.at_level("ERROR", logger="traffic"):
        for i in range(13):  # six shards fill and fail; the seventh is open
            message = Message("generate", i, {"prompt": f"q{i}", "messages": [], "sampling": None})
            recorder(message, [1, 2], Result([7, 8, i], "", "length", Stats()))
            if recorder.writing is not None:
                recorder.writing.result()
    held = sum(len(a.tokens) for answers in recorder.failed.values() for a in answers)
    assert held <= 20 + 5 and caplog.text.count("dropped 2 recorded requests") == 4, caplog.text
    shutil.rmtree(tmp_path / "rec")
    full[0] = False
    recorder.close()
    assert (tmp_path / "rec").stat().st_mode & 0o777 == 0o700
    assert [a.tokens[-1] for a in AnswerStore(tmp_path / "rec").answers] == [8, 9, 10, 11, 12]


def test_a_recorder_holds_the_open_shard_not_every_answer_it_ever_recorded(tmp_path, monkeypatch):
    """A recording daemon kept every answer it served in memory, and a restarted one read every
    answer in the folder back (an audit: 10.5 KiB a request, for good). Its store now holds the
    open shard's answers and a bounded set of recent keys; what it wrote reads back whole."""
    import answers.store as answer_store
    from answers.traffic import TrafficRecorder
    from protocol import Message
    from target_node.decoding.sequence import Result
    from target_node.decoding.stats import Stats

    def serve(recorder, count, first=0):
        for i in range(first, first + count):
            fields = {"prompt": "", "messages": [{"role": "user", "content": f"q{i}"}], "sampling": {}}
            recorder(Message("generate", i, fields), [1, 2, 3], Result([7, i], "", "length", Stats()))

    recorder = TrafficRecorder(str(tmp_path / "rec"), "tiny")
    serve(recorder, 600)
    serve(recorder, 5)  # the same requests again: recent keys are not written twice
    store = recorder.store
    assert store.answers == [] and len(store._shard_answers) <= 256 and len(store._recent) == 600
    recorder.close()
    again = TrafficRecorder(str(tmp_path / "rec"), "tiny")  # a restart reads no answer back
    assert again.store.answers == [] and not again.store._recent
    serve(again, 10, first=600)
    again.close()
    written = AnswerStore(tmp_path / "rec")
    assert len(written) == 610 and [a.messages[0][1] for a in written.answers] == [f"q{i}" for i in range(610)]
    monkeypatch.setattr(answer_store, "RECENT_KEYS", 4)
    bounded = AnswerStore(tmp_path / "other", remember=False)
    for answer in written.answers[:10]:
        assert bounded.add(answer, flush_every_s=float("inf"))
    assert len(bounded._recent) == 4


def _rank_scale(rank: int, world: int, init_file: str, store: str, folders: list[str], width: int, out: str) -> None:
    """One rank of `test_ranks_that_opened_a_growing_cache_at_different_moments_share_rank_0s_scale`,
    which also asks `Ranks.most` here: the signal a stop names is the ranks' largest (rank 0 named
    SIGTERM for a SIGHUP rank 1 heard: a review)."""
    import torch.distributed as dist

    from training.distributed import Ranks, stop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    target = tiny_target(layers=4, slots=8)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    answers = AnswerStore(store).answers
    trainer = Trainer(target, cfg, answers, FeatureCache(folders[rank], width), opts(), Ranks(rank, world))
    every = [torch.zeros_like(trainer.scale) for _ in range(world)]
    dist.all_gather(every, trainer.scale)
    torch.save({"scales": every, "most": Ranks(rank, world).most([0, 1][rank])}, Path(out) / f"rank{rank}.pt")
    del trainer
    stop(Ranks(rank, world))


def test_ranks_that_opened_a_growing_cache_at_different_moments_share_rank_0s_scale(setup, tmp_path):
    """Each rank measured the feature scale on the cache as it found it: with a generator adding
    rows meanwhile, rank 1 trained with other scales than rank 0, which alone was saved (an audit).
    Two gloo ranks here see the cache with and without later rows: both train with rank 0's scale."""
    import shutil

    import torch.multiprocessing as mp

    _, cfg, store, features = setup
    grown = tmp_path / "grown"
    shutil.copytree(features.folder, grown)
    later = FeatureCache(grown, cfg.feature_width)
    for i in range(40):  # rows of answers that arrived after rank 0 opened the cache
        later.add(f"later-{i}", torch.randn(50, cfg.feature_width, generator=torch.Generator().manual_seed(i)) * 3)
    alone = Trainer(setup[0], cfg, store.answers, features, opts())
    folders = [str(features.folder), str(grown)]
    args = (2, str(tmp_path / "init"), str(store.folder), folders, cfg.feature_width, str(tmp_path))
    mp.spawn(_rank_scale, args=args, nprocs=2, join=True)
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(seen["scales"][0], seen["scales"][1]) and torch.equal(seen["scales"][0], alone.scale), rank
        assert seen["most"] == 1, rank


def test_ranks_stop_only_once_what_a_collection_frees_is_freed(monkeypatch):
    """A DDP wrapper that only a garbage collection frees (a trainer's reference cycles) outlived
    `stop` and was freed at interpreter exit, after the process group was gone: gloo's teardown
    then aborted the rank (SIGABRT; a CI run failed so, and a third of spawned ranks in a
    reproduction). `stop` collects first. The real teardown runs in the spawned ranks above."""
    import gc
    import weakref

    from training import distributed
    from training.distributed import Ranks

    class Held:
        pass

    held = Held()
    held.itself = held
    alive, freed_first = weakref.ref(held), []
    del held
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: freed_first.append(alive() is None))
    gc.disable()
    try:
        distributed.stop(Ranks(0, 2))
    finally:
        gc.enable()
    assert freed_first == [True]


def test_a_saved_drafter_is_readable_as_the_umask_allows(setup, tmp_path):
    """safetensors writes its file 0600 whatever the umask says: a drafter saved for a team (a
    shared checkpoint folder) could not be loaded by the others, and the error said "No such file"
    (an audit)."""
    _, cfg, _, _ = setup
    umask = os.umask(0o022)
    try:
        save_drafter(random_drafter(cfg, seed=1), tmp_path / "drafter")
    finally:
        os.umask(umask)
    assert (tmp_path / "drafter" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_save_killed_midway_leaves_the_last_good_checkpoint_or_none_never_a_mix(setup, tmp_path):
    """save_drafter wrote model.safetensors in place: a rank killed mid-write (torchrun ends the
    others when one dies) left half a file and the folder unloadable (an audit). Replaced whole, a
    run's next save leaves the last one loadable; a save of another drafter (other vocabulary or
    shape) killed before its weights leaves a folder without weights, never the new vocabulary
    beside the old weights, which loaded and proposed the wrong tokens (a review)."""
    from draft_node.checkpoint import CheckpointError, load_draft_vocab

    _, cfg, _, _ = setup
    folder = tmp_path / "drafter"
    first = random_drafter(cfg, seed=1)
    first.draft_vocab = [1, 2, 3]
    save_drafter(first, folder)
    (folder / "config.json").chmod(0o600)
    before = load_drafter(folder).state_dict()

    def killed_saving(vocab: list[int]) -> None:
        script = f"""
import json, os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from pathlib import Path
from draft_node import checkpoint
from draft_node.checkpoint import random_drafter
from draft_node.config import DFlashConfig
whole = Path.write_bytes

def half_then_killed(path, data):
    if "model.safetensors" not in path.name:
        return whole(path, data)
    whole(path, data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)

Path.write_bytes = half_then_killed
drafter = random_drafter(DFlashConfig.from_json(json.loads({json.dumps(cfg.to_json())!r})), seed=2)
drafter.draft_vocab = {vocab!r}
checkpoint.save_drafter(drafter, {str(folder)!r})
"""
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
        assert done.returncode == -9, done.stderr.decode()[-2000:]

    killed_saving([1, 2, 3])  # the run's next save
    after = load_drafter(folder).state_dict()
    assert all(torch.equal(after[name], weight) for name, weight in before.items())
    assert load_draft_vocab(folder) == [1, 2, 3] and (folder / "config.json").stat().st_mode & 0o777 == 0o600
    killed_saving([100, 101, 102])  # another drafter's
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(folder)
    # Each killed save's partial file stays for QUIET_S (a writer in another container looks as gone),
    # then the next save removes it: none is left for good.
    parts = list(folder.glob("*.tmp"))
    assert len(parts) == 2
    assert not list(folder.glob(".*"))  # nor one of safetensors' naming (.tmpXXXXXX, a drafter's size), for good
    for part in parts:
        long_ago(part)
    save_drafter(random_drafter(cfg, seed=2), folder)  # a whole save: its weights, no vocabulary left behind
    assert not list(folder.glob("*.tmp"))
    assert not torch.equal(load_drafter(folder).state_dict()["fc.weight"], before["fc.weight"])
    assert load_draft_vocab(folder) == []


def test_a_partial_file_a_killed_write_left_does_not_stop_the_next(tmp_path):
    """A killed write left its partial file with the old file's read-only mode, and every later
    write to it failed (a review)."""
    from basics.files import write_atomically

    def fresh(text: str):  # a writer that cannot open an existing file, as a read-only one is to a user
        def write(tmp: Path) -> None:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as fh:
                fh.write(text)

        return write

    path = tmp_path / "config.json"
    write_atomically(path, fresh("one"))
    path.chmod(0o444)
    (tmp_path / "config.json.tmp").write_text("half")
    (tmp_path / "config.json.tmp").chmod(0o444)
    write_atomically(path, fresh("two"))
    assert path.read_text() == "two" and path.stat().st_mode & 0o777 == 0o444
    assert not (tmp_path / "config.json.tmp").exists()


def _run_r(setup, tmp_path) -> tuple[list[str], Path]:
    """dflash-train's flags for a tiny run named r in tmp_path's cache, and where its state goes."""
    target, _, store, _ = setup
    model_dir = tmp_path / "model"
    target.model.save_pretrained(model_dir)
    cache = tmp_path / "cache"
    common = ["--model", str(model_dir), "--block-size", "4", "--threads", "1", "--cache", str(cache), "--name", "r"]
    common += ["--stage", "train", "--batch", "2", "--anchors", "2", "--eval-every", "0", "--store", str(store.folder)]
    return common, cache / "train" / "r" / "state.pt"


def test_a_run_is_resumed_or_restarted_never_replaced_and_a_wrong_resume_is_refused_before_any_fill(
    setup, tmp_path, capsys
):
    """A run started again under its --name without --resume replaced its saved state silently, and
    a --resume of another shape was refused only after the whole feature fill (an audit)."""
    from launch.train import main

    common, state = _run_r(setup, tmp_path)
    cache = tmp_path / "cache"
    main([*common, "--steps", "2"])
    with pytest.raises(SystemExit) as exit:
        main([*common, "--steps", "3"])
    assert exit.value.code == 1 and "--resume it, or --restart it" in capsys.readouterr().err
    assert torch.load(state, weights_only=False)["step"] == 2
    main([*common, "--steps", "3", "--restart"])
    assert torch.load(state, weights_only=False)["step"] == 3
    folders = set((cache / "features").iterdir())
    with pytest.raises(SystemExit) as exit:
        main([*common, "--steps", "4", "--resume", "--layers", "2", "--taps", "0,3"])
    err = capsys.readouterr().err
    assert exit.value.code == 1 and "num_hidden_layers 1 (asked: 2)" in err, err
    assert set((cache / "features").iterdir()) == folders  # no fill for the new taps began
    with pytest.raises(SystemExit):
        main(["--stage", "train", "--store", str(tmp_path / "no-such-store")])
    assert "--store" in capsys.readouterr().err


class _RunsOnLoad:
    """A pickled object that runs code when loaded: what a state.pt from elsewhere may hold."""

    def __reduce__(self):
        return (Path.touch, (Path(os.environ["DFLASH_TEST_RAN"]),))


def test_a_resume_runs_no_code_from_its_state_and_a_state_of_another_version_is_refused_with_why(
    setup, tmp_path, capsys, monkeypatch
):
    """state.pt was read with weights_only=False: a state handed on ran whatever it held. And one an
    older trainer saved, its optimizer grouped otherwise, ended the run with a traceback (an audit)."""
    from launch.train import main

    common, state_path = _run_r(setup, tmp_path)
    main([*common, "--steps", "2"])
    state = torch.load(state_path, weights_only=True)

    ran = tmp_path / "ran"
    monkeypatch.setenv("DFLASH_TEST_RAN", str(ran))
    torch.save({**state, "history": [_RunsOnLoad()]}, state_path)
    with pytest.raises(SystemExit) as exit:
        main([*common, "--steps", "3", "--resume"])
    err = capsys.readouterr().err
    assert exit.value.code == 1 and "holds objects other than tensors" in err and not ran.exists(), err
    assert "trust the source" not in err, err  # torch's page of advice for code left out

    older = dict(state["optimizer"], param_groups=state["optimizer"]["param_groups"][:1])  # one group of two
    torch.save({**state, "optimizer": older}, state_path)
    with pytest.raises(SystemExit) as exit:
        main([*common, "--steps", "3", "--resume"])
    err = capsys.readouterr().err
    assert exit.value.code == 1 and "another version of the trainer" in err and "Traceback" not in err, err

    torch.save({"step": 2}, state_path)
    with pytest.raises(SystemExit) as exit:
        main([*common, "--steps", "3", "--resume"])
    assert exit.value.code == 1 and "is no trainer state" in capsys.readouterr().err
    torch.save(state, state_path)
    main([*common, "--steps", "3", "--resume"])  # the state as saved resumes
    assert torch.load(state_path, weights_only=True)["step"] == 3


def test_two_processes_writing_one_file_at_once_each_write_it_whole(tmp_path):
    """One partial file for every writer: two processes filling one cache at once removed each
    other's and one failed with FileNotFoundError (1 round in 4, an audit). Each writer has its own,
    and a dead writer's is removed by the next write."""
    import multiprocessing

    path = tmp_path / "config.json"
    dead = tmp_path / f"config.json.{2**22 + 1}-7.tmp"  # above any pid_max: no such process
    dead.write_text("half")
    long_ago(dead)
    context = multiprocessing.get_context("fork")
    ready = context.Barrier(4)
    procs = [context.Process(target=_writes_many, args=(path, i, ready)) for i in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    assert path.read_text() in {f"writer {i}" * 1000 for i in range(4)} and not list(tmp_path.glob("*.tmp"))


def test_a_part_whose_writer_is_not_seen_here_but_that_was_touched_lately_is_left_to_it(tmp_path):
    """A writer in another container sharing the folder has a pid this process cannot see: its part
    was taken for a killed writer's and removed as it wrote; its rename then failed (an audit). A
    part is a killed writer's only once it has also been left untouched for QUIET_S."""
    from basics.files import write_atomically

    path = tmp_path / "state.json"
    other = tmp_path / f"state.json.{2**22 + 1}-7.tmp"  # no such pid here
    other.write_text("being written")
    write_atomically(path, lambda tmp: tmp.write_text("mine"))
    assert other.read_text() == "being written" and path.read_text() == "mine"
    long_ago(other)
    write_atomically(path, lambda tmp: tmp.write_text("mine again"))
    assert not other.exists()
    # A folder being written: the files inside are what is touched (a conversion's weights).
    from basics.files import left_by_gone_writers

    folder = tmp_path / f"model.{2**22 + 1}-7.partial"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights coming")
    long_ago(folder)  # its own time old, the file in it written now
    assert left_by_gone_writers([folder], "model.") == []
    long_ago(folder / "model.safetensors")
    assert left_by_gone_writers([folder], "model.") == [folder]


def _writes_many(path: Path, i: int, ready) -> None:
    from basics.files import write_atomically

    ready.wait()
    for _ in range(200):
        write_atomically(path, lambda tmp: tmp.write_text(f"writer {i}" * 1000))


def test_a_write_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
    """A full disk: the partial .tmp stayed, and kept the disk full (an audit)."""
    import errno

    from basics.files import write_atomically

    path = tmp_path / "state.pt"
    path.write_text("old")

    def fails_part_way(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, fails_part_way)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_rows_added_after_a_part_written_row_sit_at_their_offsets(tmp_path):
    """A write that failed part-way (a full disk) left part of a row, and every row added after it
    sat that many bytes off its index's offset, for good (an audit)."""
    cache = features_module.FeatureCache(tmp_path / "features", 4)
    cache.add("first", torch.ones(2, 4))
    with open(cache.rows_path, "ab") as fh:  # what a failed write of another row left
        fh.write(b"\x00" * 3)
    cache.add("second", torch.full((3, 4), 7.0))
    reopened = features_module.FeatureCache(tmp_path / "features", 4)
    assert torch.equal(reopened.get("first"), torch.ones(2, 4))
    assert torch.equal(reopened.get("second"), torch.full((3, 4), 7.0))


def test_training_embeds_the_noise_block_as_serving_does_where_the_embedding_scales(tmp_path):
    """Gemma-family targets scale their embeddings inside the embedding module (by sqrt(hidden)),
    and serving sends `TargetModel.embed`'s rows (`DrafterBridge.noise`): training read the bare
    weight rows, so its drafter learned on blocks 1/sqrt(hidden) the size of those it is served."""
    from target_node.drafting.bridge import DrafterBridge

    for arch in ("llama", "gemma2"):
        target = tiny_target(arch)
        cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
        trainer = Trainer(target, cfg, [], FeatureCache(tmp_path / arch, cfg.feature_width), opts())
        served = DrafterBridge(target, random_drafter(cfg).describe(64)).noise(5)
        trained = trainer.noise(torch.tensor([[[5, 0, 0, 0]]]))[0, 0]
        torch.testing.assert_close(trained, served.float(), msg=arch)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "falcon_h1"])
def test_training_projects_through_the_head_as_the_target_computes_its_logits(one_thread, tmp_path, arch):
    """The loss head and distillation's teacher are the target's logits as serving computes them
    (`TargetModel.logits`, which draft logits use too): with Gemma 2's final softcap and Falcon-H1's
    LM head multiplier. Training left both out, so its drafter learned logits at another temperature
    than serving samples drafts from, and distilled from a distribution that was not the target's
    (an audit)."""
    target = tiny_target(arch)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    trainer = Trainer(target, cfg, [], FeatureCache(tmp_path / arch, cfg.feature_width), opts(draft_vocab=0))
    hidden = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(trainer.project(hidden), target.logits(hidden))
    tokens = list(range(3, 20))
    final, _ = target.forward(tokens)
    rows = Batch(None, None, None, None, teacher=final[None])
    teacher = trainer.teacher_logprobs(rows, torch.ones(1, len(tokens), dtype=torch.bool))
    with torch.no_grad():
        own = target.model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(teacher, own)


def assert_steps_tap_as_prefill(target) -> None:
    """The rows a recurrent target taps one token at a time (after a 12-token prefill) equal, beyond
    rounding, those one prefill of the same 35 tokens taps."""
    taps, tokens = (0, 1, 2), [5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 150, 8] + list(range(100, 123))
    prefilled = target.prefill_features([tokens], taps)[0]
    _, first = target.forward(tokens[:12], taps)
    stepped = torch.cat([first] + [target.forward([t], taps)[1] for t in tokens[12:]])
    torch.testing.assert_close(stepped, prefilled, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["mamba2", "falcon_h1", "nemotron_h", "qwen3_next"])
def test_a_recurrent_targets_one_token_steps_tap_the_rows_its_prefill_computes(one_thread, arch):
    """Serving taps rows one token at a time (plain steps, single accepted tokens), training's fill
    taps them in one prefill: the two must agree beyond rounding. transformers' Nemotron-H clamped
    its step sizes at time_step_min in the chunked scan alone, not in its one-token step, and the
    rows differed by up to 0.05 on a scale of 30 (an audit)."""
    target = tiny_target(arch)
    assert_steps_tap_as_prefill(target)


def test_a_zamba2_targets_one_token_steps_tap_the_rows_its_prefill_computes(one_thread):
    """Zamba2 loads as a target, and its mixers clamp at time_step_min in the chunked scan alone, as
    Nemotron-H's did; its config states no time_step_limit, so the alignment passed it by and a
    row run alone differed from the same row prefilled (or verified) by 0.4% (a review)."""
    import transformers

    from target_node.model.target import TargetModel

    config = transformers.Zamba2Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8, intermediate_size=128, tie_word_embeddings=False,
        layers_block_type=["mamba", "hybrid", "mamba", "mamba"], hybrid_layer_ids=[1], chunk_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Zamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.2)
    target = TargetModel(model, tokenizer=None)
    assert_steps_tap_as_prefill(target)


def test_feature_rows_past_float16s_range_are_refused_with_their_peak_not_cached_as_inf(tmp_path):
    """The cache stores fp16 rows: a row past 65,504 (a large model's outlier channel) was stored as
    inf, and the run it fed stopped at a NaN loss that said nothing of why. It is refused, naming its
    peak, and nothing of it is written; rows in range are kept as before."""
    cache = features_module.FeatureCache(tmp_path / "features", 4)
    wild = torch.ones(2, 4)
    wild[1, 2] = 1e5
    with pytest.raises(features_module.FeatureCacheError, match=r"reach 1e\+05, past float16's range"):
        cache.add("wild", wild)
    cache.add("tame", torch.full((3, 4), 60000.0))
    reopened = features_module.FeatureCache(tmp_path / "features", 4)
    assert "wild" not in reopened and torch.equal(reopened.get("tame"), torch.full((3, 4), 60000.0))
