"""The governor turns speculation off while it costs more than it brings, and probes again."""

import random
import time

import pytest
import torch
from helpers import greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.decoding.governor import Governor, VerifyCosts
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import generate
from target_node.drafting.local_backend import LocalDraftBackend
from target_node.drafting.proposers import DFlashProposer
from target_node.drafting.tree import DraftTree


def run(governor, steps, spec_tokens, spec_s, plain_s=0.010):
    kinds = []
    for _ in range(steps):
        drafting = governor.should_draft()
        kinds.append(drafting)
        governor.record(drafting, spec_tokens if drafting else 1, spec_s if drafting else plain_s)
    return kinds


def test_useless_drafter_is_switched_off_and_probed_with_backoff():
    gov = Governor()
    kinds = run(gov, 300, spec_tokens=1, spec_s=0.020)
    assert sum(kinds) < 0.1 * len(kinds)  # nearly all steps plain
    assert gov.switches >= 3 and gov.probes >= 3
    # Runs of plain steps between probes grow while the probes keep failing.
    runs = [len(r) for r in "".join("d" if k else "p" for k in kinds).split("d") if r]
    assert runs[-2] > runs[1] and max(runs) >= 64


def test_good_drafter_keeps_drafting_without_measuring_plain_steps():
    gov = Governor()
    assert all(run(gov, 100, spec_tokens=5, spec_s=0.020))
    assert gov.switches == 0


def test_marginal_drafter_is_judged_by_throughput():
    faster = Governor()
    kinds = run(faster, 100, spec_tokens=2, spec_s=0.015)  # 133 tok/s vs 100 plain
    assert sum(kinds) > 90 and faster.switches == 0
    slower = Governor()
    kinds = run(slower, 100, spec_tokens=2, spec_s=0.025)  # 80 tok/s vs 100 plain
    assert sum(kinds) < 30 and slower.switches >= 1


def run_scattered(governor, steps, spec_s, seed, plain_s=0.010):
    """Drafting steps that commit 1-4 tokens at random (mean 1.7), as real acceptance scatters."""
    rng = random.Random(seed)
    kinds = []
    for _ in range(steps):
        drafting = governor.should_draft()
        kinds.append(drafting)
        tokens = rng.choices([1, 2, 3, 4], [0.6, 0.2, 0.1, 0.1])[0] if drafting else 1
        governor.record(drafting, tokens, spec_s if drafting else plain_s)
    return sum(kinds) / steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_drafter_that_pays_on_average_keeps_drafting_through_unlucky_steps(seed):
    """113 tok/s drafting against 100 plain: a run of steps that accept nothing must not switch it
    off for long (the rule on the mean of 6 steps drafted on 9-35% of these steps)."""
    assert run_scattered(Governor(), 400, spec_s=0.015, seed=seed) > 0.8
    # 68 tok/s against 100: still switched off most of the time.
    assert run_scattered(Governor(), 400, spec_s=0.025, seed=seed) < 0.35


class SlowBackend(LocalDraftBackend):
    """A real (random) drafter that also takes 30 ms a step: it can only cost time."""

    def draft(self, *args):
        time.sleep(0.03)
        return super().draft(*args)


def test_a_drafter_that_does_not_help_does_not_cost_the_user():
    target = tiny_target("llama", seed=7)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cfg = config_for_target(target.config, block_size=8, taps=2)
    result = generate(target, prompt, DFlashProposer(SlowBackend(random_drafter(cfg))), DecodeOptions(60))
    assert result.tokens == greedy(target, prompt, 60)
    assert result.stats.governor["switches_to_plain"] >= 1
    assert result.stats.plain_steps > 0.7 * result.stats.steps


def _costs(**ms):
    return VerifyCosts({int(k[1:]): v / 1000 for k, v in ms.items()})


