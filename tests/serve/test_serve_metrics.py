"""GET /metrics parses as Prometheus text, and its counters move by exactly what a known request did.

The figures are the target daemon's own (its `stats` reply), so a request sent straight to
the daemon over msgpack moves them too: that is how the draft counters are checked against
a request whose drafts (hinted tokens) are known.
"""

import requests
from prometheus_client.parser import text_string_to_metric_families
from serving import CHAT, MODEL

from frontend.target_client import TargetClient

FAMILIES = {
    "dflash_target_daemon_up": "gauge",
    "dflash_requests": "counter",
    "dflash_request_errors": "counter",
    "dflash_prompt_tokens": "counter",
    "dflash_prompt_tokens_cached": "counter",
    "dflash_prefix_cache_lookups": "counter",
    "dflash_prefix_cache_hits": "counter",
    "dflash_prefix_cache_evicted": "counter",
    "dflash_prefix_cache_bytes": "gauge",
    "dflash_generation_tokens": "counter",
    "dflash_time_to_first_token_seconds": "histogram",
    "dflash_inter_token_latency_seconds": "histogram",
    "dflash_e2e_request_latency_seconds": "histogram",
    "dflash_draft_tokens_proposed": "counter",
    "dflash_draft_tokens_accepted": "counter",
    "dflash_draft_accepted_at_position": "counter",
    "dflash_target_steps": "counter",
    "dflash_drafted_steps": "counter",
    "dflash_mean_tokens_per_step": "gauge",
    "dflash_drafter_fallback_steps": "counter",
    "dflash_queue_depth": "gauge",
    "dflash_requests_running": "gauge",
    "dflash_max_batch": "gauge",
    "dflash_queue_time_seconds": "histogram",
}


def scrape(server: str) -> dict:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    reply = requests.get(f"{server}/metrics", timeout=60)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(reply.text))
    assert {f.name: f.type for f in families} == FAMILIES
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def moved(before: dict, after: dict) -> dict:
    """What changed between two scrapes (gauges included)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in {*before, *after} if after.get(k, 0) != before.get(k, 0)}


def test_an_http_request_moves_the_counters_by_exactly_its_own_figures(server, openai_client):
    before = scrape(server)
    got = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    after = scrape(server)
    change = moved(before, after)
    steps = change[("dflash_target_steps_total", ())]
    assert steps >= 1
    want = {
        ("dflash_requests_total", (("finish_reason", "length"),)): 1,
        ("dflash_prompt_tokens_total", ()): got.usage.prompt_tokens,
        ("dflash_prompt_tokens_cached_total", ()): got.usage.prompt_tokens_details.cached_tokens,
        ("dflash_prefix_cache_lookups_total", ()): 1,
        ("dflash_generation_tokens_total", ()): 16,
        ("dflash_time_to_first_token_seconds_count", ()): 1,
        ("dflash_inter_token_latency_seconds_count", ()): steps,  # one gap after each decode step's commit
        ("dflash_e2e_request_latency_seconds_count", ()): 1,
        ("dflash_queue_time_seconds_count", ()): 1,
    }
    assert {k: change.get(k, 0) for k in want} == want
    assert sum(v for k, v in change.items() if k[0] in ("dflash_requests_total", "dflash_request_errors_total")) == 1
    for name in ("dflash_time_to_first_token_seconds", "dflash_e2e_request_latency_seconds"):
        assert change[(f"{name}_bucket", (("le", "+Inf"),))] == 1 and change[(f"{name}_sum", ())] > 0
    assert after[("dflash_queue_depth", ())] == 0 and after[("dflash_requests_running", ())] == 0
    assert after[("dflash_target_daemon_up", ())] == 1


def test_draft_counters_move_by_exactly_what_a_hinted_request_accepted(server, target_address):
    client = TargetClient(target_address, timeout_s=120)
    try:
        ask = {"messages": CHAT, "max_new_tokens": 16, "stream": False, "sampling": {"temperature": 0.0}}
        greedy = client.generate(**ask)["token_ids"]
        wrong = (greedy[7] + 1) % 49152
        before = scrape(server)
        # Hints name the answer from its first token, which the prefill commits: six verified
        # right, then a wrong guess.
        done = client.generate(**ask, hints=greedy[:7] + [wrong])
        after = scrape(server)
    finally:
        client.close()
    assert done["token_ids"] == greedy  # hints only ever change speed
    stats, change = done["stats"], moved(before, after)
    assert stats["accepted"] >= 6
    assert change[("dflash_draft_tokens_proposed_total", ())] == stats["proposed"]
    assert change[("dflash_draft_tokens_accepted_total", ())] == stats["accepted"]
    assert change[("dflash_target_steps_total", ())] == stats["steps"]
    histogram = {int(k): v for k, v in stats["histogram"].items()}
    per_position = {
        (("position", str(k)),): sum(n for accepted, n in histogram.items() if accepted >= k)
        for k in range(1, max(histogram) + 1)
    }
    got = {k[1]: v for k, v in change.items() if k[0] == "dflash_draft_accepted_at_position_total"}
    assert got == per_position and got[(("position", "6"),)] >= 1
    sources = {k[1][0][1]: v for k, v in change.items() if k[0] == "dflash_drafted_steps_total"}
    assert sources == stats["sources"] and sources["hint"] >= 1
    totals = requests.get(f"{server}/stats", timeout=60).json()
    tau = (totals["accepted"] + totals["steps"]) / totals["steps"]
    assert after[("dflash_mean_tokens_per_step", ())] == tau > 1
