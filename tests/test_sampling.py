"""Sampling under speculation draws exactly from the target's distribution, whoever drafts.

Statistical checks use a chi-square goodness-of-fit test against exact probabilities. Cells
with an expected count under 5 are pooled (Cochran's rule), so the statistic is close to its
chi-square null distribution; the critical value is its upper ALPHA quantile by the
Wilson-Hilferty approximation (within a few percent of the exact quantile for dof >= 3).
With ALPHA = 1e-4 per check and about a dozen checks here, a correct implementation fails on
a fresh set of seeds with probability about 1e-3; the seeds are fixed, so runs are repeatable.
`test_the_checker_has_power` shows the same check rejects a plausibly wrong distribution.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache
from statistics import NormalDist

import pytest
import torch
from helpers import OracleBackend, greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from protocol.messages import MAX_PREDRAFT_OUTCOMES
from protocol.sampling import SamplingParams
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sampling import make_generator, probabilities, sample, verify_sampled
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposal import EMPTY, Proposal
from target_node.drafting.proposers import DFlashProposer, NGramProposer, NoProposer

ALPHA = 1e-4
VOCAB = 16
RUNS = 800  # generations per end-to-end check
# Every token occurs in the prompt, so the n-gram proposer always finds a continuation to guess.
PROMPT = [1, 4, 9, 2, 11, 6, 0, 13, 8, 3, 15, 5, 12, 7, 10, 14, 4, 9]


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the checker --------------------------------------------------------------------------------


def chi_square(counts: Counter, exact: dict[tuple, float], n: int) -> tuple[float, float]:
    """(statistic, critical value at ALPHA); outcomes the exact law gives probability 0 fail outright."""
    impossible = [outcome for outcome in counts if exact.get(outcome, 0.0) <= 0]
    assert not impossible, f"sampled outcomes the target gives probability 0: {impossible[:5]}"
    cells, pooled_p, pooled_n = [], 0.0, 0
    for outcome, prob in sorted(exact.items(), key=lambda item: -item[1]):
        if prob * n >= 5:
            cells.append([counts[outcome], prob * n])
        else:
            pooled_p, pooled_n = pooled_p + prob, pooled_n + counts[outcome]
    if pooled_p * n >= 5 or not cells:
        cells.append([pooled_n, pooled_p * n])
    else:  # too small to stand alone: fold it into the smallest kept cell
        cells[-1][0] += pooled_n
        cells[-1][1] += pooled_p * n
    statistic = sum((seen - want) ** 2 / want for seen, want in cells)
    return statistic, critical(len(cells) - 1)


def critical(dof: int) -> float:
    z = NormalDist().inv_cdf(1 - ALPHA)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_fits(counts: Counter, exact: dict[tuple, float], n: int, what: str) -> None:
    statistic, limit = chi_square(counts, exact, n)
    assert statistic < limit, f"{what}: chi-square {statistic:.1f} >= {limit:.1f}"


def window(joint: dict[tuple, float], start: int, stop: int) -> dict[tuple, float]:
    """Marginal law of tokens [start, stop) of a joint law."""
    out: dict[tuple, float] = Counter()
    for outcome, prob in joint.items():
        out[outcome[start:stop]] += prob
    return dict(out)


def test_the_checker_has_power(target):
    """It passes samples of the right law and fails the same samples against a slightly wrong one."""
    right = exact_joint(target, PROMPT, SamplingParams(temperature=1.0), 3)
    wrong = exact_joint(target, PROMPT, SamplingParams(temperature=0.8), 3)
    outcomes = list(right)
    n = RUNS
    draws = torch.multinomial(torch.tensor([right[o] for o in outcomes]), n, replacement=True, generator=gen(0))
    counts = Counter(outcomes[i] for i in draws.tolist())
    assert_fits(counts, right, n, "the true law")
    statistic, limit = chi_square(counts, wrong, n)
    assert statistic > limit, f"temperature 0.8 vs 1.0 went unnoticed: {statistic:.1f} < {limit:.1f}"


def gen(seed: int) -> torch.Generator:
    return make_generator(SamplingParams(temperature=1.0, seed=seed))


# --- options ------------------------------------------------------------------------------------


def test_params_validate_and_round_trip():
    params = SamplingParams(temperature=1, top_p=0.9, top_k=5, seed=7)
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_dict(None) == SamplingParams() and SamplingParams().is_greedy
    assert not params.is_greedy
    for bad, message in [
        (dict(temperature=-0.1), r"temperature must be in \[0, 2\]"),
        (dict(temperature=2.5), r"temperature must be in \[0, 2\]"),  # the front end's bound too
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed="7"), "seed must be an integer"),
        (dict(temp=1.0), "unknown sampling options"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict(bad)


def test_probabilities_apply_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    unchanged = probabilities(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(unchanged, logits.exp())
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    assert probabilities(logits, SamplingParams()).tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2[0], torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(top2[1], torch.tensor([0, 0, 0.375, 0.625]))
    # Nucleus: the smallest set reaching top_p, and never less than the top token.
    for top_p, kept in [(0.75, 2), (0.5, 1), (0.01, 1), (0.81, 3), (1.0, 4)]:
        probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert (probs[0] > 0).sum() == kept and (probs[1] > 0).sum() == kept, top_p
        assert torch.allclose(probs.sum(-1), torch.ones(2))
    # top_k=1 is greedy even on exact ties.
    tie = probabilities(torch.zeros(1, 5), SamplingParams(temperature=1.0, top_k=1))
    assert tie.sum() == 1 and tie.max() == 1


# --- the rejection rule on its own --------------------------------------------------------------


def random_law(rows: int, vocab: int, seed: int, spread: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=gen(seed)) * spread, -1)


def test_q_equal_to_p_accepts_everything():
    p = random_law(4, 6, seed=1)
    for seed in range(200):
        generator = gen(seed)
        drafts = sample(p[:3], generator).tolist()
        accepted, _ = verify_sampled(p, p[:3], drafts, generator)
        assert accepted == 3


def test_disjoint_supports_reject_and_resample_from_p():
    p = torch.tensor([[0.7, 0.3, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0, 0, 0.5, 0.5]])
    n = 4000
    counts = Counter()
    for seed in range(n):
        accepted, token = verify_sampled(p, q, [2 + seed % 2], gen(seed))
        assert accepted == 0
        counts[(token,)] += 1
    assert_fits(counts, {(0,): 0.7, (1,): 0.3}, n, "residual of disjoint q")


def test_one_hot_draft_accepts_with_p_and_resamples_without_it():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    n = 4000
    counts = Counter()
    for seed in range(n):
        accepted, token = verify_sampled(p, q, [1], gen(seed))
        counts[("kept", token) if accepted else ("replaced", token)] += 1
    # Kept with probability p(1) = 0.3, then the bonus comes from the next row; else p without token 1.
    exact = {("kept", t): 0.3 * float(p[1, t]) for t in range(3)}
    exact |= {("replaced", 0): 0.7 * 0.5 / 0.7, ("replaced", 2): 0.7 * 0.2 / 0.7}
    assert_fits(counts, exact, n, "one-hot draft")


def test_first_committed_token_follows_p():
    p, q = random_law(4, 5, seed=2), random_law(3, 5, seed=3)
    n = 6000
    counts = Counter()
    for seed in range(n):
        generator = gen(seed)
        drafts = sample(q, generator).tolist()
        accepted, token = verify_sampled(p, q, drafts, generator)
        counts[(drafts[0] if accepted else token,)] += 1
    assert_fits(counts, {(t,): float(p[0, t]) for t in range(5)}, n, "first token")


@cache
def toy_law(prefix: tuple[int, ...], salt: int, top_k: int = 0) -> torch.Tensor:
    """A fixed random next-token law per prefix: a stand-in model whose p depends on the drafts."""
    seed = salt * 7919 + sum((t + 1) * 5**i for i, t in enumerate(prefix))
    logits = torch.randn(4, generator=gen(seed)) * 2
    return probabilities(logits, SamplingParams(temperature=1.0, top_k=top_k))


def test_blocks_of_drafts_reproduce_the_joint_law():
    """The rule chained over blocks, with context-dependent p and q, gives the exact 3-token joint law."""
    length, k, n = 3, 2, 4000
    counts = Counter()
    for seed in range(n):
        generator, out = gen(seed), []
        while len(out) < length:
            q = torch.stack([toy_law(tuple(out) + (j,), salt=1) for j in range(k)])
            drafts = sample(q, generator).tolist()
            p = torch.stack([toy_law(tuple(out + drafts[:j]), salt=0, top_k=3) for j in range(k + 1)])
            accepted, token = verify_sampled(p, q, drafts, generator)
            out += drafts[:accepted] + [token]
        counts[tuple(out[:length])] += 1
    exact = {(): 1.0}
    for _ in range(length):
        exact = {s + (t,): pr * float(toy_law(s, salt=0, top_k=3)[t]) for s, pr in exact.items() for t in range(4)}
    assert_fits(counts, {s: pr for s, pr in exact.items() if pr > 0}, n, "toy joint")


# --- the whole loop on a tiny model -------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=0, layers=2, vocab=VOCAB)


def exact_joint(target, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """The target's own law of the next `length` tokens: products of processed conditionals, enumerated."""
    level = {(): 1.0}
    for _ in range(length):
        prefixes = list(level)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + list(s) for s in prefixes])).logits[:, -1]
        rows = probabilities(logits, params).tolist()
        level = {
            s + (t,): level[s] * pr for s, row in zip(prefixes, rows, strict=True) for t, pr in enumerate(row) if pr > 0
        }
    return level


