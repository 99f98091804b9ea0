"""Tree verification: one target forward over many branches, the accepted one kept, output exact."""

import pytest
import torch
from helpers import OracleBackend, assert_lossless, columns_logits, greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposal import Proposal
from target_node.drafting.proposers import DFlashProposer, NoProposer
from target_node.drafting.tree import DraftTree

PROMPT = [5, 17, 42, 99, 3, 7]
MAX_NEW = 40


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param, seed=3)


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node:
        out.append(tree.tokens[node - 1])
        node = tree.parents[node - 1]
    return out[::-1]


def test_tree_attention_and_positions_equal_each_path_run_alone(target):
    logprobs = torch.log_softmax(torch.randn(5, target.vocab_size, generator=torch.Generator().manual_seed(0)) * 3, -1)
    tree = DraftTree.best_first(logprobs, budget=14, max_depth=5, branching=3)
    assert not tree.is_chain and max(tree.depths) >= 3
    target.reset()
    target.forward(PROMPT[:-1], taps=(0, 2))
    hidden, features = target.forward([PROMPT[-1], *tree.tokens], taps=(0, 2), parents=tree.parents)
    for node in range(1, len(tree) + 1):
        target.reset()
        alone, alone_features = target.forward(PROMPT + _path(tree, node), taps=(0, 2))
        torch.testing.assert_close(hidden[node], alone[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features[node], alone_features[-1], atol=1e-4, rtol=1e-4)


def test_keeping_a_branch_leaves_the_cache_of_plain_decoding(target):
    """After keeping a non-first branch, the next token sees exactly the committed context."""
    tree = DraftTree([11, 12, 13, 14], [0, 0, 2, 3], [1, 1, 2, 3], [0.4, 0.3, 0.2, 0.1])
    target.reset()
    target.forward(PROMPT[:-1])
    start = target.length
    target.forward([PROMPT[-1], *tree.tokens], parents=tree.parents)
    target.keep(start, [0, 2, 3])  # last_tok, then node 2 (12) and its child node 3 (13)
    assert target.length == start + 3
    after, _ = target.forward([21])
    target.reset()
    want, _ = target.forward(PROMPT + [12, 13, 21])
    torch.testing.assert_close(after[-1], want[-1], atol=1e-4, rtol=1e-4)


def test_accept_follows_the_targets_choices_through_any_branch():
    tree = DraftTree([11, 12, 13, 14, 15], [0, 0, 2, 2, 4], [1, 1, 2, 2, 3], [0.5] * 5)
    # choices[node] is the target's token after that node: 12 after the root, 14 after node 2, ...
    assert tree.accept([12, 0, 14, 0, 15, 0]) == [2, 4, 5]
    assert tree.accept([11, 99, 0, 0, 0, 0]) == [1]
    assert tree.accept([99, 0, 0, 0, 0, 0]) == []
    assert DraftTree.chain([4, 5, 6]).accept([4, 5, 7, 0]) == [1, 2]


def test_best_first_takes_the_likeliest_paths_and_stays_a_tree():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    tree = DraftTree.best_first(probs.log(), budget=5, max_depth=3, branching=3)
    # Path probabilities, best first: 0 (.6), 0-0 (.30), 1 (.3), 0-0-0 (.27), 0-1 (.24).
    assert tree.path_probs == pytest.approx([0.6, 0.3, 0.3, 0.27, 0.24])
    assert all(p < node for node, p in enumerate(tree.parents, start=1))  # parents come first
    assert tree.prefix(3).expected()[-1] == pytest.approx(1.2)
    assert DraftTree.best_first(probs.log(), budget=5, max_depth=3, branching=1).is_chain


class RankedOracle(DFlashProposer):
    """The real DFlash path (features, ring, projection), but the true next token is only the
    drafter's `rank`-th choice at every position: a chain would accept nothing."""

    def __init__(self, target, reference, block, rank):
        super().__init__(OracleBackend(target, reference, block, target_layer_ids=(0, 2)))
        self.reference, self.rank = reference, rank

    def propose(self, tokens, max_tokens):
        proposal = super().propose(tokens, max_tokens)
        if not proposal.tokens:
            return proposal
        logits = proposal.logits.clone()
        top = logits.topk(self.rank + 1, dim=-1).values[:, 0]
        for row in range(logits.shape[0]):
            true = self.reference[len(tokens) + row]
            decoys = [(true + 1 + i) % logits.shape[1] for i in range(self.rank)]
            for i, decoy in enumerate(decoys):  # decoys first, the true token right after them
                logits[row, decoy] = top[row] + 2.0 - i * 0.1
            logits[row, true] = top[row] + 1.5
        return Proposal(logits.argmax(-1).tolist(), logits, self.name)


@pytest.mark.parametrize("rank", [1, 2])
def test_a_correct_second_or_third_choice_is_accepted_through_the_tree(target, rank):
    want = greedy(target, PROMPT, MAX_NEW, stop_on_eos=False)
    proposer = RankedOracle(target, PROMPT + want + [0] * 16, block=6, rank=rank)
    chain = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False))
    assert chain.tokens == want and chain.stats.accepted == 0
    tree = generate(target, PROMPT, proposer, DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False, tree_nodes=24))
    assert tree.tokens == want
    assert tree.stats.accepted >= tree.stats.steps  # at least one non-first branch taken per step
    # The proposer's ring holds exactly what plain decoding would tap for every committed position.
    target.reset()
    _, plain = target.forward(PROMPT + want[:-1], taps=(0, 2))
    ring = proposer.drafting.ring
    torch.testing.assert_close(ring.read(0, ring.length), plain[: ring.length], atol=1e-4, rtol=1e-4)
    assert target.length == len(PROMPT) + MAX_NEW - 1


