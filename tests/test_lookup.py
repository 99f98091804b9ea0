"""The looked-up branch: the continuation of the context's tail found earlier in the context
(prompt lookup), verified as one more branch of every greedy tree, with or without a draft."""

import random
from dataclasses import replace

import pytest
from helpers import assert_lossless, greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.governor import Governor
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposal import Continuation
from target_node.drafting.proposers import PROMPT_LOOKUP, DFlashProposer, NoProposer, prompt_lookup
from target_node.drafting.tree import DraftTree

MAX_NEW = 40
# A prompt whose tail occurred before: lookup has a continuation from the first step.
REPEATING = [9, 30, 31, 32, 33, 34, 35, 36, 12, 30, 31, 32]


def reference_lookup(tokens, limit, max_ngram, min_ngram):
    """The definition, spelled out: the longest tail first, its latest earlier occurrence with a follow."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                follow = tokens[start + n : start + n + limit]
                if follow:
                    return follow
    return []


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_tail():
    # "1 2 3" occurred once before (at 0): its follow, though "2 3" occurred later (at 4).
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3) == [9, 2, 3]
    assert prompt_lookup([5, 6, 5, 7, 5], 2) == [7, 5]  # "5": the latest earlier one (at 2)
    assert prompt_lookup([1, 2, 3], 4) == [] and prompt_lookup([4], 4) == [] and prompt_lookup([4, 4], 0) == []
    # The context's lookup names its guess by the tail it matched; the governor prices each apart.
    assert PROMPT_LOOKUP([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3) == Continuation([9, 2, 3], kind="3-gram")
    assert PROMPT_LOOKUP([5, 6, 5, 7, 5], 2) == Continuation([7, 5], kind="1-gram")
    assert PROMPT_LOOKUP([1, 2, 3], 4) == Continuation([])
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 7, 50])) for _ in range(rng.randint(0, 30))]
        limit, longest = rng.randint(1, 9), rng.randint(1, 4)
        shortest = rng.randint(1, longest)
        assert prompt_lookup(tokens, limit, longest, shortest) == reference_lookup(tokens, limit, longest, shortest)


def test_a_grafted_path_shares_what_the_tree_holds_and_the_likeliest_come_first():
    tree = DraftTree([11, 12, 13], [0, 1, 2], [1, 2, 3], [0.5, 0.3, 0.1])  # a chain 11 12 13
    grafted = tree.graft([11, 14, 15], [0.6, 0.4, 0.2])
    # 11 is shared (now 0.6), 14 and 15 are new under it: ordered 11, 14, 12, 15, 13.
    assert grafted.tokens == [11, 14, 12, 15, 13]
    assert grafted.parents == [0, 1, 1, 2, 3]
    assert grafted.depths == [1, 2, 2, 3, 3]
    assert grafted.path_probs == [0.6, 0.4, 0.3, 0.2, 0.1]
    assert grafted.looked_up == {2: "lookup", 4: "lookup"}
    assert grafted.path(4) == [11, 14, 15] and grafted.path(5) == [11, 12, 13]
    # The target takes 11, then 14, then 15: only the looked-up branch holds it.
    assert grafted.accept([11, 14, 15, 99, 99, 99]) == [1, 2, 4]  # choices[node]: the token after it
    assert grafted.prefix(3).looked_up == {2: "lookup"} and grafted.prefix(1).looked_up == {}
    assert tree.graft([11, 12], [0.9, 0.8]).looked_up == {}  # nothing new: the same chain
    lookup_only = DraftTree([], [], [], []).graft([5, 6, 7], [0.5, 0.25, 0.125])
    assert lookup_only.is_chain and lookup_only.tokens == [5, 6, 7] and set(lookup_only.looked_up) == {1, 2, 3}
    # A second lookup's branch: its new nodes are its own; the ones it shares stay the first's.
    both = grafted.graft([11, 14, 16], [0.7, 0.5, 0.45], "datastore")
    assert both.path_probs[:3] == [0.7, 0.5, 0.45] and both.tokens[:3] == [11, 14, 16]
    assert both.looked_up == {2: "lookup", 3: "datastore", 5: "lookup"}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param, seed=3)


def proposers(target):
    cfg = config_for_target(target.config, block_size=8, taps=3)
    return {"none": NoProposer(), "dflash": DFlashProposer(LocalDraftBackend(random_drafter(cfg, seed=1)))}


@pytest.fixture(scope="module")
def plain(target):
    """Prompts and their plain continuations: the first is the one of a few whose continuation most
    often repeats earlier text (a random tiny target repeats itself now and then, as small models do)."""
    candidates = [[(s * 37 + i * 11) % 300 + 1 for i in range(6)] for s in range(6)]
    candidates += [p + p[:3] for p in candidates]
    runs = {tuple(p): greedy(target, p, MAX_NEW) for p in [*candidates, REPEATING]}

    def hits(prompt):  # how often the next token is the first of the lookup's continuation
        tokens = list(prompt) + runs[prompt]
        return sum(prompt_lookup(tokens[:k], 1) == [tokens[k]] for k in range(len(prompt), len(tokens)))

    best = max(map(tuple, candidates), key=hits)
    assert hits(best) >= 2
    return [(list(best), runs[best]), (REPEATING, runs[tuple(REPEATING)])]


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_looked_up_branch_changes_speed_never_output(target, plain, adaptive):
    for name, proposer in proposers(target).items():
        for i, (prompt, want) in enumerate(plain):
            options = DecodeOptions(MAX_NEW, tree_nodes=6, adaptive=adaptive, lookup=True)
            result = generate(target, prompt, proposer, options)
            assert_lossless(target, prompt, result.tokens, want)
            if i == 0 and not adaptive:  # verified every step: where it was right, it was taken
                assert result.stats.accepted >= 1, name
                if name == "none":
                    assert result.stats.accepted_by_source["lookup"] == result.stats.accepted >= 1


def test_no_lookup_in_chains_sampled_steps_or_when_switched_off(target):
    from protocol.sampling import SamplingParams

    off = [
        DecodeOptions(MAX_NEW, tree_nodes=0, adaptive=False),  # a chain: the drafter alone
        DecodeOptions(MAX_NEW, tree_nodes=6, adaptive=False, lookup=False),
        DecodeOptions(MAX_NEW, tree_nodes=6, adaptive=False, sampling=SamplingParams(0.8, seed=3)),
    ]
    for options in off:
        stats = generate(target, REPEATING, NoProposer(), replace(options, max_new_tokens=12)).stats
        assert stats.proposed == 0 and "lookup" not in stats.sources


def test_the_governor_calibrates_a_lookups_own_chances_by_how_often_they_came_out_right():
    """The datastore's vote shares run high: tokens it gives 0.6 that are right a third of the time
    come to be priced near a third, while its other tenths keep what they learned or, untaught, their
    own chance; paths multiply, and a token after a miss teaches nothing."""
    governor = Governor()
    assert governor.chance_reach([0.6, 0.5], "datastore") == pytest.approx([0.6, 0.3])  # untaught: as given
    for i in range(90):
        right = 5 if i % 3 == 0 else 6
        governor.learn_lookup([5, 8], [right, 8], "datastore", chances=[0.62, 0.95])
    first = governor.chance_reach([0.65], "datastore")[0]
    assert 0.25 < first < 0.42, first
    # 0.95 was tried only after a right first token (30 times), and was right each time.
    assert governor.chance_reach([0.9], "datastore")[0] > 0.95
    assert governor.chance_tries["datastore"][9] < governor.chance_tries["datastore"][6]
    assert governor.chance_reach([0.65, 0.9], "datastore")[1] == pytest.approx(
        first * governor.chance_reach([0.9], "datastore")[0]
    )
    assert governor.chance_reach([0.15], "datastore") == pytest.approx([0.15])
    assert governor.chance_reach([0.6], "another") == pytest.approx([0.6])  # each lookup its own
    assert governor.chance_reach([0.65], "datastore", "other") == pytest.approx([0.65])  # and each kind of guess
    # Without chances (the context's lookup) only the depth record learns.
    governor.learn_lookup([1], [1], "lookup")
    assert "lookup" not in governor.chance_tries


def test_the_governor_learns_how_deep_lookups_are_right_and_rates_plain_steps_by_tokens():
    governor = Governor()
    prior = governor.lookup_reach(3)
    assert prior == pytest.approx([0.5, 0.25, 0.125])
    for _ in range(40):
        governor.learn_lookup([1, 2, 3], [1, 2, 9, 4])  # right twice, then wrong
    reach = governor.lookup_reach(3)
    assert reach[0] > 0.9 and reach[1] > 0.85 and reach[2] < 0.1
    for _ in range(40):
        governor.learn_lookup([7, 8], [1])  # wrong at once; depth 2 is not even tried
    tries = governor.lookup_tries["lookup"]
    assert governor.lookup_reach(1)[0] < 0.4 and tries[2] < tries[1]
    # Each kind of a lookup's guesses learns on its own.
    assert governor.lookup_reach(1, "lookup", "3-gram") == pytest.approx([0.5])
    for _ in range(40):
        governor.learn_lookup([1], [1], "lookup", kind="3-gram")
    assert governor.lookup_reach(1, "lookup", "3-gram")[0] > 0.9 and governor.lookup_reach(1)[0] < 0.4
    # Each lookup learns on its own: the datastore's reach is still the prior.
    assert governor.lookup_reach(3, "datastore") == pytest.approx([0.5, 0.25, 0.125])
    # Steps the drafter sat out commit what their lookup won: the rate drafting must beat.
    governor.record(False, 3, 0.03)
    governor.record(False, 1, 0.01)
    assert governor.plain_rate() == pytest.approx(100.0)
