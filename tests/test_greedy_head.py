"""The bf16-screened head returns exactly the fp32 argmax, and its error bound holds."""

import torch

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
