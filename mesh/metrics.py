"""Prometheus metrics (`atomesh_*`), one registry per mesh app.

The request path counts into plain tallies (`_Tally`, cached per metric and label values: a dict
lookup, an int or a list slot), folded into prometheus-client's metrics whenever the registry is
read (`flush`), not its locked per-value `inc`/`observe`. In-flight counts per worker are read at
scrape time by a collector, so the request path only touches the mesh's own counter dict.

`mesh serve --workers N` (several processes on one port, `PROMETHEUS_MULTIPROC_DIR` set by the
parent before any of them imports prometheus-client): counters and histograms go to that
directory's files per process and `/metrics`, whichever process answers, reports their sums over
every process (prometheus-client's multiprocess mode). The live gauges (in flight per worker, held
transfers, the leak alarm, the registry's staleness) are copied into multiprocess gauges by
`sync_live()` once a second and on every scrape: summed over the processes, or their maximum where
each process sees the same thing (the leak alarm, staleness, oldest transfer, healthy workers).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from typing import Any, Callable, Iterable, Literal, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mesh.pacer import Pacer

# live gauges summed over a multiprocess mesh's processes (the rest: their maximum)
_SUMMED = {"atomesh_worker_in_flight", "atomesh_kv_held_transfers", "atomesh_kv_held_blocks",
           "atomesh_registry_watch_restarts"}

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Tally:
    """A counter's or histogram's child, counted here on the request path (an int, a list slot) and
    folded into prometheus-client's child when the registry is read (`Metrics.flush`): its `inc`
    and `observe` take a lock per value and walk the buckets in Python (~2 us a request's worth of
    observations each, ~4 of them per request). The exposition is the same (tests/test_metrics.py)."""
    __slots__ = ("child", "n", "bounds", "counts", "sum")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.n = 0
        # a histogram's child: its buckets' upper bounds (+Inf last); `bisect_left` finds the first
        # bound >= the value, the bucket prometheus-client's own `observe` picks
        bounds = getattr(child, "_upper_bounds", None)
        self.bounds: tuple[float, ...] = tuple(bounds) if bounds is not None else ()
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def inc(self) -> None:
        self.n += 1

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def fold(self) -> None:
        if self.n:
            self.child.inc(self.n)
            self.n = 0
        if self.sum or any(self.counts):
            self.child._sum.inc(self.sum)
            for i, k in enumerate(self.counts):
                if k:
                    self.child._buckets[i].inc(k)
                    self.counts[i] = 0
            self.sum = 0.0


class _Flush(Collector):
    """Registered first: a read of the registry folds the tallies in before the metrics are read."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def collect(self) -> Iterable[GaugeMetricFamily]:
        self._flush()
        return ()


