"""The loop's corners: budgets, EOS, stop strings, hints, one-token prompts, rollback."""

import pytest
from helpers import OracleBackend, greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer
from target_node.drafting.tree import DraftTree

PROMPT = [5, 17, 42, 99, 3, 7]
BLOCK = 8


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


@pytest.fixture(scope="module")
def reference(target):
    return greedy(target, PROMPT, 60, stop_on_eos=False)


def oracle(target, reference, prompt=PROMPT):
    return DFlashProposer(OracleBackend(target, prompt + reference, BLOCK))


class CharTokenizer:
    """Stands in for a tokenizer in the stop-string tests: token i decodes to one letter."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_a_chain_accepts_its_drafts_up_to_the_first_the_target_disagrees_with():
    def accepted(drafts, choices):
        return len(DraftTree.chain(drafts).accept(choices))

    assert accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted([1, 9, 3], [1, 2, 3, 4]) == 1
    assert accepted([9], [1, 2]) == 0
    assert accepted([], [1]) == 0


@pytest.mark.parametrize("budget", [1, 2, BLOCK - 1, BLOCK, BLOCK + 1])
def test_budget_is_never_exceeded(target, reference, budget):
    for proposer in (oracle(target, reference), NGramProposer(), NoProposer()):
        result = generate(target, PROMPT, proposer, DecodeOptions(budget, stop_on_eos=False))
        assert result.tokens == reference[:budget]
        assert result.finish_reason == "length"


def test_eos_inside_an_accepted_prefix_stops_there(target, reference):
    # Make a token in the middle of the oracle's first full block the EOS token.
    eos = reference[4]
    first = reference.index(eos)
    target.eos_ids = frozenset({eos})
    try:
        result = generate(target, PROMPT, oracle(target, reference), DecodeOptions(60))
    finally:
        target.eos_ids = frozenset({target.config.eos_token_id})
    assert result.tokens == reference[: first + 1]
    assert result.finish_reason == "eos"
    assert result.stats.accepted >= first - 1  # it came inside a block, not as a bonus token


def test_stop_string_spanning_two_steps(target, reference):
    tok = CharTokenizer()
    text = tok.decode(reference)
    # A stop string that straddles the first step boundary: the oracle commits BLOCK tokens
    # in the first decode step, after the one from the prefill.
    boundary = 1 + BLOCK
    stop = text[boundary - 2 : boundary + 2]
    cut = text.find(stop)
    target.tokenizer = tok
    pieces = []
    try:
        result = generate(
            target,
            PROMPT,
            oracle(target, reference),
            DecodeOptions(60, stop_strings=(stop,), stop_on_eos=False),
            on_commit=lambda toks, t: pieces.append(t),
        )
    finally:
        target.tokenizer = None
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert "".join(pieces) == text[:cut]
    assert stop not in "".join(pieces)
    assert result.tokens == reference[: cut + len(stop)]


def test_a_stop_string_in_a_step_of_many_hints_decodes_a_few_tokens_per_token(target, reference):
    """A step that verified 50 hints decoded the whole answer once per committed token to find
    where a stop string ends (512 hints: 512 decodes of a 4,000-token answer, on the thread every
    request shares). The text is now built token by token from decodes of a short window: the
    tokens decoded grow with the answer, not with its square; the cut is where plain decoding,
    one token a step, puts it."""

    class Counting(CharTokenizer):
        decoded = 0

        def decode(self, tokens, skip_special_tokens=True):
            Counting.decoded += len(tokens)
            return super().decode(tokens, skip_special_tokens)

    text = CharTokenizer().decode(reference)
    stop = text[40:43]
    cut = text.find(stop)
    assert cut > 8  # the stop string completes inside the step of hints, not in the prefill's token
    target.tokenizer = Counting()
    try:
        options = DecodeOptions(60, hint_tokens=reference[:60], stop_strings=(stop,), stop_on_eos=False)
        result = generate(target, PROMPT, NoProposer(), options)
    finally:
        target.tokenizer = None
    assert result.finish_reason == "stop" and result.text == text[:cut]
    assert result.tokens == reference[: cut + len(stop)]
    assert result.stats.steps <= 3 and Counting.decoded <= 4 * len(result.tokens) + 16, Counting.decoded


@pytest.mark.parametrize("ending", ["stop", "eos"])
@pytest.mark.parametrize("drafts", ["hints", "oracle"])
def test_stats_count_the_tokens_the_answer_kept(target, reference, ending, drafts):
    """A step verifies a block; a stop string or EOS inside it ends the answer there. The stats
    counted the whole block: a stop met in a step of 62 verified hints reported tau 63 for a
    24-token answer (an audit). They count what the answer kept: tau is its tokens per step."""
    end = 13  # inside the first verified block, past the prefill's token
    options = {"stop_on_eos": False}
    if ending == "stop":
        text = CharTokenizer().decode(reference)
        stop = text[end - 2 : end + 1]
        options["stop_strings"] = (stop,)
        kept = text.find(stop) + len(stop)
    else:
        target.eos_ids, options["stop_on_eos"] = frozenset({reference[end]}), True
        kept = reference.index(reference[end]) + 1
    hints = reference[:40] if drafts == "hints" else ()
    proposer = NoProposer() if drafts == "hints" else oracle(target, reference)
    target.tokenizer = CharTokenizer()
    try:
        result = generate(target, PROMPT, proposer, DecodeOptions(40, hint_tokens=hints, **options))
    finally:
        target.tokenizer, target.eos_ids = None, frozenset({target.config.eos_token_id})
    stats = result.stats
    assert result.finish_reason == ending and result.tokens == reference[:kept]
    assert stats.accepted + stats.steps == len(result.tokens) - 1 == stats.decode_tokens
    assert stats.tau == stats.decode_tokens / stats.steps
    assert sum(stats.histogram.values()) == stats.steps - stats.plain_steps
    assert sum(accepted * steps for accepted, steps in stats.histogram.items()) == stats.accepted


@pytest.mark.parametrize("right", [True, False])
def test_hint_tokens_are_verified(target, reference, right):
    hints = list(reference[:20]) if right else [(t + 1) % target.vocab_size for t in reference[:20]]
    result = generate(target, PROMPT, NoProposer(), DecodeOptions(30, hint_tokens=hints, stop_on_eos=False))
    assert result.tokens == reference[:30]
    if right:
        assert result.stats.accepted == 19 and result.stats.steps < 12
    else:
        assert result.stats.accepted == 0


def test_a_step_verifies_at_most_a_prompt_chunk_of_hints(target, reference):
    """Without a pace, --prefill-chunk caps the hints a forward verifies as it caps a prompt's rows."""
    options = DecodeOptions(30, hint_tokens=reference[:30], stop_on_eos=False, prefill_chunk=4)
    result = generate(target, PROMPT, NoProposer(), options)
    assert result.tokens == reference[:30]
    assert result.stats.steps == 6 and result.stats.accepted == 23  # 29 tokens after the first: 4 hints + 1 a step


