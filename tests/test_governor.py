"""The governor turns speculation off while it costs more than it brings, and probes again."""

import time

from helpers import greedy, tiny_target

from draft_node.checkpoint import config_for_target, random_drafter
from target_node.governor import Governor
from target_node.proposers import DFlashProposer, LocalDraftBackend
from target_node.speculative import generate


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


class SlowBackend(LocalDraftBackend):
    """A real (random) drafter that also takes 30 ms a step: it can only cost time."""

    def draft(self, *args):
        time.sleep(0.03)
        return super().draft(*args)


def test_a_drafter_that_does_not_help_does_not_cost_the_user():
    target = tiny_target("llama", seed=7)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cfg = config_for_target(target.config, block_size=8, num_taps=2)
    result = generate(target, prompt, DFlashProposer(SlowBackend(random_drafter(cfg))), 60)
    assert result.tokens == greedy(target, prompt, 60)
    assert result.stats.governor["switches_to_plain"] >= 1
    assert result.stats.plain_steps > 0.7 * result.stats.steps


def test_draft_limit_follows_the_acceptance_depth():
    gov = Governor()
    assert gov.draft_limit(7) == 7  # no evidence yet: the whole block
    for accepted in [0] * 20 + [1] * 8 + [2] * 2:
        gov.record(True, accepted + 1, 0.01)
    assert gov.draft_limit(7) == 2  # depth 1 is common, depth 2 still reached 1 in 15 steps
    assert gov.draft_limit(1) == 1 and gov.draft_limit(0) == 0
    for _ in range(32):  # the drafter now fills every block it is given
        gov.record(True, gov.draft_limit(7) + 1, 0.01)
    assert gov.draft_limit(7) == 7