@pytest.mark.parametrize("nodes", [4, 16])
def test_tree_speculation_is_lossless_with_a_random_drafter(target, nodes):
    cfg = config_for_target(target.config, block_size=8, taps=3)
    proposer = DFlashProposer(LocalDraftBackend(random_drafter(cfg, seed=nodes)))
    for prompt in (PROMPT, [200, 11, 11, 11, 250, 12, 13]):
        result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, tree_nodes=nodes, adaptive=nodes == 16))
        assert_lossless(target, prompt, result.tokens, greedy(target, prompt, MAX_NEW))


def test_an_adversarial_drafter_costs_speed_never_output(target):
    """Confident, wrong, and wider than the block: every branch is a decoy."""

    class Adversary(NoProposer):
        def propose(self, tokens, max_tokens):
            logits = torch.full((6, target.vocab_size), -5.0)
            logits[:, (tokens[-1] * 7 + 3) % target.vocab_size] = 5.0
            logits[:, (tokens[-1] * 11 + 1) % target.vocab_size] = 4.5
            return Proposal(logits.argmax(-1).tolist(), logits, "adversary")

    want = greedy(target, PROMPT, MAX_NEW)
    result = generate(target, PROMPT, Adversary(), DecodeOptions(MAX_NEW, tree_nodes=12, adaptive=False))
    assert_lossless(target, PROMPT, result.tokens, want)
    assert result.stats.proposed >= 10 * result.stats.steps  # wide trees, all of them verified and refused


def test_a_tree_from_a_drafters_own_columns_is_the_tree_from_the_whole_vocabulary():
    proposal = columns_logits(5, 300, 40, seed=4)
    compact, columns, full = proposal.logits, proposal.columns, proposal.full_logits(300)
    want = DraftTree.best_first(torch.log_softmax(full, -1), budget=12, max_depth=5, branching=3)
    got = DraftTree.best_first(torch.log_softmax(compact, -1), budget=12, max_depth=5, branching=3, columns=columns)
    assert (got.tokens, got.parents, got.depths) == (want.tokens, want.parents, want.depths)
    assert got.path_probs == pytest.approx(want.path_probs, rel=1e-5)
    assert set(got.tokens) <= set(columns.tolist()) and not got.is_chain