class MirrorProposer(NoProposer):
    """A near-perfect drafter: the target's own logits along its greedy continuation.

    So q == p for the first draft and q is close to p after it (equal when the earlier drafts
    were the argmax): the mostly-accepting case, with a q that is a real distribution.
    """

    name = "mirror"

    def __init__(self, block: int) -> None:
        self.block = block

    def begin(self, target) -> None:
        self.target = target

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        path, rows = list(tokens), []
        with torch.inference_mode():
            for _ in range(min(self.block - 1, max_tokens)):
                rows.append(self.target.model(torch.tensor([path])).logits[0, -1].float())
                path.append(int(rows[-1].argmax()))
        return Proposal(path[len(tokens) :], torch.stack(rows), self.name) if rows else EMPTY


def proposer_for(kind: str, target, block: int):
    if kind in ("random", "dflash2", "predraft"):  # dflash2: the selector's chains, made q's first choices
        cfg = config_for_target(target.config, block_size=block, taps=2, dflash2=kind == "dflash2")
        # predraft: each verify's likely outcomes drafted ahead; a hit's drafts are the q verified against.
        outcomes = MAX_PREDRAFT_OUTCOMES if kind == "predraft" else 0
        return DFlashProposer(LocalDraftBackend(random_drafter(cfg, seed=1, std=0.2)), predraft=outcomes)
    if kind == "oracle":  # peaked q along the greedy path, so sampled drafts are often right
        path = PROMPT + greedy(target, PROMPT, 8, stop_on_eos=False)
        return DFlashProposer(OracleBackend(target, path, block, target_layer_ids=(0, 1)))
    if kind == "mirror":
        return MirrorProposer(block)
    return NGramProposer(max_draft=block - 1)


