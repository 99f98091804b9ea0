"""The engine is batch-invariant by construction: every row of a forward has the bits of the plain
one-token step at its position with the same context, whatever rows run beside it.

Checked with `torch.equal`, never a tolerance, in every layer's output, the final hidden states
and the logits, for tiny models of every family the engine serves, in fp32 and bf16: chains of
width 1..17, random trees, prefill chunks of any size, and any thread count. Then the decoding
built on it: speculative output equals plain output exactly, with random, oracle and n-gram
drafters, chain and tree, in both dtypes.

The same checks run on the engine's torch ops (torch_ops.py, fixed row blocks: the path a GPU
takes), here on the CPU; `launch/gpu_run.sh` runs them on CUDA.
"""

import os
import random
from pathlib import Path

import pytest
import torch
from helpers import OracleBackend, greedy

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer
from target_node.drafting.tree import DraftTree
from target_node.engine.kv_cache import OVERHANG, StaticKVCache
from target_node.model.target import TargetModel
from target_node.model.tiny import ENGINE_FAMILIES, tiny_target

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTEXT = [5, 17, 42, 99, 3, 7, 11, 200, 13, 14, 15, 16, 30, 31, 32, 33, 40, 41, 9, 8]  # past the windows (8)
WIDEST = 17


DEVICE = os.environ.get("DFLASH_ENGINE_TEST_DEVICE", "cpu")  # gpu_run sets it: cuda or cuda:N
CASES = [(f, d, "kernels") for f in ENGINE_FAMILIES for d in DTYPES] if DEVICE == "cpu" else []
CASES += [("qwen3_sliding", d, "torch") for d in DTYPES]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(p))
def target(request, one_thread):
    family, dtype, ops = request.param
    target = tiny_target(family, seed=2, layers=3, dtype=DTYPES[dtype], engine=False)
    target = TargetModel(target.model.to(DEVICE), engine=ops)
    assert target.engine is not None and target.policy.name == "static"
    return target


def run(target, tokens, tree=None):
    """Every layer's output and the logits of each row: what must not depend on the batch."""
    layers = tuple(range(target.config.num_hidden_layers))
    hidden, features = target.forward(tokens, layers, None if tree is None else tree.parents)
    return torch.cat([features, hidden, target.logits(hidden)], -1)


def plain_rows(target, context, tokens):
    """Each token as its own one-token step after `context` and the tokens before it."""
    target.reset()
    target.forward(context)
    return torch.cat([run(target, [t]) for t in tokens])


def test_every_row_of_a_chain_of_any_width_is_the_plain_step(target):
    tokens = [(7 * i + 3) % 300 for i in range(WIDEST)]
    want = plain_rows(target, CONTEXT, tokens)
    for width in range(1, WIDEST + 1):
        target.rollback(len(CONTEXT))
        got = run(target, tokens[:width])
        for row in range(width):
            assert torch.equal(got[row], want[row]), f"width {width}, row {row}"


def random_tree(rng: random.Random, nodes: int) -> DraftTree:
    parents, depths, tokens = [], [], []
    for node in range(1, nodes + 1):
        parent = rng.randrange(node)  # any earlier node (0: the root)
        parents.append(parent)
        depths.append(1 + (depths[parent - 1] if parent else 0))
        tokens.append(rng.randrange(3, 300))
    return DraftTree(tokens, parents, depths, [1.0] * nodes)


@pytest.mark.parametrize("seed", range(6))
def test_every_node_of_a_random_tree_is_the_plain_step_along_its_path(target, seed):
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(2, WIDEST - 1))
    last = 77
    target.reset()
    target.forward(CONTEXT)
    got = run(target, [last, *tree.tokens], tree)
    for node in range(len(tree) + 1):
        path = [node]
        while path[-1]:
            path.append(tree.parents[path[-1] - 1])
        tokens = [last] + [tree.tokens[n - 1] for n in reversed(path[:-1])]
        assert torch.equal(got[node], plain_rows(target, CONTEXT, tokens)[-1]), f"node {node} of {tree}"


def test_kept_tree_rows_leave_the_cache_as_plain_decoding_of_the_path(target):
    tree = DraftTree([50, 60, 17, 70, 71], [0, 0, 2, 3, 3], [1, 1, 2, 3, 3], [1.0] * 5)
    target.reset()
    target.forward(CONTEXT)
    target.forward([77, *tree.tokens], (), tree.parents)
    target.keep(len(CONTEXT), [0, 2, 3, 5])  # root, 60, 17, 71
    after = run(target, [9])
    assert torch.equal(after, plain_rows(target, CONTEXT, [77, 60, 17, 71, 9])[-1:])


