"""Losslessness on the real SmolLM2-135M-Instruct (fp32), with a random drafter and n-gram lookup."""

import pytest
from helpers import assert_lossless, greedy

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.default_model import ensure_default_model
from target_node.proposers import DFlashProposer, LocalDraftBackend, NGramProposer
from target_node.speculative import generate
from target_node.target import TargetModel

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "List three facts about the moon.",
    "Explain what a hash map is in two sentences.",
]
MAX_NEW = 64


@pytest.fixture(scope="module")
def smollm():
    return TargetModel.load(ensure_default_model())


@pytest.fixture(scope="module")
def prompts(smollm):
    return [smollm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(smollm, prompts):
    return [greedy(smollm, p, MAX_NEW) for p in prompts]


def test_answers_are_coherent(smollm, prompts, references):
    text = smollm.tokenizer.decode(references[0], skip_special_tokens=True)
    assert "def " in text and "prime" in text.lower()


@pytest.mark.parametrize("kind", ["random-dflash", "ngram"])
def test_speculative_equals_greedy(smollm, prompts, references, kind):
    if kind == "ngram":
        proposer = NGramProposer()
    else:
        cfg = config_for_target(smollm.config, block_size=8, mask_token_id=0)
        proposer = DFlashProposer(LocalDraftBackend(random_drafter(cfg)))
    for prompt, want in zip(prompts, references, strict=True):
        result = generate(smollm, prompt, proposer, MAX_NEW)
        assert_lossless(smollm, prompt, result.tokens, want)
        assert result.stats.proposed > 0
