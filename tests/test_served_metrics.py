"""The target daemon's aggregate of what it served, and its Prometheus translation, as units."""

from collections import Counter

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import registry_for
from target_node.decoding.stats import Stats
from target_node.drafting.proposers import DFlashProposer, NGramProposer
from target_node.serving.metrics import (
    DEEPEST_REPORTED,
    LatencyHistogram,
    RequestClock,
    ServedMetrics,
    accepted_at_position,
    accepted_per_step,
    drafter_state,
)


def test_a_position_counts_every_step_that_accepted_at_least_that_far():
    assert accepted_at_position(Counter({0: 5, 1: 3, 3: 2})) == {"1": 5, "2": 2, "3": 2}
    assert accepted_at_position(Counter({0: 4})) == {}


def test_steps_deeper_than_any_drafter_fold_into_the_last_position():
    """Hint steps accept as many tokens as a client sends: one key a depth let cheap requests make
    `stats` cost O(depth squared) and Prometheus a label a depth. Now depths past DEEPEST_REPORTED
    count at it, and a position still counts every step that accepted at least that far."""
    deep = Counter({k: 1 for k in range(16_385)})
    per_step, at = accepted_per_step(deep), accepted_at_position(deep)
    assert len(per_step) == DEEPEST_REPORTED + 1 and per_step[str(DEEPEST_REPORTED)] == 16_385 - DEEPEST_REPORTED
    assert len(at) == DEEPEST_REPORTED and at["1"] == 16_384 and at[str(DEEPEST_REPORTED)] == 16_385 - DEEPEST_REPORTED
    assert sum(per_step.values()) == sum(deep.values())


def test_histogram_buckets_hold_values_up_to_and_including_their_bound():
    histogram = LatencyHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(seconds)
    assert histogram.to_dict() == {"bounds": [0.1, 1.0], "counts": [2, 2, 1], "sum": pytest.approx(8.65), "count": 5}


def test_finished_requests_add_up_and_translate_to_prometheus():
    metrics = ServedMetrics()
    clock = RequestClock(received=0.0)  # arrived long ago: time to first token lands in the top bucket
    for _ in range(3):
        clock.commit()
    metrics.finish(
        "length", Stats(prompt_tokens=7, new_tokens=5, steps=3, proposed=6, accepted=2, histogram=Counter({2: 1, 0: 1}))
    )
    metrics.finish("eos", Stats(prompt_tokens=3, new_tokens=2, steps=1), clock)
    metrics.finish("cancelled")  # cancelled while queued: no figures
    metrics.refuse("busy")
    metrics.admit(0.3)
    figures = metrics.to_dict()
    assert figures["requests"] == {"length": 1, "eos": 1, "cancelled": 1} and figures["refused"] == {"busy": 1}
    assert (figures["prompt_tokens"], figures["generation_tokens"], figures["steps"]) == (10, 7, 4)
    assert figures["tau"] == (2 + 4) / 4 and figures["accepted_at_position"] == {"1": 1, "2": 1}
    assert figures["ttft_s"]["count"] == 1 and figures["inter_token_s"]["count"] == 2

    stats = {**figures, "queued": 2, "running": 1, "max_batch": 8, "proposer": "ngram", "drafter": {}, "served": 2}
    text = generate_latest(registry_for(lambda: stats)).decode()
    samples = {
        (s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }
    assert samples[("dflash_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("dflash_request_errors_total", (("code", "busy"),))] == 1
    assert samples[("dflash_draft_accepted_at_position_total", (("position", "2"),))] == 1
    assert samples[("dflash_time_to_first_token_seconds_bucket", (("le", "60.0"),))] == 0
    assert samples[("dflash_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 1
    assert samples[("dflash_queue_depth", ())] == 2 and samples[("dflash_mean_tokens_per_step", ())] == 1.5
    assert samples[("dflash_requests_running", ())] == 1 and samples[("dflash_max_batch", ())] == 8
    assert samples[("dflash_queue_time_seconds_count", ())] == 1
    assert samples[("dflash_queue_time_seconds_sum", ())] == 0.3
    assert ("dflash_drafter_reachable", ()) not in samples  # n-gram lookup has no drafter to reach

    down = generate_latest(registry_for(lambda: None)).decode()
    assert [f.name for f in text_string_to_metric_families(down)] == ["dflash_target_daemon_up"]


def test_only_the_fallbacks_steps_count_as_fallback():
    """A DFlash daemon's steps come from its drafter, its pre-drafts, looked-up branches, hints and,
    while the drafter is away, its fallback: the last alone is the fallback metric."""
    metrics = ServedMetrics()
    sources = Counter({"dflash": 5, "predraft": 2, "lookup": 3, "hint": 1, "ngram": 4})
    metrics.finish("length", Stats(new_tokens=16, steps=15, sources=sources))
    stats = {**metrics.to_dict(), "queued": 0, "running": 0, "max_batch": 1, "drafter": {}, "served": 1}
    for proposer, fallback in (("dflash", 4), ("ngram", 0)):
        text = generate_latest(registry_for(lambda p=proposer: {**stats, "proposer": p})).decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["dflash_drafter_fallback_steps_total"] == fallback


class Backend:
    """A remote backend's visible state: attached or not, and its counters."""

    def __init__(self, attached: bool = False, timeouts: int = 2, errors: int = 1, proposals: int = 6) -> None:
        self.attached = attached
        self.counters = {"round_trips": 9, "timeouts": timeouts, "errors": errors, "proposals": proposals}


def test_drafter_state_reads_whatever_the_proposer_has():
    assert drafter_state([NGramProposer()]) == {}
    assert drafter_state([DFlashProposer(Backend())]) == {
        **{"reachable": False, "slots_attached": 0, "slots": 1},
        **{"timeouts": 2, "errors": 1, "proposals": 6},
    }
    local = type("Local", (), {"counters": {"proposals": 3}, "attached": True})()  # in process: always there
    state = drafter_state([DFlashProposer(local)])
    assert state == {"reachable": True, "slots_attached": 1, "slots": 1, "proposals": 3}


def test_drafter_state_adds_up_every_slot_and_counts_a_shared_backend_once():
    """Read from slot 0 alone, the stats said 0 timeouts where the other slots had 9 (an audit)."""
    slots = [Backend(True, 0, 0, 10), Backend(False, 4, 1, 40), Backend(False, 5, 3, 50)]
    state = drafter_state([DFlashProposer(b) for b in slots])
    assert state == {"reachable": True, "slots_attached": 1, "slots": 3, "timeouts": 9, "errors": 4, "proposals": 100}
    shared = Backend(True)
    assert drafter_state([DFlashProposer(shared), DFlashProposer(shared)])["proposals"] == 6