@pytest.mark.parametrize("chunk", [1, 3, 7, 20])
def test_a_prefill_in_chunks_of_any_size_gives_the_same_bits(target, chunk):
    target.reset()
    whole = run(target, CONTEXT)
    target.reset()
    parts = torch.cat([run(target, CONTEXT[i : i + chunk]) for i in range(0, len(CONTEXT), chunk)])
    assert torch.equal(parts, whole)


def test_a_long_prompt_in_chunks_grows_the_cache_once(target):
    """A new sequence reserves its prompt: growing copies every slot, so a long prompt's chunks
    must not pay it at each doubling they cross."""
    cache = target.engine.cache
    prompt = [random.Random(3).randrange(3, 200) for _ in range(3 * cache.capacity + 5)]
    allocated = []
    allocate = cache._allocate
    cache._allocate = lambda n: (allocated.append(n), allocate(n))
    try:
        chunked = greedy(target, prompt, 1, prefill_chunk=64, stop_on_eos=False)  # the prefill alone
    finally:
        del cache._allocate
    assert len(allocated) == 1 and allocated[0] >= len(prompt)
    assert chunked == greedy(target, prompt, 1, stop_on_eos=False)


def test_a_request_grows_the_cache_once_for_its_prompt_and_answer():
    """A new sequence reserved its prompt alone, so the first verify after it grew, and copied,
    every slot's cache (an audit: 1.7 s for that step after a 4,100-token prompt, 0.2 s without
    the growth); and the doubling ran past the model's positions (4,002 of 2,048)."""
    target = tiny_target("llama", seed=5, slots=2)
    cache, limit = target.engine.cache, target.max_positions
    allocated = []
    allocate = cache._allocate
    cache._allocate = lambda n: (allocated.append(n), allocate(n))
    rng = random.Random(4)
    try:
        prompt = [rng.randrange(3, 200) for _ in range(1100)]
        greedy(target, prompt, 40, stop_on_eos=False)
        assert allocated == [1100 + 40 + 1], allocated  # once, before the prompt: none after it
        prompt = [rng.randrange(3, 200) for _ in range(1500)]
        greedy(target, prompt, 40, stop_on_eos=False, prefill_chunk=64)
        assert allocated[1:] == [limit], allocated  # doubled, but not past the model's positions
    finally:
        del cache._allocate


def test_a_tree_at_the_end_of_the_context_gets_its_rows_past_the_model_s_positions():
    """A tree's rows lie past its deepest position: at the end of the context they need room the
    model's positions do not give, so the cache's doubling bound is not a wall."""
    target = tiny_target("llama", seed=5)
    limit = target.max_positions
    prompt = [random.Random(5).randrange(3, 200) for _ in range(limit - 6)]
    want = greedy(target, prompt, 6, stop_on_eos=False)
    drafter = random_drafter(config_for_target(target.config, block_size=8, taps=2), seed=3)
    result = generate(
        target,
        prompt,
        DFlashProposer(LocalDraftBackend(drafter, limit)),
        DecodeOptions(6, stop_on_eos=False, tree_nodes=16),
    )
    assert result.tokens == want
    assert target.engine.cache.capacity > limit  # the tree's rows were there


def test_room_past_the_model_s_positions_is_made_once_for_verifies_that_creep_further():
    """Near the end of the context a wide tree's rows lie past the model's positions, a few
    further at each step; room made only as far as each step asked copied every slot's whole
    cache at each step (an audit: four times 1.4 GB in four steps). Live entries survive."""
    cache = StaticKVCache(2, 1, 4, torch.float32, "cpu", slots=2, capacity=16, doubling_limit=64)
    cache.reserve(64)
    cache.kv[..., :60, :] = torch.arange(60.0).view(60, 1)
    cache.lengths = [60, 57]
    allocated = []
    allocate = cache._allocate
    cache._allocate = lambda n: (allocated.append(n), allocate(n))
    for start in range(47, 64, 3):  # a 17-row tree verified from each step's start
        cache.reserve(start + 17)
    assert allocated == [64 + OVERHANG]
    cache.reserve(64 + OVERHANG + 1)  # a wider tree still: the overhang doubles
    assert allocated == [64 + OVERHANG, 64 + 2 * OVERHANG]
    assert torch.equal(cache.kv[0, 1, 1, 0, :60, 0], torch.arange(60.0))