def test_hints_override_a_wrong_drafter(target, reference):
    cfg = config_for_target(target.config, block_size=BLOCK, taps=2)
    proposer = DFlashProposer(LocalDraftBackend(random_drafter(cfg)))
    result = generate(target, PROMPT, proposer, DecodeOptions(30, hint_tokens=reference[:30], stop_on_eos=False))
    assert result.tokens == reference[:30]
    assert result.stats.accepted >= 25


def test_prompt_of_one_token(target):
    want = greedy(target, [7], 25, stop_on_eos=False)
    for proposer in (
        NGramProposer(),
        DFlashProposer(LocalDraftBackend(random_drafter(config_for_target(target.config)))),
    ):
        assert generate(target, [7], proposer, DecodeOptions(25, stop_on_eos=False)).tokens == want


def test_rollback_after_full_and_zero_acceptance(target, reference):
    result = generate(target, PROMPT, oracle(target, reference), DecodeOptions(30, stop_on_eos=False, adaptive=False))
    assert result.stats.histogram[BLOCK - 1] >= 2  # full acceptance
    assert target.length == len(PROMPT) + 30 - 1  # the last token is never run
    wrong = DFlashProposer(OracleBackend(target, PROMPT + [(t + 1) % 300 for t in reference], BLOCK))
    result = generate(target, PROMPT, wrong, DecodeOptions(30, stop_on_eos=False, adaptive=False))
    assert result.tokens == reference[:30]
    assert result.stats.accepted == 0
    assert result.stats.histogram[0] == result.stats.steps - result.stats.plain_steps
    assert target.length == len(PROMPT) + 30 - 1


def test_cancellation_stops_generation(target):
    import threading

    cancel = threading.Event()
    seen = []

    def on_commit(tokens, text):
        seen.extend(tokens)
        if len(seen) >= 5:
            cancel.set()

    result = generate(target, PROMPT, NoProposer(), DecodeOptions(50), on_commit=on_commit, cancel=cancel)
    assert result.finish_reason == "cancelled"
    assert len(result.tokens) == 5


def test_bad_requests_are_refused(target):
    with pytest.raises(ValueError, match="at least one token"):
        generate(target, [], NoProposer(), DecodeOptions(5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, PROMPT, NoProposer(), DecodeOptions(0))
    cfg = config_for_target(target.config, mask_token_id=10_000)
    with pytest.raises(ValueError, match="outside the target's embedding table"):
        generate(target, PROMPT, DFlashProposer(LocalDraftBackend(random_drafter(cfg))), DecodeOptions(5))
