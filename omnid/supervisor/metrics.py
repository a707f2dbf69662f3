"""Prometheus metrics (prometheus_client), served at `GET /metrics`.

Runs in the supervisor's event-loop thread. Job counters are updated by the
scheduler; per-stage figures are read at scrape time from each stage's last
heartbeat (queue depth, enqueue/dequeue counts, time blocked on a downstream
watermark, window triggers, DiT cache hits and misses), folded across worker restarts so counters never
go backwards.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from omnid import __version__

if TYPE_CHECKING:
    from omnid.supervisor.jobs.streams import RealtimeState
    from omnid.supervisor.resources import ConnectionGuard, DiskWatch
    from omnid.supervisor.workers.stage import StageHandle
    from omnid.supervisor.workers.stage_group import StageGroup

_LABELS = ["stage", "replica"]


class _StreamsCollector:
    """The real-time pipelines' measured capacity and their streams (omnid/supervisor/jobs/streams.py)."""

    def __init__(self) -> None:
        self.snapshots: Callable[[], dict[str, RealtimeState]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        cap = GaugeMetricFamily("omnid_pipeline_capacity_audio_seconds_per_second", "Audio seconds a second a "
                                "real-time pipeline can make, measured from its stages' step times", labels=["pipeline"])
        streams = GaugeMetricFamily("omnid_pipeline_streams", "A real-time pipeline's streams: running, waiting for "
                                    "capacity, and how many its capacity admits", labels=["pipeline", "state"])
        refused = CounterMetricFamily("omnid_pipeline_streams_refused", "Streams refused with 503 over_capacity",
                                      labels=["pipeline"])
        for name, snap in (self.snapshots() if self.snapshots else {}).items():
            rate = snap["audio_per_s"]
            if rate is not None:
                cap.add_metric([name], float(rate))
                streams.add_metric([name, "admits"], float(snap.get("streams") or 0))
            streams.add_metric([name, "running"], float(snap["running"]))
            streams.add_metric([name, "waiting"], float(snap["waiting"]))
            refused.add_metric([name], float(snap["refused"]))
        yield cap
        yield streams
        yield refused


class _StageCollector(Collector):
    """Per worker: labels `stage` and `replica` ("0" for a stage of one); and per stage, its state."""

    def __init__(self, stages: Mapping[str, "StageGroup"]) -> None:
        self.stages = stages

    def _workers(self) -> Iterator[tuple[list[str], "StageHandle"]]:
        for group in list(self.stages.values()):
            for h in group.replicas:
                yield [h.name, str(h.replica)], h

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from self._counters()
        yield from self._per_worker()
        yield from self._per_stage()
        yield self._windows()

    def _counters(self) -> Iterator[CounterMetricFamily]:
        counters = {
            "enqueued": ("omnid_stage_enqueued", "Items admitted into the stage's input queue"),
            "dequeued": ("omnid_stage_dequeued", "Items taken from the stage's input queue"),
            "dropped": ("omnid_stage_dropped", "Items dropped because their job had ended"),
            "blocked_s": ("omnid_stage_blocked_seconds", "Time spent blocked on a downstream high watermark"),
            "window_triggers": ("omnid_stage_window_triggers", "Hand-offs that triggered a downstream stage"),
            "cache_hits": ("omnid_stage_cache_hits", "DiT cache (a diffusers stage's `cache`): transformer calls "
                           "that skipped the remaining blocks"),
            "cache_misses": ("omnid_stage_cache_misses", "DiT cache: transformer calls that ran every block"),
        }
        for field, (name, doc) in counters.items():
            fam = CounterMetricFamily(name, doc, labels=_LABELS)
            for labels, h in self._workers():
                fam.add_metric(labels, getattr(h.totals, field) + getattr(h.stats, field))
            yield fam

    def _per_worker(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        depth = GaugeMetricFamily("omnid_stage_queue_depth", "Items waiting in the stage's input queue",
                                  labels=_LABELS)
        cap = GaugeMetricFamily("omnid_stage_queue_capacity", "The input queue's high watermark", labels=_LABELS)
        up = GaugeMetricFamily("omnid_stage_up", "1 when the stage's worker is warm (ready or busy)",
                               labels=_LABELS)
        gpu = GaugeMetricFamily("omnid_stage_gpu_memory_bytes", "GPU memory the stage's worker holds (as "
                                "nvidia-smi counts it, by NVML; else torch's reserved memory; absent on the CPU)", labels=_LABELS)
        rss = GaugeMetricFamily("omnid_stage_rss_bytes", "Resident memory of the stage's worker and its children",
                                labels=_LABELS)
        restarts = CounterMetricFamily("omnid_stage_restarts", "Worker restarts", labels=_LABELS)
        rss_restarts = CounterMetricFamily("omnid_stage_rss_restarts", "Workers restarted between jobs for being "
                                           "over the stage's max_rss_mb (a leak guard)", labels=_LABELS)
        done = CounterMetricFamily("omnid_stage_jobs_done", "Jobs the stage finished", labels=_LABELS)
        shm_used = GaugeMetricFamily("omnid_stage_shm_used_bytes",
                                     "Bytes of the stage's shared-memory pool held by values in flight", labels=_LABELS)
        shm_cap = GaugeMetricFamily("omnid_stage_shm_capacity_bytes", "The stage's shared-memory pool size",
                                    labels=_LABELS)
        shm_slots = GaugeMetricFamily("omnid_stage_shm_slots", "Slots of the pool taken", labels=_LABELS)
        for labels, h in self._workers():
            depth.add_metric(labels, h.stats.depth)
            cap.add_metric(labels, h.stage.queue_capacity)
            up.add_metric(labels, 1 if h.state.warm else 0)
            restarts.add_metric(labels, h.restarts)
            rss_restarts.add_metric(labels, h.rss_restarts)
            done.add_metric(labels, h.jobs_done)
            shm_used.add_metric(labels, h.stats.shm_used)
            shm_cap.add_metric(labels, h.stats.shm_capacity)
            shm_slots.add_metric(labels, h.stats.shm_slots)
            if h.gpu_memory_bytes is not None:
                gpu.add_metric(labels, h.gpu_memory_bytes)
            usage = h.usage()
            if usage is not None:
                rss.add_metric(labels, usage)
        yield from (depth, cap, up, restarts, rss_restarts, done, shm_used, shm_cap, shm_slots, gpu, rss)

    def _per_stage(self) -> Iterator[GaugeMetricFamily]:
        sleeping = GaugeMetricFamily("omnid_stage_sleeping", "1 while the stage sleeps (idle_unload_s, or by "
                                     "hand): its workers are stopped until a job wakes it", labels=["stage"])
        replicas = GaugeMetricFamily("omnid_stage_replicas", "Replicas the stage is configured with",
                                     labels=["stage"])
        serving = GaugeMetricFamily("omnid_stage_replicas_up", "Replicas of the stage that are warm (ready or busy)",
                                    labels=["stage"])
        for group in list(self.stages.values()):
            sleeping.add_metric([group.name], 1 if group.sleeping else 0)
            replicas.add_metric([group.name], group.stage.replicas)
            serving.add_metric([group.name], sum(1 for h in group.replicas if h.state.warm))
        yield from (sleeping, replicas, serving)

    def _windows(self) -> CounterMetricFamily:
        windows = CounterMetricFamily("omnid_edge_windows", "Windows a streaming edge carried downstream",
                                      labels=["src", "dst"])
        sent: dict[tuple[str, str], int] = {}
        for _, h in self._workers():
            for dst in set(h.windows) | set(h.windows_before):
                sent[(h.name, dst)] = sent.get((h.name, dst), 0) + h.windows.get(dst, 0) + h.windows_before.get(dst, 0)
        for (src, dst), n in sorted(sent.items()):
            windows.add_metric([src, dst], n)
        return windows


class _ResourceCollector(Collector):
    """The state dir's disk and the client connections, read at scrape time (`Metrics.watch`)."""

    def __init__(self) -> None:
        self.disk: DiskWatch | None = None
        self.guard: ConnectionGuard | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        if self.disk is not None:
            state = self.disk.check()
            yield GaugeMetricFamily("omnid_disk_free_bytes", "Free space on the state dir's filesystem "
                                    "(for the daemon's user)", value=state.free_bytes)
            yield GaugeMetricFamily("omnid_disk_min_free_bytes", "daemon.min_free_mb, in bytes",
                                    value=self.disk.min_free_bytes)
            if state.free_inodes is not None:
                yield GaugeMetricFamily("omnid_disk_free_inodes", "Free inodes on the state dir's filesystem",
                                        value=state.free_inodes)
            yield GaugeMetricFamily("omnid_disk_full", "1 while the daemon refuses jobs for want of disk space "
                                    "(/v1/ready: disk_full)", value=int(state.full))
            yield GaugeMetricFamily("omnid_store_write_failing", "1 while the job store's writes fail "
                                    "(kept in memory and retried)", value=int(state.store_failing is not None))
            yield GaugeMetricFamily("omnid_disk_ballast_bytes", "The ballast file's size (0: given back)",
                                    value=self.disk.ballast_bytes if state.ballast else 0)
            yield CounterMetricFamily("omnid_disk_ballast_releases", "Times the ballast was given back to let "
                                      "a write through", value=self.disk.released)
        if self.guard is not None:
            conns = self.guard.connections()
            yield GaugeMetricFamily("omnid_connections_open", "Client connections open on the API",
                                    value=len(conns) if conns is not None else 0)
            yield GaugeMetricFamily("omnid_connections_limit", "Client connections taken before 503 "
                                    "too_many_connections (from RLIMIT_NOFILE)", value=self.guard.limit)
            yield CounterMetricFamily("omnid_connections_refused", "Requests answered 503 too_many_connections",
                                      value=self.guard.refused)


class _GcPauses(Collector):
    """The supervisor's cyclic garbage collections: how long each stood (a `gc.callbacks` entry; every
    one stops the event loop, and every live stream's next token with it), and the objects frozen out
    of the collector's sight at start (daemon._freeze_heap). The callback counts into plain lists and
    takes no lock: a collection may start inside any code, a lock's holder's too (prometheus_client's
    metrics hold a Lock while they allocate), so the histogram is made at scrape time."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

    def __init__(self) -> None:
        self._began = 0.0
        self._counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]     # per generation, per bucket (+Inf last)
        self._sums = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took, gen = time.perf_counter() - self._began, info["generation"]
        self._counts[gen][bisect.bisect_left(self.BUCKETS, took)] += 1
        self._sums[gen] += took

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        pauses = HistogramMetricFamily("omnid_gc_pause_seconds", "The supervisor's cyclic garbage collections, "
                                       "each a stop of its event loop", labels=["generation"])
        bounds = [str(b) for b in self.BUCKETS] + ["+Inf"]
        for gen, counts in enumerate(self._counts):
            pauses.add_metric([str(gen)], list(zip(bounds, itertools.accumulate(counts), strict=True)),
                              sum_value=self._sums[gen])
        yield pauses
        yield GaugeMetricFamily("omnid_gc_frozen_objects", "Objects the daemon's start made, which the cyclic "
                                "garbage collector no longer walks (frozen once the daemon is ready)",
                                value=gc.get_freeze_count())


class Metrics:
    def __init__(self, stages: Mapping[str, "StageGroup"]) -> None:
        self.registry = CollectorRegistry()
        self.submitted = Counter("omnid_jobs_submitted", "Jobs accepted", ["pipeline"], registry=self.registry)
        self.finished = Counter("omnid_jobs_finished", "Jobs that reached a terminal state",
                                ["pipeline", "state"], registry=self.registry)
        self.duration = Histogram("omnid_job_duration_seconds", "Submit-to-end time of jobs", ["pipeline"],
                                  buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
                                  registry=self.registry)
        # The standard series of a Prometheus exporter: the daemon process's CPU, memory and fds,
        # Python's GC, the platform; and which omnid this is.
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        Info("omnid_build", "The omnid daemon's version", registry=self.registry).info({"version": __version__})
        self.queue_wait = Histogram("omnid_job_queue_wait_seconds", "Submit to the job's first stage starting it",
                                    ["pipeline"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                                           30, 60, 300, 1800), registry=self.registry)
        self.stage_duration = Histogram("omnid_stage_duration_seconds", "Time one job spent in a stage's engine",
                                        ["stage"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                                            30, 60, 300, 1800), registry=self.registry)
        self.segments = Counter("omnid_stage_segments", "Segments a stage streamed (for a vLLM stage, tokens: its "
                                "rate is tokens per second)", ["stage"], registry=self.registry)
        self.first_segment_s = Histogram(
            "omnid_first_segment_seconds", "Submit to the first segment of a pipeline's last stage",
            ["pipeline"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry)
        # Audio (a pipeline whose last stage streams WAV): named after vLLM-Omni's.
        self.first_audio_s = Histogram(
            "omnid_time_to_first_audio_seconds", "Submit to the first audio packet of a job's last stage",
            ["pipeline"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60), registry=self.registry)
        self.rtf = Histogram("omnid_audio_real_time_factor", "A job's time over the length of its audio "
                             "(below 1: faster than it plays)", ["pipeline"],
                             buckets=(0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16), registry=self.registry)
        self.slack = Histogram("omnid_stream_slack_seconds", "A stream's audio still to play at its listener when "
                               "its next packet came (below 0: the packet was late)", ["pipeline"],
                               buckets=(-1, -0.25, -0.02, 0, 0.1, 0.25, 0.5, 1, 2, 4, 8), registry=self.registry)
        self._streams = _StreamsCollector()
        self.registry.register(self._streams)
        self.underruns = Counter("omnid_audio_underruns", "Audio packets that came after the audio before them had "
                                 "finished playing (played from the first packet on)", ["pipeline"],
                                 registry=self.registry)
        self.registry.register(_StageCollector(stages))
        self._resources = _ResourceCollector()
        self.registry.register(self._resources)
        _waits = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
        self.stage_wait = Histogram("omnid_stage_queue_wait_seconds", "A job's input entering a stage's queue to "
                                    "the stage starting it", ["stage"], buckets=_waits, registry=self.registry)
        self.handoff_s = Histogram("omnid_edge_handoff_seconds", "An upstream stage's outputs being there (its "
                                   "end; its first segment on a streaming edge) to the downstream admitting them",
                                   ["src", "dst"], buckets=_waits, registry=self.registry)
        self._gc = _GcPauses()
        self.registry.register(self._gc)
        self.refused = Counter("omnid_jobs_refused", "Submits refused for want of a resource (507 disk_full)",
                               ["reason"], registry=self.registry)

    def watch_gc(self) -> None:
        """Time this process's garbage collections from now on (the daemon's; one watcher a process)."""
        gc.callbacks[:] = [c for c in gc.callbacks if not isinstance(c, _GcPauses)]
        gc.callbacks.append(self._gc)

    def watch(self, disk: DiskWatch | None, guard: ConnectionGuard | None) -> None:
        """Report these resources too (the daemon, once it has made them)."""
        self._resources.disk, self._resources.guard = disk, guard

    def job_started(self, pipeline: str, waited_s: float, trace_id: str | None = None) -> None:
        self.queue_wait.labels(pipeline).observe(waited_s, _exemplar(trace_id))

    def stage_queue_wait(self, stage: str, seconds: float, trace_id: str | None = None) -> None:
        """A job's input entered the stage's queue -> the stage started it."""
        self.stage_wait.labels(stage).observe(seconds, _exemplar(trace_id))

    def handoff(self, src: str, dst: str, seconds: float, trace_id: str | None = None) -> None:
        """An upstream's outputs were there (its end; its first segment on a streaming edge) -> the
        downstream admitted them."""
        self.handoff_s.labels(src, dst).observe(seconds, _exemplar(trace_id))

    def stage_finished(self, stage: str, seconds: float) -> None:
        self.stage_duration.labels(stage).observe(seconds)

    def segments_streamed(self, stage: str, count: int) -> None:
        self.segments.labels(stage).inc(count)

    def first_segment(self, pipeline: str, seconds: float, trace_id: str | None = None) -> None:
        self.first_segment_s.labels(pipeline).observe(seconds, _exemplar(trace_id))

    def first_audio(self, pipeline: str, seconds: float) -> None:
        self.first_audio_s.labels(pipeline).observe(seconds)

    def stream_slack(self, pipeline: str, seconds: float) -> None:
        self.slack.labels(pipeline).observe(seconds)

    def watch_streams(self, snapshots: Callable[[], dict[str, RealtimeState]]) -> None:
        """Report the real-time pipelines' capacity and streams (the scheduler's gate, once it exists)."""
        self._streams.snapshots = snapshots

    def audio_underrun(self, pipeline: str) -> None:
        self.underruns.labels(pipeline).inc()

    def real_time_factor(self, pipeline: str, rtf: float) -> None:
        self.rtf.labels(pipeline).observe(rtf)

    def job_submitted(self, pipeline: str) -> None:
        self.submitted.labels(pipeline).inc()

    def job_finished(self, pipeline: str, state: str, seconds: float, trace_id: str | None = None) -> None:
        self.finished.labels(pipeline, state).inc()
        self.duration.labels(pipeline).observe(seconds, _exemplar(trace_id))


def _exemplar(trace_id: str | None) -> dict[str, str] | None:
    """A histogram sample's exemplar: the trace of a job it counts (shown in the OpenMetrics format,
    `Accept: application/openmetrics-text`)."""
    return {"trace_id": trace_id} if trace_id else None
