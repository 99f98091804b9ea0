"""The datastore branch: continuations the target wrote before, found by the context's tail and
verified as one more branch of every greedy tree; it changes speed, never output."""

import gzip
import json
import os
import random
import shutil

import numpy as np
import pytest
from helpers import assert_lossless, greedy, long_ago, running, tiny_target

from answers.index import KEEP, datastore_coming, datastore_for, index_for, prune
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.decoding.speculative import MAX_LOOKUP
from target_node.drafting.datastore import Datastore
from target_node.drafting.proposers import NoProposer


def reference(sequences, tail, limit, context):
    """The definition, spelled out: the longest tail (up to `context` tokens) that occurs, then the
    commonest next token among its occurrences, the commonest after it among those that agreed..."""
    for k in range(min(context, len(tail)), 0, -1):
        rows = [s[i : i + limit] for s in sequences for i in range(k, len(s)) if s[i - k : i] == tail[-k:]]
        if not rows:
            continue
        out = []
        for d in range(limit):
            column = [r[d] for r in rows if len(r) > d]
            if not column:
                break
            best = min(set(column), key=lambda t: (-column.count(t), t))  # ties: the smallest token
            out.append(best)
            rows = [r for r in rows if len(r) > d and r[d] == best]
        return out
    return []


def test_a_continuation_is_the_vote_of_the_longest_matching_context():
    store = Datastore.build([[1, 2, 3, 4], [9, 2, 3, 5, 6], [7, 2, 3, 5, 8], [1, 2]])
    found = store([0, 2, 3], 3)
    assert found.tokens == [5, 6]  # "2 3" twice before 5, once before 4; then 6 and 8 tie: the smaller
    assert found.chances == pytest.approx([2 / 4, 1 / 3])  # 2 of 3 occurrences agree, then 1 of 2
    assert store([1, 2, 3], 3).tokens == [4]  # "1 2 3" occurred: its follow, though "2 3" votes 5
    for tail, limit in (([4], 3), ([42], 3), ([], 3), ([1, 2], 0), ([6], 2)):  # 6 ended its answer: no follow
        assert store(tail, limit).tokens == []
    rng = random.Random(0)
    for _ in range(300):
        alphabet = rng.choice([3, 5, 20])
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randint(0, 12))] for _ in range(rng.randint(1, 8))]
        store = Datastore.build(seqs)
        for _ in range(10):
            tail, limit = [rng.randrange(alphabet + 1) for _ in range(rng.randint(1, 6))], rng.randint(1, 6)
            kept = [s for s in seqs if len(s) >= 2]
            assert store(tail, limit).tokens == reference(kept, tail, limit, store.context), (seqs, tail, limit)


def test_a_saved_datastore_maps_back_the_same_and_wide_vocabularies_keep_fewer_tokens_of_context(tmp_path):
    rng = random.Random(1)
    seqs = [[rng.randrange(200_000) for _ in range(30)] for _ in range(20)]
    seqs.append(seqs[3][5:20])  # a phrase said twice
    store = Datastore.build(seqs)
    assert store.bits == 18 and store.context == 3 and store.tokens.dtype == np.uint32
    loaded = Datastore.load(store.save(tmp_path / "ds"))
    assert isinstance(loaded.keys, np.memmap) and len(loaded) == len(store)
    for s in seqs:
        for i in range(1, len(s)):
            assert loaded(s[:i], 4) == store(s[:i], 4) and store(s[:i], 4).tokens == reference(seqs, s[:i], 4, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3)


PROMPTS = [[(s * 37 + i * 11) % 300 + 1 for i in range(6)] for s in range(4)]


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_datastore_branch_changes_speed_never_output(target, adaptive):
    """Built from the target's own answers it is right where they repeat; built from noise it is
    wrong everywhere: the output is the target's own either way."""
    answers = {tuple(p): greedy(target, p, 40) for p in PROMPTS}
    rng = random.Random(2)
    stores = {
        "answers": Datastore.build(list(answers.values())),
        "noise": Datastore.build([[rng.randrange(1, 300) for _ in range(50)] for _ in range(50)]),
    }
    for name, store in stores.items():
        for prompt, want in answers.items():
            options = DecodeOptions(40, tree_nodes=6, adaptive=adaptive, lookup=False, datastore=store)
            result = generate(target, list(prompt), NoProposer(), options)
            assert_lossless(target, list(prompt), result.tokens, want)
            stats = result.stats  # every accepted draft counted once by its node's source, once by its step's
            assert sum(stats.accepted_on_steps.values()) == stats.accepted == sum(stats.accepted_by_source.values())
            # No drafter, no governor: the lookups' branches are the tree, each up to MAX_LOOKUP deep.
            assert all(stats.accepted_on_steps[k] <= MAX_LOOKUP * n for k, n in stats.sources.items())
            if name == "answers" and not adaptive:  # its own answer, verified every step: taken whole
                assert result.stats.accepted_by_source["datastore"] >= 30, result.stats.accepted_by_source


