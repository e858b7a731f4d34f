"""The run's figures in Prometheus's text format, for `dflash-queue metrics`: the same snapshot `status` shows.

A collector turns one `collect_status` snapshot into metric families, so a scrape and `status` cannot disagree;
snapshots are kept for `cache_s` seconds, so a burst of scrapes (several Prometheus servers, a dashboard reload)
asks Redis and the workers once. What Flower's own `/metrics` already gives (task events, runtimes, workers online)
is left to Flower.

Names follow Prometheus's conventions (what `prometheus_client` writes): `dflash_queue_` first, counters of what
only grows end in `_total`, units in the name (`_seconds`, `_bytes`), labels `run` and `lane`. A figure `status`
does not know (an ETA with no measured rate, running tasks when no worker answered) has no sample rather than a
made-up one. Dead letters are a gauge: requeueing or purging them takes their records away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dflash_queue.ops.status import RunStatus

log = logging.getLogger(__name__)

PREFIX = "dflash_queue_"
DEFAULT_PORT = 9464
DEFAULT_CACHE_S = 5.0
# Labels of the lanes' counters in `status` (LaneSpec.counters) that are not tokens.
SAMPLES_LABEL = "samples"
BYTES_LABEL = "bytes"


def token_kind(label: str) -> str | None:
    """`prompt_tokens` -> `prompt`, `generated_tokens` -> `generated`, `tokens` (whole sequences) -> `sequence`;
    None for a label that counts no tokens."""
    if label == "tokens":
        return "sequence"
    return label.removesuffix("_tokens") if label.endswith("_tokens") else None


class Families:
    """Metric families being filled, created on first use in the order they are named."""

    def __init__(self) -> None:
        self.families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def counter(self, name: str, documentation: str, labels: dict[str, str], value: float) -> None:
        self._add(CounterMetricFamily, name, documentation, labels, value)

    def gauge(self, name: str, documentation: str, labels: dict[str, str], value: float | None) -> None:
        self._add(GaugeMetricFamily, name, documentation, labels, value)

    def _add(
        self,
        kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
        name: str,
        documentation: str,
        labels: dict[str, str],
        value: float | None,
    ) -> None:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = kind(PREFIX + name, documentation, labels=list(labels))
        if value is not None:
            family.add_metric(list(labels.values()), float(value))


def status_families(status: RunStatus) -> list[Metric]:
    """Every figure of the snapshot as metric families (a family with no sample is still declared)."""
    out = Families()
    run = {"run": status.run}
    for lane in status.lanes.values():
        at = {**run, "lane": lane.lane}
        _lane_volume(out, at, lane.totals, lane.rates)
        _queue(out, at, lane.queued, lane.reserved, lane.running, lane.workers)
        out.gauge("held_by_dead_workers", "Messages held by dead workers, not moving until put back.", at,
                  lane.held_by_dead)
        for state, count in (("done", lane.shards_done), ("failed", lane.shards_failed),
                             ("remaining", lane.shards_remaining)):
            out.gauge("shards", "Shards done, failed in, and still to pass through the lane.", {**at, "state": state},
                      count)
        out.gauge("samples_done", "Samples of the shards done in the lane.", at, lane.samples_done)
        out.gauge("dead_letters", "Dead-letter records of the lane (requeue and purge take them away).", at,
                  lane.dead_letters)
        out.gauge("eta_seconds", "Seconds until the lane is done at its rate over the window (none: unknown).", at,
                  lane.eta_s)
        for reason, turns in lane.finish_reasons.items():
            out.counter("turns_finished", "Generated turns by finish reason.", {**at, "reason": reason}, turns)
        _quality(out, at, lane.quality)
        if lane.canary_worst_error is not None or lane.canary_samples:
            out.counter("canary_samples", "Samples the canary recomputed alone.", at, lane.canary_samples)
            out.counter("canary_untestable_shards", "Shards whose canary could not see a leak between sequences.",
                        at, lane.canary_untestable)
            out.counter("canary_window_shards", "Shards whose canary checked a sequence longer than the model's "
                        "window.", at, lane.canary_window)
            out.gauge("canary_worst_relative_error", "The worst relative error a canary sample showed.", at,
                      lane.canary_worst_error)
    _run_figures(out, run, status)
    _audit(out, run, status)
    _live(out, run, status)
    return list(out.families.values())


def _queue(out: Families, at: dict[str, str], queued: int, reserved: int, running: int | None,
           workers: list[str]) -> None:
    out.gauge("queue_depth", "Messages waiting in the lane's queue.", at, queued)
    out.gauge("unacked_messages", "Messages delivered to a worker and not yet acknowledged.", at, reserved)
    out.gauge("running_tasks", "Tasks the lane's workers report running (none: no worker answered).", at, running)
    out.gauge("workers", "Workers consuming the lane's queue that answered the control broadcast.", at, len(workers))


def _lane_volume(out: Families, at: dict[str, str], totals: dict[str, int], rates: dict[str, float]) -> None:
    """Each total a counter and its rate over the window (when `status` measures one) a gauge."""
    for label, total in totals.items():
        rate = rates.get(label)
        kind = token_kind(label)
        if label == SAMPLES_LABEL:
            out.counter("samples", "Samples the lane processed.", at, total)
            out.gauge("samples_per_second", "Samples per second over the status window.", at, rate)
        elif kind is not None:
            out.counter("tokens", "Tokens the lane processed, by kind.", {**at, "kind": kind}, total)
            out.gauge("tokens_per_second", "Tokens per second over the status window, by kind.",
                      {**at, "kind": kind}, rate)
        elif label == BYTES_LABEL:
            out.counter("stored_bytes", "Bytes of output the lane stored.", at, total)
            out.gauge("stored_bytes_per_second", "Bytes stored per second over the status window.", at, rate)


def _quality(out: Families, at: dict[str, str], quality: dict[str, int]) -> None:
    """The gate's `gate_{decision}` per sample and `gate_{check}_{action}` per failed check."""
    for counter, count in quality.items():
        name = counter.removeprefix("gate_")
        check, _, action = name.rpartition("_")
        if check:
            out.counter("quality_gate_checks", "Samples a quality check failed, by check and action taken.",
                        {**at, "check": check, "action": action}, count)
        else:
            out.counter("quality_gate_decisions", "Samples by the quality gate's decision.",
                        {**at, "decision": name}, count)


