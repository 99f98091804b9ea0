"""Greedy heads that read less than the whole head return exactly its argmax: the bf16 screen of the
transformers path (its error bound holds), and the engine's int8 screen (bit for bit, ties included)."""

import json

import pytest
import torch

import dflash_kernels
from target_node.model.greedy_head import ScreenedArgmaxHead, U


def test_matches_full_fp32_argmax_on_many_rows():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 96, generator=g) * 0.05
    head = ScreenedArgmaxHead(weight)
    hidden = torch.randn(400, 96, generator=g) * 30
    assert head(hidden) == (hidden @ weight.T).argmax(-1).tolist()
    assert head.stats["candidates"] < 20 * head.stats["rows"]  # screening actually narrows


def test_close_competitors_are_decided_in_fp32():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=g)
    hidden = weight[7:8].clone() * 4
    for factor, winner in [(1 + 3e-4, 8), (1 - 3e-4, 7)]:
        # Tokens 7 and 8 differ by much less than bf16 can resolve.
        weight[8] = weight[7] * factor
        assert ScreenedArgmaxHead(weight)(hidden) == (hidden @ weight.T).argmax(-1).tolist() == [winner]


def test_bound_covers_the_screening_error():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(2000, 128, generator=g)
    hidden = torch.randn(50, 128, generator=g) * 10
    head = ScreenedArgmaxHead(weight)
    screened = (hidden.bfloat16() @ head.screen.T).float()
    exact = hidden.double() @ weight.double().T
    bound = head.delta * hidden.norm(dim=1, keepdim=True) * head.row_norm[None, :] + 2 * U * screened.abs()
    assert ((screened.double() - exact).abs() <= bound.double()).all()


def test_flat_rows_fall_back_to_a_full_fp32_row():
    weight = torch.ones(100, 16) + torch.randn(100, 16) * 1e-4
    head = ScreenedArgmaxHead(weight, max_candidates=10)
    hidden = torch.randn(3, 16)
    assert head(hidden) == (hidden @ weight.T).argmax(-1).tolist()
    assert head.stats["fallbacks"] == 3


# --- the engine's int8 screen (dflash_kernels.screen, Engine.greedy) ----------------------------------


@pytest.fixture
def screen_here():
    if not dflash_kernels.screen_available():
        pytest.skip("no AVX512-VNNI on this CPU (or no compiler)")