# Four tokens: a first plain one, then blocks of up to two drafts plus a bonus; both 3-token windows
# are checked, so acceptance, rejection at either draft and the bonus draw all count.
# The random drafters also get a hint that fixes the first draft of the first block (one-hot q)
# while the drafter samples the second (DFlash2: walking its selector's lattice from its own draw).
@pytest.mark.parametrize(
    "kind, params",
    [
        ("random", SamplingParams(temperature=1.0, top_p=0.9)),
        ("mirror", SamplingParams(temperature=1.2, top_k=6)),
        ("ngram", SamplingParams(temperature=1.5, top_p=0.8)),
        ("dflash2", SamplingParams(temperature=0.9, top_k=8)),
        ("predraft", SamplingParams(temperature=1.1, top_p=0.95)),
    ],
    ids=["random-top_p-hinted", "mirror-top_k", "ngram-hot", "dflash2-walk-hinted", "predraft-hits"],
)
def test_sampled_output_has_the_targets_law(target, kind, params):
    length, n = 4, RUNS
    proposer = proposer_for(kind, target, block=3)
    hints = greedy(target, PROMPT, 2, stop_on_eos=False) if kind in ("random", "dflash2") else None
    counts: list[Counter] = [Counter(), Counter()]
    proposed = accepted = 0
    for seed in range(n):
        sampling = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        result = generate(
            target, PROMPT, proposer, DecodeOptions(length, stop_on_eos=False, sampling=sampling, hint_tokens=hints)
        )
        assert len(result.tokens) == length
        counts[0][tuple(result.tokens[:3])] += 1
        counts[1][tuple(result.tokens[1:])] += 1
        proposed, accepted = proposed + result.stats.proposed, accepted + result.stats.accepted
    assert 0 < accepted < proposed, "both acceptance and rejection must be exercised"
    if kind == "predraft":
        assert proposer.backend.counters["predraft_hits"] > RUNS // 10, "pre-drafts must be verified often"
    joint = exact_joint(target, PROMPT, params, length)
    assert_fits(counts[0], window(joint, 0, 3), n, f"{kind} tokens 1-3")
    assert_fits(counts[1], window(joint, 1, 4), n, f"{kind} tokens 2-4")