def _run_figures(out: Families, run: dict[str, str], status: RunStatus) -> None:
    lane = next(iter(status.lanes.values()), None)
    out.gauge("shards_staged", "Shards the run staged.", run, lane.shards_total if lane else 0)
    out.gauge("samples_staged", "Samples the run staged.", run, lane.samples_total if lane else 0)
    out.gauge("run_eta_seconds", "Seconds until the run is done: its slower lane's (none: unknown).", run,
              status.eta_s)
    out.gauge("run_finished", "1 once every shard has passed every lane and is stored.", run, int(status.finished))
    out.gauge("rate_window_seconds", "Seconds the rates are measured over (shorter for a young run).", run,
              status.window_span_s)
    out.gauge("shards_missing", "Shards the ledger shows done whose training file is not in storage.", run,
              len(status.shards_missing))
    out.gauge("storage_listed", "1 when storage could be listed (else done is the ledger's word).", run,
              int(status.storage_error is None))
    out.gauge("stopped_workers", "Workers that stopped because their engine failed its state checks.", run,
              len(status.stopped_workers))
    out.gauge("workers_waiting_for_servers", "Generate workers waiting because every inference server they were "
              "given is down.", run, len(status.servers_down))
    down = {url for waiting in status.servers_down for url in waiting.servers}
    out.gauge("servers_down", "Inference servers a waiting generate worker reports down.", run, len(down))