def screen_case(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A head whose N (not a multiple of 64) and K (not of 4) leave padding in every layout, with rows
    of every scale and with outlier channels, as final hidden states have."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(3000, 102, generator=g) * 0.05).to(dtype)
    rows = [torch.randn(m, 102, generator=g) * scale for m in (1, 3, 9) for scale in (1e-3, 1.0, 30.0, 1e3)]
    spiky = torch.randn(5, 102, generator=g)
    spiky[:, [3, 50, 77]] *= 40
    rows.append(spiky)
    rows.append(weight[[5, 2999]].float() * 20)  # rows pointing at a token: the peaked logits of real steps
    return weight, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_the_int8_screen_gives_the_whole_heads_argmax_and_keeps_few_tokens(screen_here, dtype, seed):
    """The argmax of the kernels' own logits in the head's dtype, from the tokens the screen kept; and
    the same where no row may keep any (`limit` 0: every row computes the whole head)."""
    weight, batches = screen_case(dtype, seed)
    screen, packed = dflash_kernels.pack_screen(weight), dflash_kernels.pack(weight)
    rows = weight.contiguous()
    for x in batches:
        want = dflash_kernels.argmax(dflash_kernels.linear(x, packed)).tolist()
        chosen, kept = dflash_kernels.screen_argmax(x, packed, rows, screen)
        assert chosen == want
        assert dflash_kernels.screen_argmax(x, packed, rows, screen, limit=0) == (want, kept)
        assert all(1 <= k < 100 for k in kept) or x.abs().max() < 1e-2  # tiny rows: every logit near 0


def test_the_screen_gives_up_where_a_row_is_not_finite_and_keeps_every_tie(screen_here):
    weight, _ = screen_case(torch.bfloat16, 0)
    screen, packed = dflash_kernels.pack_screen(weight), dflash_kernels.pack(weight)
    for bad in (float("nan"), float("inf"), 1e30):
        x = torch.randn(3, 102)
        x[1, 7] = bad
        assert dflash_kernels.screen_argmax(x, packed, weight, screen) is None
    flat = torch.zeros(2, 102)  # every logit 0: every token ties, and the first is the argmax
    assert dflash_kernels.screen_argmax(flat, packed, weight, screen) == ([0, 0], [3000, 3000])


@pytest.fixture
def two_paths(screen_here):
    if "amx" not in dflash_kernels.screen_paths():
        pytest.skip("no AMX int8 tiles here (or the OS grants none): the screen has one path")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_screen_on_amx_tiles_keeps_what_it_keeps_on_vnni(two_paths, dtype):
    """TDPBUSD and VPDPBUSD sum the same bytes exactly, so every bound, every kept token and every
    argmax is the same on both paths: 1 to 40 rows (two int8 parts each: one row tile, two, and more
    blocks of two), a K of whole tiles (128), rows of every scale, spiky ones, and one at a token."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(3000, 128, generator=g) * 0.05).to(dtype)
    screen, packed, rows = dflash_kernels.pack_screen(weight), dflash_kernels.pack(weight), weight.contiguous()
    for m in (1, 2, 7, 8, 9, 16, 17, 40):
        for scale in (1e-2, 1.0, 30.0):
            x = torch.randn(m, 128, generator=g) * scale
            x[:, [5, 90]] *= 30
            x[0] = weight[17].float() * 20
            got = {}
            for path in ("vnni", "amx"):
                assert dflash_kernels.use_screen_path(path)
                got[path] = dflash_kernels.screen_argmax(x, packed, rows, screen)
            assert got["amx"] == got["vnni"], (m, scale)
            assert got["amx"][0] == dflash_kernels.argmax(dflash_kernels.linear(x, packed)).tolist()


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny_engine(request):
    """A tiny target on the engine whose head rows 40 and 41 are the same: their logits always tie."""
    from target_node.model.target import TargetModel
    from target_node.model.tiny import tiny_target

    model = tiny_target("llama", seed=3, layers=2, dtype=request.param, engine=False).model
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[41] = head[40]
    target = TargetModel(model, engine="kernels")
    if target.engine.screened is None:
        pytest.skip("no AVX512-VNNI here: the engine computes the whole head")
    target.engine.screen_rows = 17  # every width, whatever this machine measured
    return target


def test_the_screened_greedy_is_the_whole_heads_argmax_ties_included(tiny_engine):
    """Through the screen and the kept tokens' own columns: the whole head's argmax at every width,
    and a tie to the first of the tied tokens, as the whole head's argmax breaks it."""
    engine = tiny_engine.engine
    g = torch.Generator().manual_seed(0)
    hidden, _ = tiny_engine.forward([int(t) for t in torch.randint(3, 200, (40,), generator=g)])
    tie = (tiny_engine.head.weight[40:41].float() * 50).repeat(2, 1)
    assert engine.head(tie)[0, 40] == engine.head(tie)[0, 41] == engine.head(tie).max()
    chosen = engine.screen_path
    for engine.screen_path in dflash_kernels.screen_paths():  # each path the screen can take here
        for width in range(1, 18):
            for start in range(0, 40 - width, 7):
                x = torch.cat([hidden[start : start + width], tie])
                want = dflash_kernels.argmax(engine.head(x)).tolist()
                assert engine.greedy(x[:width]) == want[:width]
                assert engine.greedy(x[width - 1 :]) == want[width - 1 :] and want[-1] == 40
        assert tiny_engine.greedy(torch.zeros(2, hidden.shape[1])) == [0, 0]  # all tie: the whole head, the first
    engine.screen_path = chosen


def test_the_screen_serves_the_widths_it_was_measured_faster_for(tiny_engine, tmp_path, monkeypatch):
    """Measured once per machine and head (kept where the other measurements are), the whole head and
    the screen on each of its paths in turns at every width; the screen then takes the path that serves
    the most widths, from 1 up to the first it loses at (of two serving as many, the faster)."""
    engine = tiny_engine.engine
    monkeypatch.setattr(dflash_kernels, "load", lambda: tmp_path)
    paths = dflash_kernels.screen_paths()
    assert 0 <= engine._screen_rows() <= 17 and engine.screen_path in paths
    (record,) = tmp_path.glob("screen-*.json")
    measured = json.loads(record.read_text())["seconds"]
    widths = range(1, 18)
    assert set(measured) == {f"head-{m}" for m in widths} | {f"screen-{p}-{m}" for p in paths for m in widths}
    assert engine.screen_rows == 17  # what it was before measuring

    # Two paths (whether or not this machine has AMX: the record is read, not measured): VNNI faster at
    # widths 1 and 2, AMX at 1 to 4, the head at 3 on VNNI.
    monkeypatch.setattr(dflash_kernels, "screen_paths", lambda: ["vnni", "amx"])
    head = {f"head-{m}": 2.0 for m in range(1, 6)}
    vnni = {"screen-vnni-1": 1.0, "screen-vnni-2": 1.0, "screen-vnni-3": 3.0, "screen-vnni-4": 1.0}
    amx = {f"screen-amx-{m}": 1.5 for m in range(1, 5)} | {"screen-amx-5": 2.5}
    named, threads = record.stem.rsplit("-", 1)  # ...-PATHS-NTHREADS: a speed choice, per thread count
    assert threads == f"{torch.get_num_threads()}threads"
    (tmp_path / f"{named.rsplit('-', len(paths))[0]}-vnni-amx-{threads}.json").write_text(
        json.dumps({"seconds": head | vnni | amx})
    )
    assert engine._screen_rows() == 4 and engine.screen_path == "amx"
    assert engine.screen_rows_by_path == {"vnni": 2, "amx": 4}


def test_a_family_that_scales_or_caps_its_logits_keeps_the_whole_head(tiny_engine, monkeypatch):
    """After a cap, logits that differ may round to a tie whose first token only the whole head knows."""
    hidden, _ = tiny_engine.forward([5, 6, 7])
    monkeypatch.setattr(tiny_engine.engine, "greedy", lambda h: pytest.fail("the screen served a capped head"))
    monkeypatch.setattr(tiny_engine.config, "final_logit_softcapping", 0.5, raising=False)
    assert tiny_engine.greedy(hidden) == dflash_kernels.argmax(tiny_engine.logits(hidden)).tolist()


def test_dflash_screen_keeps_one_path_and_refuses_others(screen_here, monkeypatch):
    """`DFLASH_SCREEN` (for measuring one path against the other) keeps VNNI alone; a name that is no
    path is refused, saying which are."""
    monkeypatch.setenv(dflash_kernels.SCREEN_PATH_ENV, "vnni")
    assert dflash_kernels.screen_paths() == ["vnni"]
    monkeypatch.setenv(dflash_kernels.SCREEN_PATH_ENV, "tiles")
    with pytest.raises(ValueError, match="amx"):
        dflash_kernels.screen_paths()