def test_no_row_reads_a_cache_entry_it_did_not_write(target):
    """Grown room is left uninitialised (cheap); poisoning the whole cache with NaN must not move a bit."""
    tree = DraftTree([60, 61, 17, 62, 71], [0, 0, 1, 1, 3], [1, 1, 2, 2, 3], [1.0] * 5)
    results = []
    for poison in (False, True):
        target.reset()
        if poison:
            target.engine.cache.kv.fill_(float("nan"))
        target.forward(CONTEXT[:7])
        chain = run(target, CONTEXT[7:])
        results.append(torch.cat([chain, run(target, [77, *tree.tokens], tree)]))
    assert not results[1].isnan().any()
    assert torch.equal(results[0], results[1])


def test_the_thread_count_does_not_change_a_bit(target):
    tokens = [11, 12, 13, 14, 15]
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        target.reset()
        target.forward(CONTEXT)
        results.append(run(target, tokens))
    torch.set_num_threads(1)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_the_engine_agrees_with_the_transformers_model_up_to_rounding(target):
    with torch.inference_mode():
        theirs = target.model(input_ids=torch.tensor([CONTEXT], device=target.device)).logits[0].float()
    target.reset()
    ours = target.logits(target.forward(CONTEXT)[0])
    share = 1e-4 if target.model.dtype == torch.float32 else 0.1  # transformers' bf16 rounds every op
    assert (ours - theirs).abs().max() <= share * theirs.abs().max()


# --- decoding on the engine: exact, not "lossless up to near-ties" ------------------------------------

PROMPTS = [[5, 17, 42, 99, 3, 7], [200, 11, 11, 11, 250, 12, 13, 14, 15, 16, 17, 18]]
MAX_NEW = 40


@pytest.mark.parametrize("tree_nodes", [0, 6, 16])
def test_speculative_output_is_plain_output_bit_for_bit(target, tree_nodes):
    drafter = random_drafter(config_for_target(target.config, block_size=8, taps=2), seed=tree_nodes)
    for prompt in PROMPTS:
        want = greedy(target, prompt, MAX_NEW, stop_on_eos=False)
        oracle = OracleBackend(target, prompt + want, 8, target_layer_ids=(0, 2))
        for proposer in (DFlashProposer(LocalDraftBackend(drafter)), DFlashProposer(oracle), NGramProposer()):
            result = generate(
                target,
                prompt,
                proposer,
                DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False, tree_nodes=tree_nodes),
            )
            assert result.tokens == want, (proposer, tree_nodes)
            assert result.stats.proposed > 0


def test_speculative_output_with_the_governor_is_plain_output(target):
    drafter = random_drafter(config_for_target(target.config, block_size=16, taps=2), seed=9)
    for prompt in PROMPTS:
        want = greedy(target, prompt, MAX_NEW, stop_on_eos=False)
        result = generate(
            target,
            prompt,
            DFlashProposer(LocalDraftBackend(drafter)),
            DecodeOptions(MAX_NEW, stop_on_eos=False, tree_nodes=8),
        )
        assert result.tokens == want


# --- the dtype `auto` picks: one choice per machine ---------------------------------------------------


def test_the_bf16_choice_is_measured_once_per_machine_and_then_read_back(tmp_path, monkeypatch):
    """Two processes that measured for themselves could pick different dtypes under a burst of load,
    and then two daemons give different outputs: the first measurement is kept and read back."""
    import dflash_kernels

    monkeypatch.setattr(dflash_kernels, "load", lambda: tmp_path)
    timings = iter([{"float32": 2.0, "bfloat16": 1.0}, {"float32": 1.0, "bfloat16": 2.0}])
    monkeypatch.setattr(dflash_kernels, "_one_row_seconds", lambda hidden, outputs: next(timings))
    measure = dflash_kernels.bf16_faster.__wrapped__  # past the per-process cache
    assert measure() is True
    assert measure() is True  # a slower second measurement would say False: it is not taken
    assert next(timings) == {"float32": 1.0, "bfloat16": 2.0}
    (tmp_path / "bf16_faster-1024x4096.json").write_text("not json")  # a damaged record is measured again
    monkeypatch.setattr(dflash_kernels, "_one_row_seconds", lambda hidden, outputs: {"float32": 1.0, "bfloat16": 2.0})
    assert measure() is False and measure() is False