def write_store(folder, model, answers, **fields):
    """A shard of `answers` (each a prompt token 1 and the answer's ids); `fields` override every one's."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "20261205-000000-abcd.jsonl.gz", "wt") as fh:
        for i, tokens in enumerate(answers):
            answer = {"key": f"k{i}", "job": f"j{i}", "stage": "answer", "messages": [], "tokens": [1, *tokens]}
            fh.write(json.dumps({**answer, "prompt_len": 1, "model": model, **fields}) + "\n")


def test_the_daemons_datastore_is_the_served_models_answers_indexed_once(tmp_path):
    write_store(tmp_path / "store", "tiny", [[5, 6, 7, 8], [5, 6, 9]])
    cache = tmp_path / "cache"
    store = datastore_for(str(tmp_path / "store"), "tiny", cache)
    assert store([4, 5, 6], 2).tokens == [7, 8] and store([1], 3).tokens == []  # the prompts are not indexed
    (built,) = (cache / "datastore").iterdir()
    again = datastore_for(str(tmp_path / "store"), "tiny", cache)  # mapped from the cache, not rebuilt
    assert isinstance(again.keys, np.memmap) and list((cache / "datastore").iterdir()) == [built]
    assert datastore_for(str(tmp_path / "store"), "another-model", cache) is None
    assert datastore_for("none", "tiny", cache) is None
    with pytest.raises(FileNotFoundError, match="no such answer store"):
        datastore_for(str(tmp_path / "missing"), "tiny", cache)


def test_a_store_that_grows_across_restarts_keeps_only_the_newest_indexes(tmp_path):
    """Each restart after a new shard builds a new index; the older ones of that model go (all but
    KEEP), another model's stay (one whose name starts with this one's too), and the newest serves."""
    cache, store = tmp_path / "cache", tmp_path / "store"
    write_store(tmp_path / "other", "tiny-2", [[5, 6, 7]])
    assert datastore_for(str(tmp_path / "other"), "tiny-2", cache) is not None
    built = []
    for i in range(KEEP + 3):
        write_store(tmp_path / "shard", "tiny", [[5, 6, 7 + i]])
        store.mkdir(exist_ok=True)
        (tmp_path / "shard" / "20261205-000000-abcd.jsonl.gz").rename(store / f"20261205-00000{i}-abcd.jsonl.gz")
        served = datastore_for(str(store), "tiny", cache)
        assert served([4, 5, 6], 1).tokens == [7]  # the vote among the shards so far: the first wins ties
        built.append({d.name for d in (cache / "datastore").glob("tiny-*") if not d.name.startswith("tiny-2-")})
    assert [len(names) for names in built] == [1, 2, 3] + [KEEP] * 3
    assert all(len(built[i] - built[i - 1]) == 1 for i in range(1, len(built)))  # one new index a restart
    assert len(list((cache / "datastore").glob("tiny-2-*"))) == 1


def test_the_offline_lookup_walk_steps_as_a_live_chain_does():
    """training.estimate.lookup_tau, which benchmarks.datastore_size reports: a lookup that knows
    each answer accepts whole blocks, one that knows nothing a token a step, and a datastore of
    other answers something between, from the same walk."""
    from answers.store import Answer
    from target_node.drafting.proposal import Continuation
    from training.estimate import lookup_tau

    rng = random.Random(3)
    answers = [
        Answer(f"k{i}", "j", "answer", [], [rng.randrange(50) for _ in range(5 + 30)], prompt_len=5) for i in range(6)
    ]
    truth = {tuple(a.tokens[:at]): a.tokens[at:] for a in answers for at in range(a.prompt_len, len(a.tokens))}

    def oracle(tokens, limit):
        return Continuation(truth[tuple(tokens)][:limit])

    full = lookup_tau(oracle, answers, block=8)
    assert full["steps"] == 6 * 4  # 30 tokens, up to 8 a step: 8 + 8 + 8 + 6
    assert full["tau"] == pytest.approx(30 / 4) and full["first_accepted"] == 1.0
    blind = lookup_tau(lambda tokens, limit: Continuation([]), answers, block=8)
    assert blind == {"tau": 1.0, "first_accepted": 0.0, "steps": 6 * 30}
    store = Datastore.build([a.tokens[a.prompt_len :] for a in answers[:3]])
    known, unknown = lookup_tau(store, answers[:3]), lookup_tau(store, answers[3:])
    assert known["tau"] > 2 * unknown["tau"] and unknown["tau"] >= 1.0


def test_a_datastore_proposes_no_token_past_the_served_vocabulary(tmp_path):
    """A store of a same-named model with more tokens offered id 327 to a 320-token target: the
    forward's embedding lookup failed every request in the batch (an audit)."""
    write_store(tmp_path / "store", "tiny", [[5, 6, 7, 327, 8]] * 3)
    store = datastore_for(str(tmp_path / "store"), "tiny", tmp_path / "cache", vocab_size=320)
    assert store([4, 5, 6], 4).tokens == [7]  # cut before the id the target does not have
    assert datastore_for(str(tmp_path / "store"), "tiny", tmp_path / "cache")([4, 5, 6], 4).tokens == [7, 327, 8]