# --- determinism and the greedy path ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "mirror", "ngram", "dflash2"])
def test_seeds_reproduce_exactly(target, kind):
    def run(seed):
        sampling = SamplingParams(temperature=1.2, top_p=0.95, seed=seed)
        result = generate(
            target, PROMPT, proposer_for(kind, target, 4), DecodeOptions(24, stop_on_eos=False, sampling=sampling)
        )
        return result.tokens, result.stats.histogram

    first = run(11)
    assert run(11) == first
    assert run(12)[0] != first[0]


@pytest.mark.parametrize("kind", ["none", "random"])
def test_a_seeded_request_with_hints_replays_whatever_the_pace_measured(target, kind):
    """Each hint a sampled step verifies draws a coin, and the hints a step took were the pace's,
    sized from measured forward times and from who else waits: a seeded request with hints gave
    another answer at another pace (an audit: 17 of 40 seeds at 16 vs 64 rows)."""
    from target_node.decoding.pace import PrefillPace
    from target_node.decoding.sequence import Sequence, step

    hints = greedy(target, PROMPT, 40, stop_on_eos=False)

    def paced(seed: int, rows: int) -> list[int]:
        pace = PrefillPace(budget_s=0.05, most=1 << 20)
        pace.rows_per_s, pace.last = rows / 0.05, rows
        pace.record = lambda *args: None  # the measured rate held at `rows` a forward
        sampling = SamplingParams(temperature=0.2, seed=seed)
        options = DecodeOptions(60, stop_on_eos=False, sampling=sampling, hint_tokens=hints)
        sequence = Sequence(target, PROMPT, proposer_for(kind, target, 4), options)
        while not sequence.done:
            step(target, [sequence], pace, waiting=True)
        return sequence.output.tokens

    for seed in range(8):
        assert paced(seed, 16) == paced(seed, 64), seed


@pytest.mark.parametrize("kind", ["random", "oracle", "mirror", "ngram", "dflash2", "none"])
def test_top_k_one_is_greedy(target, kind):
    """With all mass on the argmax, sampling must retrace greedy decoding, drafts and all."""
    want = greedy(target, PROMPT, 20, stop_on_eos=False)
    proposer = NoProposer() if kind == "none" else proposer_for(kind, target, 4)
    sampling = SamplingParams(temperature=0.7, top_k=1, seed=3)
    assert generate(target, PROMPT, proposer, DecodeOptions(20, stop_on_eos=False, sampling=sampling)).tokens == want


def test_temperature_zero_is_the_greedy_path(target):
    proposer = proposer_for("random", target, 4)
    # adaptive=False: the governor's choices follow wall-clock timings, so two runs may draft differently.
    plain = generate(target, PROMPT, proposer, DecodeOptions(20, stop_on_eos=False, adaptive=False))
    zero = generate(
        target, PROMPT, proposer, DecodeOptions(20, stop_on_eos=False, sampling=SamplingParams(seed=5), adaptive=False)
    )
    assert zero.tokens == plain.tokens
    assert zero.stats.histogram == plain.stats.histogram
