"""GET /metrics: the target daemon's own `stats`, translated into Prometheus metrics at each scrape.

The front end counts nothing itself. A custom collector asks the daemon for its aggregate
(`target_node/serving/metrics.py`) whenever Prometheus scrapes, so the figures are the daemon's,
whatever else talks to it (other front ends, `dflash-client`), and they survive a restart
of the front end. When the daemon does not answer, only `dflash_target_daemon_up 0` is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from protocol.stats import ServedStats

TTFT = ("dflash_time_to_first_token_seconds", "From arrival at the target daemon to the first committed tokens")
INTER_TOKEN = (
    "dflash_inter_token_latency_seconds",
    "Gaps between consecutive commits of a request (a commit may carry several tokens)",
)
E2E = ("dflash_e2e_request_latency_seconds", "From arrival at the target daemon to its done reply")
QUEUE = ("dflash_queue_time_seconds", "From arrival at the target daemon to a slot in its batch")
# Step sources a DFlash daemon reports that are not its fallback: the drafter's pre-draft, a
# looked-up branch verified while the drafter sat out, hinted tokens (counting them as the
# fallback's reported 34 fallback steps beside a drafter that answered every propose: an audit).
NOT_FALLBACK = ("predraft", "lookup", "hint")


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def labelled_counter(name: str, doc: str, label: str, values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items(), key=lambda kv: (len(kv[0]), kv[0])):
        family.add_metric([key], value)
    return family


def histogram(name: str, doc: str, data: dict) -> HistogramMetricFamily:
    """The daemon's per-bucket counts as Prometheus' cumulative `le` buckets."""
    buckets, running = [], 0
    for bound, count in zip([*data["bounds"], float("inf")], data["counts"], strict=True):
        running += count
        buckets.append((floatToGoString(bound), running))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=data["sum"])


def translate(reply: dict) -> Iterator[Metric]:
    """Prometheus metrics from one `stats` reply of the target daemon."""
    stats = ServedStats.from_dict(reply)
    yield labelled_counter(
        "dflash_requests",
        "Requests finished, by the daemon's finish reason (eos, stop, length, cancelled)",
        "finish_reason",
        stats.requests,
    )
    yield labelled_counter("dflash_request_errors", "Requests refused, by error code", "code", stats.refused)
    yield counter("dflash_prompt_tokens", "Prompt tokens of finished requests", stats.prompt_tokens)
    yield counter(
        "dflash_prompt_tokens_cached",
        "Prompt tokens of finished requests taken from the prefix cache, not prefilled",
        stats.cached_prompt_tokens,
    )
    cache = stats.prefix_cache or {}
    yield counter("dflash_prefix_cache_lookups", "Prompts looked up in the prefix cache", cache.get("lookups", 0))
    yield counter("dflash_prefix_cache_hits", "Prompts that started from stored rows", cache.get("hits", 0))
    yield counter("dflash_prefix_cache_evicted", "Prefix cache entries evicted for room", cache.get("evicted", 0))
    yield GaugeMetricFamily("dflash_prefix_cache_bytes", "Bytes the prefix cache holds", cache.get("bytes", 0))
    yield counter("dflash_generation_tokens", "Tokens generated", stats.generation_tokens)
    for (name, doc), data in ((TTFT, stats.ttft_s), (INTER_TOKEN, stats.inter_token_s), (E2E, stats.e2e_s)):
        yield histogram(name, doc, data)
    yield histogram(*QUEUE, stats.queue_s)
    yield counter("dflash_draft_tokens_proposed", "Draft tokens proposed for verification", stats.proposed)
    yield counter("dflash_draft_tokens_accepted", "Draft tokens the target accepted", stats.accepted)
    yield labelled_counter(
        "dflash_draft_accepted_at_position",
        "Steps whose draft was accepted at least up to this position (1 = the first draft token)",
        "position",
        stats.accepted_at_position,
    )
    yield counter("dflash_target_steps", "Target forward passes after prefill (decode steps)", stats.steps)
    yield labelled_counter(
        "dflash_drafted_steps", "Decode steps that verified drafts, by who drafted", "source", stats.drafted_steps
    )
    yield GaugeMetricFamily(
        "dflash_mean_tokens_per_step", "tau: tokens committed per decode step, since the daemon started", stats.tau
    )
    proposer = stats.proposer
    drafter_sources = {proposer, *NOT_FALLBACK}
    fallback = (
        sum(n for source, n in stats.drafted_steps.items() if source not in drafter_sources)
        if proposer == "dflash"
        else 0
    )
    yield counter("dflash_drafter_fallback_steps", "Steps drafted by the fallback while the drafter was away", fallback)
    drafter = stats.drafter
    if "reachable" in drafter:
        yield GaugeMetricFamily("dflash_drafter_reachable", "1 while the drafter answers", int(drafter["reachable"]))
    for key in ("timeouts", "errors"):
        if key in drafter:
            yield counter(
                f"dflash_drafter_{key}", f"Draft requests that ended in {key} (each one falls back)", drafter[key]
            )
    yield GaugeMetricFamily("dflash_queue_depth", "Requests waiting in the target daemon's queues", stats.queued)
    yield GaugeMetricFamily("dflash_requests_running", "Requests being generated now (the batch size)", stats.running)
    yield GaugeMetricFamily("dflash_max_batch", "Requests the target daemon decodes at once", stats.max_batch)


class DaemonCollector(Collector):
    """Asks the daemon for its stats on every scrape; `fetch` returns None when it does not answer."""

    def __init__(self, fetch: Callable[[], dict | None]) -> None:
        self.fetch = fetch

    def describe(self) -> list[Metric]:
        return []  # names vary with what the daemon serves; registering must not call the daemon

    def collect(self) -> Iterator[Metric]:
        stats = self.fetch()
        yield GaugeMetricFamily(
            "dflash_target_daemon_up", "1 when the target daemon answered this scrape", int(bool(stats))
        )
        if stats:
            yield from translate(stats)


def registry_for(fetch: Callable[[], dict | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(fetch))
    return registry