def test_a_broken_shard_or_index_costs_the_datastore_not_the_daemon(tmp_path, monkeypatch, caplog):
    """One unreadable shard stopped every daemon's start with a traceback; an index cut short was
    mapped at every start and failed it; a build that could not be written left its part behind."""
    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    (store / "20261205-000001-abcd.jsonl.xz").write_bytes(b"not xz at all")
    with caplog.at_level("WARNING", logger="datastore"):
        assert datastore_for(str(store), "tiny", cache)([4, 5, 6], 2).tokens == [7, 8]
    assert "cannot be read" in caplog.text
    (index,) = (cache / "datastore").iterdir()
    (index / "keys.npy").write_bytes((index / "keys.npy").read_bytes()[:40])  # cut short
    assert datastore_for(str(store), "tiny", cache)([4, 5, 6], 2).tokens == [7, 8]  # built again
    for folder in (cache / "datastore").iterdir():
        shutil.rmtree(folder)

    def disk_full(self, folder):
        (folder / "part").parent.mkdir(parents=True, exist_ok=True)
        (folder / "part").write_text("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(answer_index.Datastore, "save", disk_full)
    assert datastore_for(str(store), "tiny", cache) is None  # served without it
    assert list((cache / "datastore").iterdir()) == []  # nothing left behind


def test_a_missing_datastore_folder_is_refused_before_the_model_loads(tmp_path):
    """It was refused only after the target had loaded (minutes for a large model: an audit)."""
    from target_node.serving.settings import ServiceSettings

    with pytest.raises(ValueError, match="no such answer store folder"):
        ServiceSettings(datastore=str(tmp_path / "missing"))
    assert ServiceSettings(datastore=str(tmp_path)).datastore == str(tmp_path)


def test_answers_whose_ids_are_not_ids_are_skipped_and_the_rest_indexed(tmp_path, caplog):
    """A shard that was valid xz and JSON, its first answer the served model's, but a later answer's
    ids strings, nulls, nested or past int64 (or its prompt_len a string) stopped the daemon's start
    with a traceback; an id past 2**31 made an index every later start refused and built again."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(
        store, "tiny", [[5, 6, 7, 8], [5, 6, "x"], [5, None], [[5], [6]], [5, 2**70], [5, 6, 2**32 + 7], [5, -1]]
    )
    with (store / "20261205-000000-abcd.jsonl.gz").open("ab") as raw, gzip.open(raw, "wt") as fh:
        fh.write(json.dumps({"key": "s", "job": "s", "stage": "answer", "messages": [], "tokens": [1, 5, 6, 9],
                             "prompt_len": "1", "model": "tiny"}) + "\n")  # fmt: skip
    with caplog.at_level("WARNING", logger="datastore"):
        served = datastore_for(str(store), "tiny", cache)
    assert served([4, 5, 6], 2).tokens == [7, 8] and len(served) == 3  # the one answer whose ids are ids
    assert "skipped 7 answers of tiny" in caplog.text
    assert index_for(str(store), "tiny", cache).load() is not None  # mapped at the next start, not built again


@pytest.mark.parametrize(
    "damage",
    ["0-d keys", "float positions", "2-d tokens", "wrong bits", "negative position", "keys reversed"],
)
def test_an_index_that_is_not_one_is_built_again(tmp_path, damage):
    """A 0-d keys file stopped the daemon's start (TypeError); float positions or 2-d tokens passed
    the check and every request then logged a traceback and drafted nothing; wrong bits served
    without a hit (an audit)."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    where = index_for(str(store), "tiny", cache).where
    datastore_for(str(store), "tiny", cache)
    keys, positions = np.load(where / "keys.npy"), np.load(where / "positions.npy")
    tokens = np.load(where / "tokens.npy")
    if damage == "0-d keys":
        np.save(where / "keys.npy", np.uint64(3))
    elif damage == "float positions":
        np.save(where / "positions.npy", positions.astype(np.float64))
    elif damage == "2-d tokens":
        np.save(where / "tokens.npy", np.stack([tokens, tokens]))
    elif damage == "keys reversed":
        np.save(where / "keys.npy", keys[::-1].copy())
    elif damage == "wrong bits":
        (where / "bits").write_text("5")
    else:
        np.save(where / "positions.npy", np.where(positions == positions.max(), -1, positions).astype(positions.dtype))
    assert index_for(str(store), "tiny", cache).load() is None and not where.exists()  # refused, removed
    where.mkdir()
    (where / "keys.npy").write_text("")  # an index whose removal stopped half way: in the rename's way
    served = datastore_for(str(store), "tiny", cache)
    assert served([4, 5, 6], 2).tokens == [7, 8] and np.array_equal(np.load(where / "keys.npy"), keys)


def test_an_index_is_its_owners_alone_and_a_stopped_build_leaves_nothing(tmp_path, monkeypatch):
    """The index of recorded traffic (users' answers) was readable by every local user, where the
    record folder is the operator's alone; a build stopped by Ctrl-C or SIGTERM (the builder's
    handler raises SystemExit) left its part behind for good, 58 MB here (an audit)."""
    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    datastore_for(str(store), "tiny", cache)
    (index,) = (cache / "datastore").iterdir()
    assert index.stat().st_mode & 0o777 == 0o700
    shutil.rmtree(index)
    save = Datastore.save

    def stopped(self, folder):
        save(self, folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(answer_index.Datastore, "save", stopped)
    with pytest.raises(KeyboardInterrupt):
        datastore_for(str(store), "tiny", cache)
    assert list((cache / "datastore").iterdir()) == []


def test_pruning_keeps_each_live_stores_indexes_and_removes_what_dead_builders_and_stores_left(tmp_path):
    """Pruning per model deleted another store's index of the same model as a growing store built
    new ones, and that store's daemon built it again at each start; a dead builder's part stayed."""
    cache = tmp_path / "cache"
    write_store(tmp_path / "traffic", "tiny", [[5, 6, 9]])
    assert datastore_for(str(tmp_path / "traffic"), "tiny", cache) is not None
    traffic = index_for(str(tmp_path / "traffic"), "tiny", cache).where
    old_format = cache / "datastore" / ("tiny-" + "0" * 16)
    shutil.copytree(traffic, old_format)
    (old_format / "source").unlink()  # built before indexes said their store
    dead = cache / "datastore" / f"tiny-{'1' * 16}.{2**22 + 1}.tmp"  # above any pid_max: no such process
    alive = cache / "datastore" / f"tiny-{'2' * 16}.{os.getpid()}.tmp"
    for part in (dead, alive):
        part.mkdir()
    long_ago(dead)
    store = tmp_path / "store"
    store.mkdir()
    for i in range(KEEP + 2):
        write_store(tmp_path / "shard", "tiny", [[5, 6, 7 + i]])
        (tmp_path / "shard" / "20261205-000000-abcd.jsonl.gz").rename(store / f"20261205-00000{i}-abcd.jsonl.gz")
        assert datastore_for(str(store), "tiny", cache)([4, 5, 6], 1).tokens == [7]
    left = {d.name for d in (cache / "datastore").iterdir()}
    assert traffic.name in left and old_format.name not in left and dead.name not in left and alive.name in left
    assert len(left) == 1 + KEEP + 1  # the traffic store's, the growing store's newest, the live part
    assert prune(cache / "datastore", "tiny", KEEP, str((tmp_path / "traffic").resolve())) == []
    # A store deleted (a clone of the repository, and its 500 MB index stayed for good: an audit):
    # its indexes go at the next build of another store's.
    shutil.rmtree(tmp_path / "traffic")
    assert prune(cache / "datastore", "tiny", KEEP, str(store.resolve())) == [traffic]


def test_a_daemon_serves_while_its_datastore_is_built_by_a_process_of_its_own(tmp_path):
    """datastore_coming: the index is built by another process (the committed store held every
    start after a shard changed 58 s, at 4.9 GB: an audit), then mapped; a later start maps it at
    once."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8]])
    coming = datastore_coming(str(store), "tiny", cache, vocab_size=320)
    served = coming.result(timeout=120)
    assert served([4, 5, 6], 2).tokens == [7, 8] and served.vocab_size == 320
    assert not [d for d in (cache / "datastore").iterdir() if d.suffix == ".tmp"]
    again = datastore_coming(str(store), "tiny", cache)
    assert again.done() and isinstance(again.result().keys, np.memmap)
    assert datastore_coming("none", "tiny", cache).result() is None


def test_a_failed_background_build_leaves_the_daemon_serving_without(tmp_path, caplog):
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    cache.mkdir()
    (cache / "datastore").write_text("a file where the indexes' folder goes")
    with caplog.at_level("ERROR", logger="datastore"):
        assert datastore_coming(str(store), "tiny", cache).result(timeout=120) is None
    assert "serving without it" in caplog.text


def test_a_build_the_disk_refuses_is_one_line_and_exit_1_from_either_command(tmp_path):
    """Where the index cannot be written, the daemon's builder printed a whole traceback into its
    log, and `python -m answers.index` (the demo's set-up) said nothing of it and exited 0 (an
    audit): each now logs one line and exits 1. The demo goes on without the index."""
    import subprocess
    import sys

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    cache.mkdir()
    (cache / "datastore").write_text("a file where the indexes' folder goes")
    build = [sys.executable, "-m", "answers.index", "--build", str(store), "tiny", str(cache)]
    builder = subprocess.Popen(build, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    builder.wait(120)  # its standard input open, as its daemon holds it
    builder.stdin.close()
    err = builder.stderr.read()
    assert builder.returncode == 1 and "Traceback" not in err and "could not build" in err, err
    env = {**os.environ, "DFLASH_SPLIT_CACHE": str(cache)}
    command = [sys.executable, "-m", "answers.index", "--datastore", str(store), "--model", "tiny"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "could not build" in done.stderr, done.stderr
    command[command.index(str(store))] = str(tmp_path / "nowhere")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "no such answer store folder" in done.stderr.splitlines()[-1], done.stderr


def test_a_builder_ends_with_the_process_that_started_it(tmp_path):
    """A daemon killed (SIGKILL, the OOM killer) left its builder running, and every restart
    started another: three at 2.6 GB each (a review). A builder reads its standard input, which
    its daemon holds open, and ends when the daemon does; here it is stuck reading a shard (a FIFO
    no one writes) when its parent dies."""
    import signal
    import subprocess
    import sys
    import time

    store = tmp_path / "store"
    store.mkdir()
    os.mkfifo(store / "20261205-000000-abcd.jsonl.xz")
    build = [sys.executable, "-m", "answers.index", "--build", str(store), "tiny", str(tmp_path / "cache")]
    starts = f"import subprocess, time; p = subprocess.Popen({build!r}, stdin=subprocess.PIPE)"
    starts += "; print(p.pid, flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", starts], stdout=subprocess.PIPE, text=True)
    builder = int(parent.stdout.readline())
    time.sleep(1)  # the builder is blocked on the FIFO by now, or soon
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while running(builder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(builder), "the builder outlived its daemon"


def test_a_builder_stopped_while_it_works_ends_without_a_fatal_error(tmp_path):
    """A daemon that stops stops its builder (SIGTERM): the builder's thread that waits on its
    standard input held the buffer's lock, and the interpreter died on the way out with "Fatal
    Python error: _enter_buffered_busy", a core-dump's abort (an audit)."""
    import signal
    import subprocess
    import sys
    import time

    store = tmp_path / "store"
    store.mkdir()
    fifo = store / "20261205-000000-abcd.jsonl.xz"
    os.mkfifo(fifo)  # the builder blocks reading it
    build = [sys.executable, "-m", "answers.index", "--build", str(store), "tiny", str(tmp_path / "cache")]
    builder = subprocess.Popen(build, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, writer = time.monotonic() + 120, None
    while writer is None and time.monotonic() < deadline and builder.poll() is None:
        try:  # opens once the builder has the FIFO open to read: started, handlers set, blocked
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.05)
    assert writer is not None, "the builder never opened its shard"
    builder.send_signal(signal.SIGTERM)
    builder.wait(60)  # its standard input stays open, as its daemon holds it while it stops it
    err = builder.stderr.read()
    builder.stdin.close()
    os.close(writer)
    assert builder.returncode == 1 and "Fatal Python error" not in err, err


def test_an_answer_stored_twice_is_indexed_once(tmp_path):
    """Two generators on one seed wrote 2,900 answers twice; readers keep the first copy, but the
    datastore counted both, doubling their votes (an audit)."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(tmp_path / "first", "tiny", [[5, 6, 7, 8]])
    write_store(store, "tiny", [[5, 6, 7, 8], [5, 6, 9]])  # keys k0, k1: k0 again, as the first shard's
    (tmp_path / "first" / "20261205-000000-abcd.jsonl.gz").rename(store / "20261204-000000-abcd.jsonl.gz")
    served = datastore_for(str(store), "tiny", cache)
    assert len(served) == 3 + 2 and served([4, 5, 6], 1).tokens in ([7], [9])


def test_a_builder_whose_stop_signal_never_reaches_its_handler_still_ends_with_its_daemon(tmp_path):
    """A SIGTERM whose C handler ran just before the main thread blocked opening a FIFO never
    reached its Python handler, and the builder outlived its daemon for good (seen once under
    load: the kernel's stack in fifo_open, the signal caught, nothing pending). Here its handler
    does nothing, as such a signal does: the builder ends all the same."""
    import subprocess
    import sys
    import time

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = (
        "import signal, threading; import answers.index as index; index.END_GRACE_S = 0.5; "
        "signal.signal(signal.SIGTERM, lambda *_: None); "
        "threading.Thread(target=index._end_with_parent, daemon=True).start(); "
        f"print('ready', flush=True); open({str(fifo)!r})"
    )
    builder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "ready"
        builder.stdin.close()  # its daemon ends
        began = time.monotonic()
        assert builder.wait(30) == 1 and time.monotonic() - began < 10
    finally:
        builder.kill()  # one that outlived it must not outlive the test too
        builder.wait()


def test_a_cache_that_cannot_take_the_index_costs_no_build(tmp_path, monkeypatch, caplog):
    """A cache folder the index cannot be written to (read-only, not a folder, another user's) was
    found out only after the whole store was read and indexed: 43 s and 3.0 GB for the committed
    store, at every start (an audit). The folder is tried first."""
    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    cache.mkdir()
    (cache / "datastore").write_text("a file where the indexes' folder goes")
    built = []
    monkeypatch.setattr(answer_index, "answer_tails", lambda *a: built.append(a) or iter(()))
    with caplog.at_level("ERROR", logger="datastore"):
        assert datastore_for(str(store), "tiny", cache) is None
    assert built == [] and "could not build" in caplog.text


def test_two_processes_building_one_index_build_it_once(tmp_path, monkeypatch):
    """Two daemons starting at once on one cache (a daemon and dflash-local) each built the same
    index, twice the memory (3.0 GB each for the committed store) and the CPU: the second now waits
    for the first's build and maps it."""
    import threading

    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    building, release, builds = threading.Event(), threading.Event(), []
    build = Datastore.build

    def slow(sequences):
        builds.append(threading.current_thread().name)
        building.set()
        assert release.wait(30)
        return build(sequences)

    monkeypatch.setattr(answer_index.Datastore, "build", slow)
    first = threading.Thread(target=datastore_for, args=(str(store), "tiny", cache), name="first")
    first.start()
    assert building.wait(30)
    served = []  # the second start, while the first builds: a lock of its own (flock), as another process's
    second = threading.Thread(target=lambda: served.append(datastore_for(str(store), "tiny", cache)), name="second")
    second.start()
    second.join(0.5)
    release.set()
    first.join(30)
    second.join(30)
    assert builds == ["first"] and served[0]([4, 5, 6], 2).tokens == [7, 8]


def test_a_store_written_while_its_index_is_built_has_that_index_served(tmp_path, monkeypatch):
    """A store written during the build (a generator's shard flushed each minute, a daemon recording
    into the store it serves) made the daemon look for the newer store's index when its builder
    ended, find none, and serve without the datastore for good, the build's minute and 3 GB spent
    for nothing (an audit): it maps what its builder built."""
    import sys

    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    write_store(tmp_path / "later", "tiny", [[5, 6, 9]])
    later = tmp_path / "later" / "20261205-000000-abcd.jsonl.gz"
    builds = answer_index.Index.command

    def then_a_shard(self):  # the builder, and a shard added as it ends
        then = f"os.rename({str(later)!r}, {str(store / '20261205-000001-abcd.jsonl.gz')!r})"
        return [
            sys.executable,
            "-c",
            f"import os, subprocess, sys; code = subprocess.call({builds(self)!r}); {then}; sys.exit(code)",
        ]

    monkeypatch.setattr(answer_index.Index, "command", then_a_shard)
    served = datastore_coming(str(store), "tiny", cache).result(timeout=120)
    assert not later.exists() and served is not None and served([4, 5, 6], 2).tokens == [7, 8]


def test_a_builder_killed_midway_leaves_nothing_past_the_next_build(tmp_path):
    """A builder SIGKILLed as it wrote (the OOM killer picks the largest process: a builder at 3.0
    GB) left its part, up to the whole index (576 MB for the committed store); the restart's build
    kept it, its writer gone for less than basics.files.QUIET_S, and no later start builds an
    unchanged store's index again: there for good (an audit). The build that holds the cache's lock
    knows no other is writing there."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    where = index_for(str(store), "tiny", cache).where
    killed = where.with_name(f"{where.name}.{2**22 + 1}.tmp")  # above any pid_max: no such process
    killed.mkdir(parents=True)
    (killed / "keys.npy").write_bytes(b"\x93NUMPY half")
    assert datastore_for(str(store), "tiny", cache)([4, 5, 6], 2).tokens == [7, 8]
    assert sorted(d.name for d in (cache / "datastore").iterdir()) == [where.name]


def test_a_store_that_cannot_be_listed_costs_the_datastore_not_the_daemon(tmp_path, monkeypatch, caplog):
    """A --datastore folder this user may not read (another operator's recorded traffic), or a shard
    removed as the daemon fingerprinted the store (a checkout, a pull), stopped the daemon's start
    with a traceback (PermissionError, FileNotFoundError from index_for): it serves without."""
    import answers.index as answer_index

    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, "tiny", [[5, 6, 7, 8]])
    (store / "20261205-000000-abcd.jsonl.gz").rename(store / "20261204-000000-abcd.jsonl.gz")
    write_store(store, "tiny", [[5, 6, 9]])
    first_model = answer_index.first_model

    def then_the_first_goes(shard):  # the last shard read: the first one removed meanwhile
        if shard.name.startswith("20261205"):
            (store / "20261204-000000-abcd.jsonl.gz").unlink()
        return first_model(shard)

    monkeypatch.setattr(answer_index, "first_model", then_the_first_goes)
    with caplog.at_level("ERROR", logger="datastore"):
        assert datastore_coming(str(store), "tiny", cache).result(timeout=60) is None
    monkeypatch.setattr(answer_index, "first_model", first_model)

    def refused(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(answer_index, "shard_paths", refused)
    with caplog.at_level("ERROR", logger="datastore"):
        assert datastore_coming(str(store), "tiny", cache).result(timeout=60) is None
        assert datastore_for(str(store), "tiny", cache) is None
    assert caplog.text.count("cannot read the answer store") == 3