class _InFlight(Collector):
    def __init__(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("atomesh_worker_in_flight", "Requests in flight on each worker, "
                              "as counted by this mesh", labels=["worker", "role"])
        for wid, role, n in self._read():
            g.add_metric([wid, role], n)
        yield g


class _Registry(Collector):
    def __init__(self, read: Callable[[], tuple[bool, int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        stale, restarts = self._read()
        yield GaugeMetricFamily("atomesh_registry_stale", "1 while the registry cannot be followed "
                                "(etcd unreachable): routing uses the last snapshot", value=int(stale))
        yield CounterMetricFamily("atomesh_registry_watch_restarts", "Times the registry watch was "
                                  "re-established", value=restarts)


class _Ledger(Collector):
    def __init__(self, read: Callable[[], Iterable[tuple[str, int, int, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        t = GaugeMetricFamily("atomesh_kv_held_transfers", "Transfers this mesh has open on each pipeline",
                              labels=["pipeline"])
        b = GaugeMetricFamily("atomesh_kv_held_blocks", "KV blocks of those transfers", labels=["pipeline"])
        o = GaugeMetricFamily("atomesh_kv_oldest_held_seconds", "Age of the oldest open transfer",
                              labels=["pipeline"])
        for pid, n, blocks, age in self._read():
            t.add_metric([pid], n)
            b.add_metric([pid], blocks)
            o.add_metric([pid], age)
        yield from (t, b, o)


class _Unaccounted(Collector):
    def __init__(self, read: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("atomesh_kv_unaccounted_blocks", "The leak alarm: KV blocks a worker's census "
                              "(free + held + running) has left unaccounted for longer than kv_leak_after; the "
                              "worker is out of routing while it is set", labels=["worker"])
        for wid, n in self._read():
            g.add_metric([wid], n)
        yield g


class _BadRequests(Collector):
    def collect(self) -> Iterable[CounterMetricFamily]:
        from contract.badlog import BAD_REQUESTS

        yield CounterMetricFamily("atomesh_bad_http_requests", "Requests aiohttp's parser refused (logged once "
                                  "per peer per minute, without their bytes)", value=BAD_REQUESTS.total)


class Metrics:
    def __init__(self, in_flight: Callable[[], Iterable[tuple[str, str, int]]],
                 registry: Callable[[], tuple[bool, int]] = lambda: (False, 0),
                 ledger: Callable[[], Iterable[tuple[str, int, int, float]]] = lambda: (),
                 unaccounted: Callable[[], Iterable[tuple[str, int]]] = lambda: ()) -> None:
        r = self.registry = CollectorRegistry()
        self._cache: dict[tuple[object, ...], _Tally] = {}
        r.register(_Flush(self.flush))
        self._requests = Counter("atomesh_requests", "Client requests by route and status",
                                 ["route", "status"], registry=r)
        self._latency = Histogram("atomesh_request_duration_seconds", "Client request latency, "
                                  "first byte in to last byte out", ["route"], buckets=LATENCY_BUCKETS,
                                  registry=r)
        self._ttft = Histogram("atomesh_ttft_seconds", "Time to the first streamed byte", ["route"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self._leg = Histogram("atomesh_leg_duration_seconds", "Duration of each leg of a request",
                              ["leg"], buckets=LATENCY_BUCKETS, registry=r)
        self._upstream_errors = Counter("atomesh_upstream_errors", "Failed calls to workers",
                                        ["leg", "kind"], registry=r)
        self._retries = Counter("atomesh_retries", "Legs retried on another worker, by the leg that failed",
                                ["leg"], registry=r)
        self._releases = Counter("atomesh_kv_release_requests", "POST /kv/release sent by the mesh",
                                 ["reason", "outcome"], registry=r)
        self.healthy = Gauge("atomesh_workers_healthy", "Healthy workers by role", ["role"], registry=r,
                             multiprocess_mode="livemax")
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._live = (_InFlight(in_flight), _Registry(registry), _Ledger(ledger), _Unaccounted(unaccounted))
        if not self.multiprocess:   # else mirrored by sync_live()
            for c in self._live:
                r.register(c)
            r.register(_BadRequests())
        self._terminal = Counter("atomesh_kv_terminal", "Transfers ended, by terminal state and reason",
                                 ["state", "reason"], registry=r)
        self._release_latency = Histogram("atomesh_kv_release_seconds", "Prefill done -> blocks freed",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self._dup_releases = Counter("atomesh_kv_duplicate_releases", "Releases the holder had already done",
                                     registry=r)
        self._drains = Counter("atomesh_kv_drains", "Drain legs run for orphaned transfers (engines without "
                               "a release API), by outcome", ["outcome"], registry=r)
        self._unreclaimable = Counter("atomesh_kv_unreclaimable", "Orphaned transfers the mesh could not free",
                                      ["pipeline"], registry=r)
        self._paced = Counter("atomesh_loop_paced_periods", "Periods the loop slept out while pacing bursty "
                              "streams (mesh serve --pace-us)", registry=r)
        self._paced_s = Counter("atomesh_loop_paced_seconds", "Seconds the loop slept while pacing", registry=r)
        self.pacer: Pacer | None = None      # its sleeps are folded in at `flush`
        self._pacer_seen = (0, 0.0)
        self.exposed = r                     # what /metrics renders
        self._mirrors: dict[str, Gauge] = {}
        self._mirrored: dict[str, set[tuple[str, ...]]] = {}
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)  # type: ignore[no-untyped-call]  # untyped upstream
            self.exposed.register(_BadRequests())   # this process's parser refusals only

    def flush(self) -> None:
        """The request path's tallies into prometheus-client's metrics (in multiprocess mode, its
        files): on every read of the registry, and from `sync_live`."""
        for t in self._cache.values():
            t.fold()
        p = self.pacer
        if p is not None and p.naps != self._pacer_seen[0]:
            n, slept = p.naps, p.slept
            self._paced.inc(n - self._pacer_seen[0])
            self._paced_s.inc(slept - self._pacer_seen[1])
            self._pacer_seen = (n, slept)

    def sync_live(self) -> None:
        """Multiprocess mode: this process's live gauges into the shared files (see the docstring),
        and its tallies (`flush`)."""
        if not self.multiprocess:
            return
        self.flush()
        for c in self._live:
            for fam in c.collect():
                mode: Literal["livesum", "livemax"] = "livesum" if fam.name in _SUMMED else "livemax"
                g = self._mirrors.get(fam.name)
                labels = tuple(getattr(fam, "_labelnames", ()))
                if g is None:
                    g = self._mirrors[fam.name] = Gauge(fam.name, fam.documentation, labels, registry=None,
                                                        multiprocess_mode=mode)
                seen = set()
                for smp in fam.samples:
                    key = tuple(smp.labels[k] for k in g._labelnames)
                    (g.labels(*key) if key else g).set(smp.value)
                    seen.add(key)
                for gone in self._mirrored.get(fam.name, set()) - seen:
                    g.remove(*gone)
                self._mirrored[fam.name] = seen

    def _child(self, metric: Any, *labels: str) -> _Tally:
        key = (id(metric), *labels)
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = _Tally(metric.labels(*labels) if labels else metric)
        return c

    def request_done(self, route: str, status: int, seconds: float) -> None:
        self._child(self._requests, route, str(status)).inc()
        self._child(self._latency, route).observe(seconds)

    def ttft(self, route: str, seconds: float) -> None:
        self._child(self._ttft, route).observe(seconds)

    def leg(self, leg: str, seconds: float) -> None:
        self._child(self._leg, leg).observe(seconds)

    def upstream_error(self, leg: str, kind: str) -> None:
        self._child(self._upstream_errors, leg, kind).inc()

    def retry(self, leg: str) -> None:
        self._child(self._retries, leg).inc()

    def release_sent(self, reason: str, outcome: str) -> None:
        self._child(self._releases, reason, outcome).inc()

    def kv_terminal(self, state: str, reason: str, held_s: float | None) -> None:
        self._child(self._terminal, state, reason).inc()
        if held_s is not None:
            self._child(self._release_latency).observe(held_s)

    def drain(self, outcome: str) -> None:
        self._child(self._drains, outcome).inc()

    def unreclaimable(self, pipeline: str) -> None:
        self._child(self._unreclaimable, pipeline).inc()

    def duplicate_release(self) -> None:
        self._child(self._dup_releases).inc()

    def set_healthy(self, counts: Mapping[str, int]) -> None:
        for role in ("prefill", "decode", "worker"):
            self.healthy.labels(role).set(counts.get(role, 0))