# --- the bf16 matmul's path: AVX-512 BF16 or AMX tiles, one per machine --------------------------------


def bf16_paths() -> list[str]:
    """The bf16 paths this machine has (AMX only where the CPU has it and the OS grants it)."""
    import dflash_kernels

    dflash_kernels.load()
    chosen = torch.ops.dflash.linear_path(-1)
    try:
        return [p for p, n in dflash_kernels.BF16_PATHS.items() if torch.ops.dflash.linear_path(n) == n]
    finally:
        torch.ops.dflash.linear_path(chosen)


@pytest.mark.parametrize("path", ["avx512", "amx"])
def test_on_either_bf16_path_a_row_is_the_same_bits_in_any_batch(path, one_thread):
    """AMX computes 16 rows per instruction: a row among 16 (or 17, across two row tiles) must be the
    bits it is alone, for reductions of whole tiles (576) and of a tail the AVX-512 path takes (100)."""
    import dflash_kernels

    if path not in bf16_paths():
        pytest.skip(f"this CPU (or its OS) offers no {path}")
    chosen = torch.ops.dflash.linear_path(-1)
    torch.ops.dflash.linear_path(dflash_kernels.BF16_PATHS[path])
    try:
        gen = torch.Generator().manual_seed(3)
        for n, k in [(200, 576), (70, 100)]:
            w = dflash_kernels.pack((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
            x, bias = torch.randn(37, k, generator=gen), torch.randn(n, generator=gen)
            alone = torch.cat([dflash_kernels.linear(x[i : i + 1], w, bias) for i in range(37)])
            for width in (2, 9, 16, 17, 37):
                batched = torch.cat([dflash_kernels.linear(x[i : i + width], w, bias) for i in range(0, 37, width)])
                assert torch.equal(batched, alone), (path, n, k, width)
            want = x.to(torch.bfloat16).float() @ w_dense(w, k).T + bias
            torch.testing.assert_close(alone, want, rtol=1e-4, atol=1e-4)  # and they are the matmul
    finally:
        torch.ops.dflash.linear_path(chosen)


def test_a_matmul_of_no_rows_is_an_empty_result_in_either_dtype():
    """A call with no rows (an empty batch) returns nothing and does not fault: the row blocks
    that share the prefetching are counted from the rows, and zero rows are one empty block."""
    import dflash_kernels

    for dtype in (torch.float32, torch.bfloat16):
        w = dflash_kernels.pack(torch.randn(130, 96).to(dtype))
        out = dflash_kernels.linear(torch.empty(0, 96), w)
        assert out.shape == (0, 130)
        seven, one = dflash_kernels.linear(torch.ones(7, 96), w), dflash_kernels.linear(torch.ones(1, 96), w)
        assert torch.equal(seven[3], one[0])


def w_dense(packed, k: int) -> torch.Tensor:
    """The [N, K] fp32 matrix a packed bf16 one holds."""
    panels, pairs = packed.data.shape[:2]
    return packed.data.permute(0, 2, 1, 3).reshape(panels * 64, pairs * 2)[: packed.n, :k].float()


def test_the_bf16_path_is_measured_once_per_machine_and_can_be_forced(tmp_path, monkeypatch):
    """The paths round differently: the first measurement is kept, so every process on the machine
    computes the same bits; the environment forces one only for measuring them against each other."""
    import dflash_kernels

    if "amx" not in bf16_paths():
        pytest.skip("no AMX here: avx512 is the only path, nothing is measured")
    chosen = torch.ops.dflash.linear_path(-1)
    try:
        timings = iter([{"avx512": 2.0, "amx": 1.0}, {"avx512": 1.0, "amx": 2.0}])
        monkeypatch.setattr(dflash_kernels, "_path_seconds", lambda: next(timings))
        monkeypatch.delenv(dflash_kernels.BF16_MATMUL_ENV, raising=False)
        assert dflash_kernels.bf16_matmul(tmp_path) == "amx"
        assert dflash_kernels.bf16_matmul(tmp_path) == "amx"  # read back: the slower timing is not taken
        assert next(timings) == {"avx512": 1.0, "amx": 2.0}
        monkeypatch.setenv(dflash_kernels.BF16_MATMUL_ENV, "avx512")
        assert dflash_kernels.bf16_matmul(tmp_path) == "avx512"
        monkeypatch.setenv(dflash_kernels.BF16_MATMUL_ENV, "tiles")
        with pytest.raises(ValueError, match="use one of"):
            dflash_kernels.bf16_matmul(tmp_path)
    finally:
        torch.ops.dflash.linear_path(chosen)


@pytest.mark.parametrize(
    ("path", "flags", "named"),
    [
        ("avx512", "avx2 avx512f avx512_bf16", "avx512"),
        ("avx512", "x86-64-v3 -mavx2", "fma"),
        ("amx", "amx_bf16 avx512_bf16", "amx"),
    ],
)
def test_answers_name_the_instructions_of_their_bf16_matmuls(monkeypatch, path, flags, named):
    """A build without AVX512-BF16 (DFLASH_MARCH=x86-64-v3, or an AVX2 CPU) computes the "avx512"
    path with FMAs, whose subnormals differ: its answers' `made_by` must not say avx512."""
    import dflash_kernels

    monkeypatch.setattr(dflash_kernels, "bf16_matmul", lambda folder: path)
    monkeypatch.setattr(dflash_kernels.build, "cpu_flags", lambda: flags)
    assert dflash_kernels.bf16_numerics(Path("unused")) == named


def test_the_prefetch_level_is_measured_once_and_changes_no_bit(tmp_path, monkeypatch, one_thread):
    """Where fetched-ahead weights land (L1 or L2) is a speed choice, measured once per machine like
    the others; a matmul gives the same bits at either level, on every path the machine has."""
    import dflash_kernels

    timings = iter([{"L1": 2.0, "L2": 1.0}, {"L1": 1.0, "L2": 2.0}])
    first = dflash_kernels.measured_once(tmp_path, "prefetch-576x3072", lambda: next(timings))
    assert min(first, key=first.get) == "L2"
    assert dflash_kernels.measured_once(tmp_path, "prefetch-576x3072", lambda: next(timings)) == first
    chosen, level = torch.ops.dflash.linear_path(-1), torch.ops.dflash.prefetch_level(-1)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 576, generator=gen)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            w = dflash_kernels.pack(torch.randn(300, 576, generator=gen).to(dtype))
            for path in bf16_paths():
                torch.ops.dflash.linear_path(dflash_kernels.BF16_PATHS[path])
                outs = []
                for number in dflash_kernels.PREFETCH_LEVELS.values():
                    torch.ops.dflash.prefetch_level(number)
                    outs.append(dflash_kernels.linear(x, w))
                assert all(torch.equal(outs[0], out) for out in outs), (dtype, path)
    finally:
        torch.ops.dflash.linear_path(chosen)
        torch.ops.dflash.prefetch_level(level)


def test_the_kernels_argmax_is_torchs_argmax_ties_infinities_and_nans_included():
    """The greedy choice of every verify comes from the kernels' argmax: the same index as torch's,
    the first maximum, for rows of any length (whole vectors, tails, shorter than one), with ties,
    signed zeros, infinities and NaN (torch takes the first NaN), and strided rows."""
    import dflash_kernels

    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, generator=gen) for n in (1, 5, 16, 17, 33, 12488, 49152)]
    rows += [torch.randint(-3, 3, (n,), generator=gen).float() for n in (7, 40, 100)]  # many ties
    special = torch.zeros(9, 40)
    special[0, [5, 30]] = 1.0  # a tie: the first
    special[1] = -0.0
    special[1, 3] = 0.0  # -0.0 == 0.0: the first of either
    special[2] = float("-inf")
    special[3, [7, 20]] = torch.tensor([float("nan"), float("inf")])
    special[4, [35, 36]] = float("nan")
    special[5, 39] = float("inf")  # in a tail
    special[6, 17] = float("nan")  # a NaN after the maximum
    special[6, 2] = 5.0
    special[7] = torch.finfo(torch.float32).min
    special[8, 0] = float("inf")
    rows += list(special)
    for row in rows:
        want = row[None].argmax(-1)
        assert torch.equal(dflash_kernels.argmax(row[None]), want), row
    batch = torch.randn(8, 3000, generator=gen)
    assert torch.equal(dflash_kernels.argmax(batch), batch.argmax(-1))
    assert torch.equal(dflash_kernels.argmax(batch[:, ::2]), batch[:, ::2].argmax(-1))  # strided rows
    assert torch.equal(dflash_kernels.argmax(batch.double()), batch.double().argmax(-1))  # not fp32: torch's
    column = batch[:1, :7].T  # [7, 1], "contiguous" with stride(1) 7: the kernel refused it (an audit)
    assert torch.equal(dflash_kernels.argmax(column), column.argmax(-1))


