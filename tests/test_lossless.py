"""Speculative output == the target's own greedy output, token for token, whoever drafts."""

import pytest
import torch
from helpers import OracleBackend, assert_lossless, greedy, tiny_target
from transformers import LlamaForCausalLM

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer

MAX_NEW = 40
PROMPTS = [[5, 17, 42, 99, 3, 7], [200, 11, 11, 11, 250, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module", params=[("llama", 0), ("qwen3", 1), ("llama", 2)], ids=lambda p: f"{p[0]}-{p[1]}")
def target(request):
    return tiny_target(*request.param)


def test_plain_loop_matches_transformers_generate(target):
    prompt = PROMPTS[0]
    with torch.inference_mode():
        ref = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert_lossless(target, prompt, greedy(target, prompt, MAX_NEW, stop_on_eos=False), ref)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_random_drafter_is_lossless(target, block_size):
    cfg = config_for_target(target.config, block_size=block_size, taps=3)
    proposer = DFlashProposer(LocalDraftBackend(random_drafter(cfg, seed=block_size)))
    for prompt in PROMPTS:
        want = greedy(target, prompt, MAX_NEW)
        result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW))
        assert_lossless(target, prompt, result.tokens, want)
        assert result.stats.proposed > 0


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_oracle_drafter_accepts_nearly_everything(target, block_size):
    for prompt in PROMPTS:
        want = greedy(target, prompt, MAX_NEW, stop_on_eos=False)
        oracle = OracleBackend(target, prompt + want, block_size, target_layer_ids=(0, 2))
        # adaptive=False: this test counts steps, so no plain-step measurements may interleave.
        result = generate(
            target, prompt, DFlashProposer(oracle), DecodeOptions(MAX_NEW, stop_on_eos=False, adaptive=False)
        )
        assert result.tokens == want
        assert result.stats.accepted == result.stats.proposed
        # Every step but the budget-limited last one commits a full block.
        assert result.stats.steps == -(-(MAX_NEW - 1) // block_size)
        assert result.stats.tau >= 0.75 * block_size


@pytest.mark.parametrize("max_draft", [1, 3, 8, 15])
def test_ngram_proposer_is_lossless(target, max_draft):
    for prompt in PROMPTS:
        want = greedy(target, prompt, MAX_NEW)
        result = generate(target, prompt, NGramProposer(max_draft=max_draft), DecodeOptions(MAX_NEW))
        assert_lossless(target, prompt, result.tokens, want)


def test_the_near_tie_check_catches_a_real_divergence(target):
    """The tolerance helper must not wave through an ordinary mismatch."""
    prompt = PROMPTS[0]
    want = greedy(target, prompt, 8)
    wrong = list(want)
    wrong[3] = (wrong[3] + 1) % target.vocab_size
    with pytest.raises(AssertionError, match="top-2 gap"):
        assert_lossless(target, prompt, wrong, want)


def test_models_are_fp32_and_tiny(target):
    assert isinstance(target.model, LlamaForCausalLM) or "Qwen3" in type(target.model).__name__
    assert target.model.dtype == torch.float32


def test_draft_vocabulary_restricts_proposals_and_stays_lossless(target):
    cfg = config_for_target(target.config, block_size=8, taps=2)
    drafter = random_drafter(cfg, seed=5)
    drafter.draft_vocab = list(range(0, target.vocab_size, 3))
    proposer = DFlashProposer(LocalDraftBackend(drafter))
    seen = []
    for prompt in PROMPTS:
        result = generate(target, prompt, proposer, DecodeOptions(MAX_NEW, adaptive=False))
        assert_lossless(target, prompt, result.tokens, greedy(target, prompt, MAX_NEW))
        logits = proposer.drafting.project(torch.randn(4, target.hidden_size))
        seen.extend(logits.argmax(-1).tolist())
        assert torch.isinf(logits[:, 1]).all() and torch.isfinite(logits[:, 3]).all()
    assert all(t % 3 == 0 for t in seen)


def test_guesses_over_a_drafters_own_columns_are_the_argmaxes_over_the_whole_vocabulary(target):
    cfg = config_for_target(target.config, block_size=8, taps=2)
    drafter = random_drafter(cfg, seed=6)
    vocab = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[: target.vocab_size // 4]
    drafter.draft_vocab = vocab.tolist()  # a vocabulary comes most frequent first, not in id order
    proposer = DFlashProposer(LocalDraftBackend(drafter))
    generate(target, PROMPTS[0], proposer, DecodeOptions(4, adaptive=False))  # the request attaches the drafter
    hidden = torch.randn(6, target.hidden_size)
    proposal = proposer.drafting.guesses(hidden, None, 0)
    full = proposer.drafting.project(hidden)
    assert proposal.tokens == full.argmax(-1).tolist()
    assert tuple(proposal.logits.shape) == (6, len(vocab)) and proposal.columns.tolist() == sorted(vocab.tolist())
    assert torch.equal(proposal.full_logits(target.vocab_size), full)
