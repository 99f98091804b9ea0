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
    for width in range(1, 18):
        for start in range(0, 40 - width, 7):
            x = torch.cat([hidden[start : start + width], tie])
            want = dflash_kernels.argmax(engine.head(x)).tolist()
            assert engine.greedy(x[:width]) == want[:width]
            assert engine.greedy(x[width - 1 :]) == want[width - 1 :] and want[-1] == 40
    assert tiny_engine.greedy(torch.zeros(2, hidden.shape[1])) == [0, 0]  # all tie: the whole head, the first


def test_the_screen_serves_the_widths_it_was_measured_faster_for(tiny_engine, tmp_path, monkeypatch):
    """Measured once per machine and head (kept where the other measurements are), both ways in turns
    at every width; the screen then serves the widths from 1 up to the first it loses at."""
    engine = tiny_engine.engine
    monkeypatch.setattr(dflash_kernels, "load", lambda: tmp_path)
    assert 0 <= engine._screen_rows() <= 17
    (record,) = tmp_path.glob("screen-*.json")
    measured = json.loads(record.read_text())["seconds"]
    assert set(measured) == {f"{way}-{m}" for way in ("head", "screen") for m in range(1, 18)}
    assert engine.screen_rows == 17  # what it was before measuring
    seconds = {"head-1": 2.0, "screen-1": 1.0, "head-2": 2.0, "screen-2": 1.0, "head-3": 1.0, "screen-3": 2.0}
    seconds |= {"head-4": 2.0, "screen-4": 1.0}
    record.write_text(json.dumps({"seconds": seconds}))
    assert engine._screen_rows() == 2


def test_a_family_that_scales_or_caps_its_logits_keeps_the_whole_head(tiny_engine, monkeypatch):
    """After a cap, logits that differ may round to a tie whose first token only the whole head knows."""
    hidden, _ = tiny_engine.forward([5, 6, 7])
    monkeypatch.setattr(tiny_engine.engine, "greedy", lambda h: pytest.fail("the screen served a capped head"))
    monkeypatch.setattr(tiny_engine.config, "final_logit_softcapping", 0.5, raising=False)
    assert tiny_engine.greedy(hidden) == dflash_kernels.argmax(tiny_engine.logits(hidden)).tolist()