def test_bench_paths_times_each_path_this_machine_has_in_turns(tmp_path, one_thread):
    """`benchmarks.bench_paths` on a saved tiny target: a row per path here, every width timed, and
    the process's own path left as it was chosen."""
    import json

    from benchmarks import bench_paths

    tiny_target(layers=2, engine=False).model.save_pretrained(tmp_path / "model")
    chosen = torch.ops.dflash.linear_path(-1)
    out = tmp_path / "paths.json"
    bench_paths.main(["--model", str(tmp_path / "model"), "--widths", "1,3", "--rounds", "1", "--json", str(out)])
    table = json.loads(out.read_text())["ms"]
    assert set(table) == set(bf16_paths()) and all(set(row) == {"1", "3"} for row in table.values())
    assert all(ms > 0 for row in table.values() for ms in row.values())
    assert torch.ops.dflash.linear_path(-1) == chosen


def test_the_engine_declines_a_device_it_has_not_run_on():
    """Its scratch buffers and row tables live on the CPU: on another device ("auto" ops) it must
    decline at load, so the transformers path serves, rather than fail at the first forward."""
    from target_node.engine.engine import Engine, ops_for
    from target_node.engine.weights import EngineUnsupported

    target = tiny_target(layers=2, engine=False)
    model = target.model.to("meta")
    with pytest.raises(EngineUnsupported, match="on CPU only"):
        Engine(model)
    # Asked for by name, the engine runs the device's ops there: torch's on a GPU, the kernels on a CPU.
    assert [ops_for(torch.device(d), "device") for d in ("cuda", "meta", "cpu")] == ["torch", "torch", "kernels"]
    assert ops_for(torch.device("cpu"), "auto") == "kernels" and ops_for(torch.device("cpu"), "torch") == "torch"


