"""Prometheus metrics (prometheus-client), one registry per app so several apps can live in
one process (tests) without clashing.

Engine process (`strata engine`): request outcomes and token counts are counted by the API
layer; slots, queue, MTP and batch-MTP counters are read from the engine core at scrape time,
and the process's garbage collector (prometheus-client's python_gc_*, and what it froze).
Server process (`strata serve`): its own `strata_server_*` metrics, followed by the engine's
text (fetched from the engine) so one scrape sees both.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# `*_created` timestamps double the exposition and nobody here reads them
disable_created_metrics()

# per-slot MTP counters: key in core.metrics() -> (metric name, help)
MTP_SLOT_COUNTERS: dict[str, tuple[str, str]] = {
    "windows": ("strata_mtp_windows", "MTP verify windows run, per slot"),
    "drafted": ("strata_mtp_drafted_tokens", "tokens drafted by MTP, per slot"),
    "accepted": ("strata_mtp_accepted_tokens", "drafted tokens accepted by verification, per slot"),
}


# the expert cache (strata/experts/cache.py CacheStats, with the pool's size): key in
# core.metrics()["expert_cache"] -> (metric name, counter or gauge, help); absent without a pool
EXPERT_CACHE_METRICS: dict[str, tuple[str, str, str]] = {
    "lookups": ("strata_expert_cache_lookups", "counter", "experts a window's layer needed (one per expert per window)"),
    "hits": ("strata_expert_cache_hits", "counter", "lookups whose expert was in its slot before the window"),
    "misses": ("strata_expert_cache_misses", "counter", "lookups whose expert was not in a slot"),
    "evictions": ("strata_expert_cache_evictions", "counter", "experts that left a slot for a missing one"),
    "host_served": ("strata_expert_cache_host_served", "counter",
                    "misses served from host memory: every slot was needed by the window itself"),
    "uploads": ("strata_expert_cache_uploads", "counter", "experts brought into slots (the CPU: dequantized into them)"),
    "bytes_uploaded": ("strata_expert_cache_uploaded_bytes", "counter", "bytes written into slots"),
    "windows": ("strata_expert_cache_windows", "counter", "windows run with the cache"),
    "host_seconds": ("strata_expert_cache_host_expert_seconds", "counter",
                     "time serving experts no slot could take from host memory (the CPU: dequantizing them)"),
    "window_bytes": ("strata_expert_cache_window_uploaded_bytes", "gauge", "bytes written into slots by the last window"),
    "hit_rate": ("strata_expert_cache_hit_rate", "gauge", "hits / lookups since start"),
    "slots": ("strata_expert_cache_slots", "gauge", "expert slots in the pool"),
    "experts": ("strata_expert_cache_experts", "gauge", "experts behind the pool (every layer's)"),
}


def _expert_cache_families(stats: dict | None) -> Iterable:
    for key, (name, kind, help_) in EXPERT_CACHE_METRICS.items():
        value = (stats or {}).get(key)
        if value is None:
            continue
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_)
        fam.add_metric([], float(value))
        yield fam


def _per_slot(metrics: dict[str, Any], key: str) -> list[float]:
    """Accept either {"mtp_<key>": [per slot]} or {"slots": [{"<key>": n}, ...]}."""
    direct = metrics.get(f"mtp_{key}")
    if isinstance(direct, (list, tuple)):
        return [float(v) for v in direct]
    if isinstance(direct, dict):
        return [float(direct[k]) for k in sorted(direct)]
    slots = metrics.get("slots") or metrics.get("mtp") or []
    if isinstance(slots, dict):
        slots = [slots[k] for k in sorted(slots)]
    return [float(s.get(f"mtp_{key}", s.get(key, 0))) for s in slots if isinstance(s, dict)]


class _CoreCollector:
    """Reads the engine core's gauges and counters when Prometheus scrapes."""

    def __init__(self, core_getter: Callable[[], Any]):
        self._core = core_getter

    def describe(self):  # no fixed description: the collector is only called at scrape time
        return []

    def collect(self) -> Iterable:
        core = self._core()
        busy = GaugeMetricFamily("strata_slots_busy", "slots generating now")
        depth = GaugeMetricFamily("strata_queue_depth", "requests waiting for a slot inside the engine")
        total = GaugeMetricFamily("strata_slots", "slots (--parallel)")
        if core is None:
            yield from (busy, depth, total)
            return
        busy.add_metric([], float(core.slots_busy()))
        depth.add_metric([], float(core.queue_depth()))
        total.add_metric([], float(core.parallel))
        yield from (busy, depth, total)
        m = core.metrics() or {}
        for key, (name, help_) in MTP_SLOT_COUNTERS.items():
            fam = CounterMetricFamily(name, help_, labels=["slot"])
            for slot, v in enumerate(_per_slot(m, key)):
                fam.add_metric([str(slot)], v)
            yield fam
        frozen = GaugeMetricFamily("strata_gc_frozen_objects",
                                   "objects moved out of the garbage collector's sight after the load "
                                   "(strata.server.gc_policy)")
        frozen.add_metric([], float(gc.get_freeze_count()))
        yield frozen
        fb = CounterMetricFamily("strata_batch_mtp_fallbacks", "batched MTP windows that fell back, by reason",
                                 labels=["reason"])
        for reason, v in sorted((m.get("batch_mtp_fallbacks") or {}).items()):
            fb.add_metric([str(reason)], float(v))
        yield fb
        yield from _expert_cache_families(m.get("expert_cache"))


class EngineMetrics:
    def __init__(self, core_getter: Callable[[], Any]):
        self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "finished API requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of served requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("strata_completion_tokens", "generated tokens of served requests",
                                         registry=self.registry)
        self.cached_tokens = Counter("strata_prompt_tokens_cached",
                                     "prompt tokens whose KV came from the prefix cache instead of a prefill",
                                     registry=self.registry)
        self.registry.register(_CoreCollector(core_getter))
        GCCollector(registry=self.registry)  # python_gc_*: collections and what they found, by generation

    def finished(self, endpoint: str, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                 cached_tokens: int = 0) -> None:
        self.requests.labels(endpoint, outcome).inc()
        for counter, n in ((self.prompt_tokens, prompt_tokens), (self.completion_tokens, completion_tokens),
                           (self.cached_tokens, cached_tokens)):
            if n:
                counter.inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("strata_server_requests", "requests answered by strata serve, by outcome",
                                ["outcome"], registry=self.registry)
        self.engine_starts = Counter("strata_server_engine_starts", "engine processes started",
                                     registry=self.registry)
        self.engine_restarts = Counter("strata_server_engine_restarts",
                                       "engine processes started after an earlier one stopped or failed",
                                       registry=self.registry)
        self.engine_exits = Counter("strata_server_engine_exits", "engine processes that stopped, by kind",
                                    ["kind"], registry=self.registry)
        self.engine_up = Gauge("strata_server_engine_up", "1 when the engine is ready", registry=self.registry)
        self.queued = Gauge("strata_server_queue_depth", "requests waiting in strata serve for an engine slot",
                            registry=self.registry)
        self.in_flight = Gauge("strata_server_requests_in_flight", "requests sent to the engine and not finished",
                               registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