def test_verify_budget_is_the_arithmetic_best_even_when_cost_is_not_monotonic():
    # A chain whose path probabilities halve: expected accepted 0, .5, .75, .875, .9375 for n = 0..4.
    chain = DraftTree([7, 8, 9, 10], [0, 1, 2, 3], [1, 2, 3, 4], [0.5, 0.25, 0.125, 0.0625])
    gov = Governor(costs=_costs(w1=10, w2=20, w3=30, w4=12, w5=12))
    # Tokens per ms: n=0 1/10=.100, n=1 1.5/20=.075, n=2 1.75/30=.058, n=3 1.875/12=.156, n=4 1.9375/12=.161.
    assert gov.nodes(chain, probabilities=True) == 4
    gov.costs = _costs(w1=10, w2=20, w3=30, w4=12, w5=13)  # n=4 now 1.9375/13=.149 < n=3's .156
    assert gov.nodes(chain, probabilities=True) == 3
    gov.costs = _costs(w1=10, w2=40, w3=40, w4=40, w5=40)  # verifying is dear: .1 beats 1.9375/40
    assert gov.nodes(chain, probabilities=True) == 0
    gov.draft_s = 0.010  # 10 ms of drafting: n=0 1/20=.050 still beats n=4 1.9375/50=.039
    assert gov.nodes(chain, probabilities=True) == 0
    gov.costs = _costs(w1=10, w5=20)  # widths 2..4 interpolate: 12.5, 15, 17.5 ms
    # With 10 ms of drafting: n=0 1/20=.050, n=1 1.5/22.5=.067, n=2 1.75/25=.070, n=3 1.875/27.5=.068, n=4 .065.
    assert gov.nodes(chain, probabilities=True) == 2


def test_a_tree_beats_a_chain_of_the_same_width_when_second_choices_are_likely():
    logprobs = torch.log(torch.tensor([[0.5, 0.45, 0.05], [0.5, 0.45, 0.05]]))
    tree = DraftTree.best_first(logprobs, budget=4, max_depth=2, branching=3)
    chain = DraftTree.best_first(logprobs, budget=2, max_depth=2, branching=1)
    # Tree: .5, .45 at depth 1, then .25 and .225 under the first: expected 1.425 for 4 nodes;
    # the chain's 2 nodes expect .75; at equal widths the tree's first 2 nodes expect .95.
    assert tree.expected()[-1] == pytest.approx(1.425) and tree.expected()[2] == pytest.approx(0.95)
    assert chain.expected()[-1] == pytest.approx(0.75)
    gov = Governor(costs=_costs(w1=10, w2=11, w3=12, w4=13, w5=14))
    assert gov.nodes(tree, probabilities=True) == 4  # 2.425/14 beats every shorter prefix


def test_acceptance_statistics_set_the_chain_budget_and_follow_the_drafter():
    chain = DraftTree.chain([1, 2, 3])  # n-gram guesses: no probabilities
    gov = Governor(costs=_costs(w1=10, w2=14, w3=16, w4=18))
    for _ in range(100):  # nothing is ever accepted
        gov.record(True, 1, 0.02, width=4)
    assert gov.nodes(chain, probabilities=False) == 0
    for _ in range(100):  # now every guess is
        gov.record(True, 4, 0.02, width=4)
    assert gov.nodes(chain, probabilities=False) == 3
    # The drafter's probabilities are scaled by how well they predicted: here 4x too hopeful.
    for _ in range(200):
        gov.record(True, 2, 0.02, width=4, predicted=4.0, chain=False)
    assert gov.calibration == pytest.approx(0.25, abs=0.02)


def batch_step(governor, batch, good=True, draft_s=0.002):
    """One step of `batch` sequences sharing a governor, in sequence.step's call order: each one's
    decision, then each one's record of the one forward (tokens 4 a drafting step when `good`)."""
    kinds = [governor.should_draft(batch) for _ in range(batch)]
    for drafted in kinds:
        tokens = (4 if good else 1) if drafted else 1
        governor.record(drafted, tokens, 0.012 + (draft_s if drafted else 0.0), width=5, draft_s=draft_s)
    return kinds