def test_every_tensor_the_engine_makes_is_placed_where_it_belongs():
    """On a GPU a tensor made without a device lands on the CPU: the first lease's failure at load.
    With the default device "meta", any such tensor is a meta tensor, and the forward or its
    values fail; so the engine on torch's ops must give the same bits with that default as without."""
    from target_node.engine.engine import Engine

    model = tiny_target(layers=2, engine=False).model

    def run() -> list[torch.Tensor]:
        engine = Engine(model, slots=2, ops="torch")
        engine.reset(0, 16)
        prompt = engine.step_batch([(0, CONTEXT[:10], None), (1, CONTEXT[3:9], None)], (0, 1))
        tree = engine.step(CONTEXT[10:14], (0, 1), parents=[0, 0, 1])
        return [t for hidden, taps in [*prompt, tree] for t in (hidden, taps)] + [engine.head(tree[0])]

    plain = run()
    with torch.device("meta"):
        placed = run()
    assert all(t.device.type == "cpu" for t in placed)
    assert all(torch.equal(a, b) for a, b in zip(plain, placed, strict=True))


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernels")
def test_the_rope_kernel_refuses_cos_and_sin_rows_narrower_than_a_head():
    """rope_store read each row's cos and sin head_dim apart without checking their width: a
    drafter with an odd head_dim (rows one narrower) read past their end (an audit)."""
    import dflash_kernels

    dflash_kernels.load()
    rows, heads, dim = 3, 2, 8
    qkv = torch.randn(rows, 3 * heads * dim)
    k, v = torch.empty(1, heads, rows, dim), torch.empty(1, heads, rows, dim)
    slots, index = torch.zeros(rows, dtype=torch.int32), torch.arange(rows, dtype=torch.int32)
    for width in (dim, dim - 2):
        cos, sin = torch.randn(rows, width), torch.randn(rows, width)
        if width == dim:
            torch.ops.dflash.rope_store(qkv.clone(), cos, sin, k, v, slots, index, heads, heads, None, None, 1e-6)
        else:
            with pytest.raises(RuntimeError, match="a cos and sin row of head_dim"):
                torch.ops.dflash.rope_store(qkv.clone(), cos, sin, k, v, slots, index, heads, heads, None, None, 1e-6)