def _audit(out: Families, run: dict[str, str], status: RunStatus) -> None:
    audit = status.audit
    if audit is None:
        return
    at = {**run, "lane": "audit"}
    # `status` measures the audit's tokens per second, not its samples per second.
    _lane_volume(out, at, {SAMPLES_LABEL: audit.samples, "tokens": audit.tokens}, {"tokens": audit.tokens_per_s})
    _queue(out, at, audit.queued, audit.reserved, audit.running, audit.workers)
    out.counter("audited_shards", "Shards the reference audit audited.", run, audit.shards)
    out.counter("audits_failed", "Reference audits that failed.", run, audit.failed)
    out.counter("audit_busy_seconds", "Time the audit workers spent auditing.", run, audit.busy_s)
    out.gauge("suspect_shards", "Shards a failed audit made suspect, not served until extracted again.", run,
              len(audit.suspects))
    out.gauge("suspect_shards_consumed", "Suspect shards a consumer had been served before they turned suspect.",
              run, len(audit.consumed_suspects))


def _live(out: Families, run: dict[str, str], status: RunStatus) -> None:
    live = status.live
    if live is None:
        return
    out.gauge("epoch", "The latest epoch started.", run, live.epoch)
    out.gauge("window_shards", "Stored shards not yet consumed by every consumer (the window's fill).", run,
              live.window_fill)
    out.gauge("window_size_shards", "The window's size, extract.max_unconsumed_shards (0: no window).", run,
              live.window_size)
    out.gauge("window_waiting", "1 while extraction waits for the window to free.", run, int(live.waiting is not None))
    for consumer in live.consumers:
        out.gauge("consumer_lag_shards", "Shards of the consumer's epoch stored that it has not acknowledged.",
                  {**run, "consumer": consumer.name}, consumer.lag)


class StatusCollector(Collector):
    """Serves `snapshot()` as metric families, each snapshot kept `cache_s` seconds. A snapshot that fails (the
    broker unreachable) gives `dflash_queue_up 0` and is logged, and is asked again at the next scrape."""

    def __init__(
        self,
        run: str,
        snapshot: Callable[[], RunStatus],
        *,
        cache_s: float = DEFAULT_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run = run
        self.snapshot = snapshot
        self.cache_s = cache_s
        self.clock = clock
        self._lock = threading.Lock()
        self._taken_at: float | None = None
        self._families: list[Metric] = []
        self._up = False
        self._took_s = 0.0

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # concurrent scrapes wait for one snapshot rather than each taking their own
            now = self.clock()
            if self._taken_at is None or now - self._taken_at >= self.cache_s:
                self._refresh(now)
            families, is_up, took_s = self._families, self._up, self._took_s
        up = GaugeMetricFamily(PREFIX + "up", "1 when the last snapshot of the run could be taken.", labels=["run"])
        up.add_metric([self.run], 1.0 if is_up else 0.0)
        yield up
        took = GaugeMetricFamily(PREFIX + "snapshot_seconds", "Seconds the last snapshot took.", labels=["run"])
        took.add_metric([self.run], took_s)
        yield took
        yield from families

    def _refresh(self, now: float) -> None:
        started = time.monotonic()
        try:
            self._families = status_families(self.snapshot())
            self._up, self._taken_at = True, now
        except Exception as exc:  # a scrape answers what it can: up 0 says the rest is missing
            log.warning("run %s: no snapshot: %s: %s", self.run, type(exc).__name__, exc)
            self._families = []
            self._up, self._taken_at = False, None
        self._took_s = time.monotonic() - started


def serve_metrics(collector: StatusCollector, *, address: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve `collector` alone (no process metrics of this exporter) on http://address:port/metrics from a
    daemon thread; returns the server (`shutdown()` stops it) and its thread."""
    registry = CollectorRegistry()
    registry.register(collector)
    return start_http_server(port, addr=address, registry=registry)