def test_one_probe_refreshes_the_draft_cost_of_every_request_in_the_batch():
    """Each request kept its own estimate: one probe refreshed one, its paying reset the shared
    count, and the others stayed plain for good (a review)."""
    shared = Governor(costs=VerifyCosts({w: 0.020 + 0.0005 * w for w in range(1, 64)}))
    for _ in range(2):
        shared.record(False, 1, 0.020)
    forks = [shared.fork() for _ in range(2)]
    for gov in forks:
        for _ in range(3):
            gov.record(True, 4, 0.025, width=5, draft_s=0.004)
        gov.record(True, 4, 1.0, width=5, draft_s=1.0)  # the drafter was slow for a step
    drafted = []
    for _ in range(40):
        kinds = [gov.should_draft(2) for gov in forks]
        for gov, kind in zip(forks, kinds, strict=True):
            gov.record(kind, 4 if kind else 1, 0.025 if kind else 0.020, width=5 if kind else 1, draft_s=0.004)
        drafted.append(kinds)
    assert all(all(kinds) for kinds in drafted[-20:]), drafted


def test_a_batch_drafts_again_after_one_slow_draft():
    """At a batch of 2 or more, `pays_at` judged drafting from the last drafting steps' cost and
    nothing re-measured it: one slow draft (a timeout, a daemon restarting) left drafting off for
    as long as two requests ran (an audit: 108 tok/s down to 26). Now and then a blocked batch
    drafts one step, whose cost replaces the estimate."""
    gov = Governor(costs=VerifyCosts({w: 0.010 + 0.0004 * w for w in range(1, 64)}))
    for _ in range(2):
        gov.record(False, 1, 0.010)
    assert all(all(batch_step(gov, 2)) for _ in range(10))
    batch_step(gov, 2, draft_s=1.0)  # one draft waits a second
    kinds = [k for _ in range(200) for k in batch_step(gov, 2)]
    assert not all(kinds[:4]), "the slow step's cost must tell"
    assert all(kinds[-100:]) and sum(kinds) > 0.8 * len(kinds), sum(kinds)


def test_a_drafter_that_loses_at_a_batch_is_probed_with_backoff_not_every_step():
    gov = Governor(costs=VerifyCosts({w: 0.010 + 0.0004 * w for w in range(1, 64)}))
    for _ in range(2):
        gov.record(False, 1, 0.010)
    kinds = [k for _ in range(400) for k in batch_step(gov, 4, good=False, draft_s=0.02)]
    assert sum(kinds) < 0.1 * len(kinds), sum(kinds)


def test_one_losing_step_of_a_batch_is_one_switch():
    """Every sequence of a batch records the one losing step; each record judged again, so one
    step of 8 counted 6 switches and doubled the backoff to its cap (an audit)."""
    gov = Governor(costs=VerifyCosts({w: 0.010 + 0.0004 * w for w in range(1, 64)}))
    for _ in range(2):
        gov.record(False, 1, 0.010)
    while gov.switches == 0:
        batch_step(gov, 8, good=False, draft_s=0.02)
    assert gov.switches == 1 and gov.backoff == gov.probe_every


def test_a_plain_step_that_waited_for_a_failed_draft_is_not_the_plain_rate():
    """A step that asked the drafter and got nothing (a timeout, then the fallback's nothing) was
    recorded as plain with the wait in its seconds: plain decoding looked 10x slower for the rest
    of the run, and a drafter that lost drafted on for good (an audit). It is a drafting step."""
    target = tiny_target("llama", seed=7)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cfg = config_for_target(target.config, block_size=8, taps=2)

    class StallsOnce(SlowBackend):  # 30 ms a draft, useless, and once 1.5 s with nothing back
        calls = 0

        def draft(self, *args):
            StallsOnce.calls += 1
            if StallsOnce.calls == 3:
                time.sleep(1.5)
                from target_node.drafting.proposers import DrafterUnavailable

                raise DrafterUnavailable("timed out")
            return super().draft(*args)

    gov = Governor()
    proposer = DFlashProposer(StallsOnce(random_drafter(cfg)))
    result = generate(target, prompt, proposer, DecodeOptions(80), governor=gov)
    assert result.tokens == greedy(target, prompt, 80)
    assert max(seconds for _, seconds in gov.plain) < 1.0, list(gov.plain)  # the stall: 1.5 s
    assert gov.switches >= 1 and result.stats.plain_steps > 0.6 * result.stats.steps, gov.to_dict()


def test_each_request_decides_with_its_own_fork_and_gives_it_back():
    """A request whose drafts always fail no longer sets the drafting of the requests beside it;
    what it learned seeds the next request; the verify costs stay one table."""
    shared = Governor(costs=VerifyCosts({1: 0.01}))
    good, bad = shared.fork(), shared.fork()
    assert good.costs is shared.costs and good.depth_hits is not shared.depth_hits
    for _ in range(2):
        good.record(False, 1, 0.010)
        bad.record(False, 1, 0.010)
    for _ in range(40):
        bad.record(bad.should_draft(), 1, 0.030, width=5, draft_s=0.02)
        good.record(good.should_draft(), 5, 0.015, width=5, draft_s=0.002)
    assert good.drafting and good.switches == 0 and bad.switches >= 1
    assert good.depth_hits[1] > bad.depth_hits[1]
    shared.absorb(bad)
    shared.absorb(good)
    assert shared.switches == bad.switches and shared.depth_hits == good.depth_hits
    assert shared.fork().switches == 0


def test_a_batch_where_drafting_does_not_pay_drafts_rarely_and_alone_drafts_at_once():
    """Where wide rows cost, 8 sequences drafting lose to 8 plain rows: the batch drafts only its
    probes, ever rarer; a request left alone drafts at once."""
    gov = Governor(costs=VerifyCosts({w: 0.010 + 0.004 * w for w in range(1, 200)}))
    for _ in range(2):
        gov.record(False, 1, 0.010)
    kinds = [k for _ in range(600) for k in batch_step(gov, 8, draft_s=0.004)]
    assert sum(kinds[-8 * 256 :]) <= 2, sum(kinds[-8 * 256 :])  # ever rarer: one step in 256 at most
    assert gov.batch_probes.every == gov.batch_probes.most
    assert gov.should_draft(1)


def test_a_requests_fork_judges_on_its_own_steps_within_a_short_backoff():
    """Whole state given back, a request whose drafts all failed (a sampled one at temperature 2,
    another tenant's) left the next request plain with a backoff of 128 (a review). The next one
    now starts from whether drafting was on, but probes within 2 x probe_every steps, and judges on
    the drafting steps of its own probe."""
    shared = Governor(costs=VerifyCosts({w: 0.010 for w in range(1, 40)}))
    for _ in range(2):
        shared.record(False, 1, 0.010)
    losing = shared.fork()
    while losing.drafting or losing.backoff < 64:
        drafted = losing.should_draft()
        losing.record(drafted, 1, 0.030 if drafted else 0.010, width=5, draft_s=0.02)
    shared.absorb(losing)
    assert shared.switches == losing.switches and shared.depth_hits == losing.depth_hits
    nxt = shared.fork()
    assert not nxt.drafting and nxt.backoff == 2 * nxt.probe_every and nxt.switches == 0
    assert list(nxt.plain) == list(losing.plain)  # the plain rate is the machine's: kept
    plain_steps = 0
    while not nxt.should_draft():
        nxt.record(False, 1, 0.010)
        plain_steps += 1
    assert plain_steps == 2 * nxt.probe_every  # a probe within 16 steps
    for _ in range(3):  # its own drafting pays: it drafts on
        nxt.record(True, 5, 0.015, width=5, draft_s=0.002)
    assert nxt.drafting and nxt.should_draft()
