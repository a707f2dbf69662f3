"""Real-time pipelines (`[pipelines.X] realtime = {...}`): their capacity, measured online, and
admission by it.

Runs in the supervisor's event-loop thread; nothing here blocks (it reads the stage handles'
latest heartbeats, and the scheduler's own accounts of each job's audio).

A real-time pipeline's jobs are streams that a listener plays as they come: each needs one audio
second a second once it plays. How many the pipeline can serve at once is measured, not
configured (`Meter`): every second the scheduler samples, per stage of the pipeline, the seconds its
workers spent stepping their engines (`busy_s`) and the CPU seconds they used (`cpu_s`), both from
the workers' heartbeats, and the audio seconds the pipeline's jobs have made. Over a window of
WINDOW_S / 2 to WINDOW_S seconds (longer while streams start: `Meter.sample`), the work one audio
second costs is
    per stage:        busy seconds / audio seconds (a stage steps one batch at a time), and
    the CPU stages:   their CPU seconds, together, / audio seconds / the host's cores,
and the pipeline makes at most 1 / (the largest of those) audio seconds a second. A stage's
seconds come with its heartbeats (one a second), its audio with each packet: each stage's work is
divided by the audio heard between the two heartbeats that bound its window (`as_of`), not between
the two samples, or a window whose first heartbeat was a second staler than its last would count
a second more work than audio (a quarter of a 4 s window: the test pipeline read a cost under its
stage's physical bound, and admitted a stream past it). The figure is
kept as a moving average; it follows a stage that slows down within a few windows, and rises as
batching makes a stream cheaper. The work of the batch sizes the stages actually ran is what is
measured: a pipeline seen at one stream only knows what one stream costs (a lower bound on its
capacity), and learns the rest as it runs more.

Admission (`Gate`): a new stream starts only while the streams running stay under `margin` x the
capacity (and one always may, on an idle pipeline). Otherwise, by the pipeline's `overload`:
"refuse" answers 503 `over_capacity` with a Retry-After of when the first running stream should end;
"queue" (the default) keeps the job queued, not yet given to its first stage, in a line ordered as
every queue is (priority, then fair share: `LiveJob.rank`), up to `max_waiting_streams` (then 503 as
"refuse"). A waiting stream shows its place and estimated start (`waiting`). When a stream ends, or
capacity rises, the next ones start. A non-streamed job of the pipeline counts as a stream: it takes
the same work.

A stream's start has a cost of its own: its first stage makes its first audio in a burst (a codec
LM makes a whole answer's codes in about a second) while the streams that began just before it are
still filling their listeners' buffers. With `start_slack_s`, a new stream that has room also waits
(never refused for it) until every running stream that began less than RAMP_S ago holds that much
audio at its listener (one with no audio yet holds none), or MAX_HOLD_S has passed: the audio each
packet adds is what lets the next one go (`heard`), and a loaded pipeline, whose streams gain slack
slowly, delays a start by a second at most.

Ready means warm: the pipeline takes streams only after a warm-up job (`realtime.warmup`'s inputs)
has gone through its stages, at start and after a restart of one of them; meanwhile streams wait
(or are refused). That job is also the capacity's first measurement, a provisional one (its steps
are cold): the first window of real streams replaces it.
"""

from __future__ import annotations

import bisect
import heapq
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from typing_extensions import TypedDict

from omnid.config_types import Overload, PipelineConfig, RealtimeConfig
from omnid.supervisor.errors import Refused
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.jobs.live_job import LiveJob
    from omnid.supervisor.workers.stage_group import StageGroup

log = structlog.get_logger("omnid.streams")


WINDOW_S = 8.0          # the capacity's measuring window
LOWER_S = 2 * WINDOW_S  # while streams start, the window grows up to this (see Meter.sample)
MIN_AUDIO_S = 1.0       # a window's audio below this measures nothing (an idle pipeline keeps its figure)
SMOOTHING = 0.5         # the moving average's weight of a new window
DEFAULT_STREAM_S = 10.0     # a stream's expected length before one has ended (for estimates), without a warm-up's
MIN_WARM_LENGTH_S = 0.1     # a warm-up shorter than this (it failed at once) says nothing of a stream's length
WARM_GRACE_S = 2.0      # a warm-up's last busy seconds come with the workers' next stats: cold until then
RAMP_S = 3.0            # `start_slack_s`: the streams that began this recently are waited for,
MAX_HOLD_S = 1.0        # and for no longer than this (a loaded pipeline's streams gain slack slowly)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class RealtimeState(TypedDict):
    """A real-time pipeline's capacity and streams (`realtime` of GET /v1/pipelines, /v1/stages)."""

    overload: Overload
    margin: float
    max_waiting_streams: int
    warm: bool
    audio_per_s: float | None
    """audio seconds a second the pipeline can make, measured from its stages' step times (null until measured)"""
    streams: int | None
    """how many streams its capacity admits at once"""
    running: int
    waiting: int
    refused: int
    cost_per_audio_s: dict[str, float]
    """per stage (and `cpu`, the CPU stages together over the host's cores): seconds of work an audio second costs"""


class StreamPlace(TypedDict, total=False):
    """a real-time pipeline's job: while it waits for capacity, its `position` (1: next),
    `estimated_start_s` and how many are `running`; once it plays, the `audio_s` sent, its listener's
    `slack_s` (audio still to play; below 0: late) and `late_packets`"""

    position: int
    estimated_start_s: float | None
    running: int
    audio_s: float
    slack_s: float
    late_packets: int


@dataclass
class _Sample:
    at: float                               # monotonic
    audio_s: float                          # the pipeline's audio made, in total
    busy: dict[str, float]                  # stage -> its workers' busy seconds (all replicas), in total
    cpu: dict[str, float]                   # stage -> their CPU seconds, in total
    heard: dict[str, float]                 # stage -> the audio made, in total, when its busy and CPU seconds were


@dataclass
class Meter:
    """A pipeline's capacity in audio seconds a second, from its stages' own step times."""

    stages: tuple[str, ...]
    on_cpu: frozenset[str]                  # stages whose work runs on the host's CPU cores
    audio_s: float = 0.0                    # audio its jobs have made since the daemon started
    audio_per_s: float | None = None        # the estimate (None until measured)
    cost: dict[str, float] = field(default_factory=dict)    # what bounds it, per stage and "cpu": s a second
    provisional: bool = False               # the estimate was measured cold (a warm-up's)
    _cold: bool = False
    _started_in: bool = False               # a stream started during the window now measured
    _samples: deque[_Sample] = field(default_factory=deque)
    _heard_at: list[float] = field(default_factory=list)       # when audio was heard (monotonic), in order,
    _heard_total: list[float] = field(default_factory=list)    # and the total after it
    _heard_before: float = 0.0              # the total before the first of those (older ones are let go)

    def heard(self, seconds: float, now: float) -> None:
        """The pipeline made `seconds` of audio (a packet), at `now` (monotonic)."""
        self.audio_s += seconds
        if self._heard_at and now <= self._heard_at[-1]:
            self._heard_total[-1] = self.audio_s
        else:
            self._heard_at.append(now)
            self._heard_total.append(self.audio_s)

    def audio_at(self, t: float) -> float:
        """The audio made, in total, at `t` (monotonic): as heard up to then."""
        i = bisect.bisect_right(self._heard_at, t)
        return self._heard_total[i - 1] if i else self._heard_before

    def sample(self, now: float, busy: Mapping[str, float], cpu: Mapping[str, float], cold: bool = False,
               as_of: Mapping[str, float] | None = None, starting: bool = False) -> None:
        """`as_of`: per stage, when its busy and CPU seconds were taken (its latest heartbeat's,
        monotonic); without it, now. `starting`: a stream began less than RAMP_S ago. A start's
        work comes before its audio (the thinker's prefill, a codec LM's burst): a short window that
        holds it reads a stream dearer than it is (the demo's omni read 6 slots after a lone stream
        and 4 two seconds into a wave of 6, whose last ones then waited for the first to end). So
        while streams start, no estimate is made (the window grows, up to LOWER_S), and a window
        that held a start is measured over WINDOW_S at least, not half: the starts' work is
        counted with the audio that follows it. (Either way: a window that took only the rises
        at once would pick the noise's highs.) `cold`: the pipeline is warming up. Its warm-up's first steps
        load and compile (the demo's omni read 0.2-0.6 audio s/s from them, a tenth of what it makes
        warm): a figure measured cold (the warm-up's whole window, at its end) is provisional, and
        the first warm window's replaces it instead of joining the average; that window starts at
        the first warm sample."""
        heard = {st: self.audio_at(min(now, as_of.get(st, now))) if as_of is not None else self.audio_s
                 for st in self.stages}
        s = _Sample(now, self.audio_s, dict(busy), dict(cpu), heard)
        self._forget(now - 2 * WINDOW_S)
        if self._samples and any(busy.get(k, 0.0) < v for k, v in self._samples[-1].busy.items()):
            self._samples.clear()           # a worker restarted: its counters began again
        warmed, self._cold = self._cold and not cold, cold
        self._started_in = self._started_in or starting
        self._samples.append(s)
        while len(self._samples) > 2 and now - self._samples[1].at >= LOWER_S:
            self._samples.popleft()
        first = self._samples[0]
        audio = s.audio_s - first.audio_s
        span = now - first.at
        if warmed:
            if audio >= MIN_AUDIO_S:
                self._estimate(first, s, provisional=True)
            self._samples = deque([s])
            self._started_in = starting
        elif (span >= (WINDOW_S if self._started_in else WINDOW_S / 2) and audio >= MIN_AUDIO_S
              and (not starting or span >= LOWER_S)):
            if self._estimate(first, s, provisional=cold):
                self._started_in = starting

    def _forget(self, before: float) -> None:
        """Let go of the audio heard before `before` (kept: its total)."""
        i = bisect.bisect_left(self._heard_at, before)
        if i:
            self._heard_before = self._heard_total[i - 1]
            del self._heard_at[:i], self._heard_total[:i]

    def _estimate(self, first: _Sample, s: _Sample, provisional: bool) -> bool:
        """The figure from the window `first`..`s` (True: made; the next window starts at `s`)."""
        # each stage's seconds over the audio heard between its own two heartbeats
        heard = {st: s.heard[st] - first.heard[st] for st in self.stages}
        if any(a < MIN_AUDIO_S / 2 for a in heard.values()):
            return False                    # (a stage with no fresh heartbeat in the window: wait for one)
        cost = {st: max(0.0, s.busy.get(st, 0.0) - first.busy.get(st, 0.0)) / heard[st] for st in self.stages}
        cpu_cost = sum(max(0.0, s.cpu.get(st, 0.0) - first.cpu.get(st, 0.0)) / heard[st] for st in self.on_cpu) / CORES
        if self.on_cpu:
            cost["cpu"] = cpu_cost
        worst = max(cost.values(), default=0.0)
        if worst <= 0:
            return False
        new = 1.0 / worst
        old = None if self.provisional else self.audio_per_s
        self.audio_per_s = new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
        self.provisional = provisional
        self.cost = {k: round(v, 4) for k, v in cost.items()}
        self._samples = deque([s])          # (the next window starts here: estimates do not overlap)
        return True


@dataclass
class Streams:
    """One real-time pipeline's streams: those running, those waiting, and its meter."""

    name: str
    config: RealtimeConfig
    meter: Meter
    running: dict[str, float] = field(default_factory=dict)    # job -> when it started (monotonic)
    waiting: list[LiveJob] = field(default_factory=list)       # in the order they start
    warm: bool = False
    warm_at: float = 0.0                    # when it became warm (monotonic)
    warming: str | None = None              # the warm-up job in flight
    superseded: set[str] = field(default_factory=set)   # warm-ups of a worker that died since: they warm nothing
    lengths: deque[float] = field(default_factory=lambda: deque(maxlen=32))   # ended streams' durations
    warm_length: float | None = None        # the last warm-up's duration: the expected length until a stream ends
    refused: int = 0
    held_since: float | None = None         # the next stream has had room, and waited for the ramps, since then

    @property
    def slots(self) -> float:
        """Streams that fit: margin x the capacity (one stream a measured audio second a second)."""
        if self.meter.audio_per_s is None:
            return 1.0
        return self.config.margin * self.meter.audio_per_s

    def has_room(self, ahead: int = 0) -> bool:
        """Capacity for one more stream after the running ones and `ahead` others (an idle pipeline
        always takes one)."""
        taken = len(self.running) + ahead
        return self.warm and (not taken or taken + 1 <= self.slots)

    def ramped(self, plays_until: Callable[[str], float | None]) -> bool:
        """`start_slack_s`: every stream that began less than RAMP_S ago holds that much audio at its
        listener (`plays_until(job)`: when its audio runs out, wall clock; None before its first),
        or the next stream has waited MAX_HOLD_S for that already."""
        need = self.config.start_slack_s
        mono, wall = time.monotonic(), time.time()
        if need <= 0 or (self.held_since is not None and mono - self.held_since >= MAX_HOLD_S):
            self.held_since = None
            return True
        for job in self.starting(mono):
            until = plays_until(job)
            if until is None or until - wall < need:
                if self.held_since is None:
                    self.held_since = mono
                return False
        self.held_since = None
        return True

    def starting(self, now: float) -> list[str]:
        """The streams that began less than RAMP_S before `now` (monotonic), warm-ups aside."""
        return [job for job, began in self.running.items()
                if now - began < RAMP_S and job != self.warming and job not in self.superseded]

    def expected_length(self) -> float:
        """A stream's expected duration: the ended streams' mean; before one has ended, the warm-up's
        (the same pipeline and defaults, measured cold: no shorter than a warm stream), else
        DEFAULT_STREAM_S. (The demo's tts: 10 s, then about 1 s; its Retry-After and queued starts
        were ten times too far off until a stream had ended.)"""
        if self.lengths:
            return sum(self.lengths) / len(self.lengths)
        return self.warm_length if self.warm_length is not None else DEFAULT_STREAM_S

    def frees_at(self, now: float) -> list[float]:
        """When each slot frees (monotonic), soonest first: running streams end after the expected length."""
        n = max(1, math.floor(self.slots))
        length = self.expected_length()
        ends = sorted(max(now, t + length) for t in self.running.values())
        return sorted(ends[:n] + [now] * max(0, n - len(ends)))

    def retry_after(self, now: float) -> int:
        ends = self.frees_at(now)
        return max(1, math.ceil((ends[0] if ends else now) - now))

    def estimates(self, now: float) -> dict[str, float]:
        """Each waiting stream's estimated start, seconds from now: when a slot frees, and with
        `start_slack_s` no sooner than the hold after the start before it (MAX_HOLD_S, its bound)."""
        free = self.frees_at(now) or [now]
        heapq.heapify(free)
        length, out = self.expected_length(), {}
        hold = MAX_HOLD_S if self.config.start_slack_s > 0 else 0.0
        after = now if self.held_since is None else self.held_since + hold     # (the next start, at the earliest)
        for job in self.waiting:
            t = max(heapq.heappop(free), after)
            out[job.id] = round(max(0.0, t - now), 3)
            heapq.heappush(free, t + length)
            after = t + hold
        return out

    def snapshot(self, now: float) -> RealtimeState:
        return {"overload": self.config.overload, "margin": self.config.margin,
                "max_waiting_streams": self.config.max_waiting_streams, "warm": self.warm,
                "audio_per_s": None if self.meter.audio_per_s is None else round(self.meter.audio_per_s, 3),
                "streams": math.floor(self.slots) if self.meter.audio_per_s is not None else None,
                "running": len(self.running), "waiting": len(self.waiting), "refused": self.refused,
                "cost_per_audio_s": dict(self.meter.cost)}


class Gate:
    """Admission by capacity for every real-time pipeline of the config in force. `start(job)`
    hands a job its first stages' inputs (the scheduler's feed); `warm_up(pipeline)` submits a
    pipeline's warm-up job (which comes back through `admit(job, warm_up=True)`)."""

    def __init__(self, groups: Mapping[str, StageGroup], start: Callable[[LiveJob], None],
                 warm_up: Callable[[str], object],
                 plays_until: Callable[[str], float | None] = lambda job: None) -> None:
        self._groups = groups
        self._start = start
        self._warm_up = warm_up
        self._plays_until = plays_until     # a running job's listener runs out of audio then (`ramped`)
        self.pipelines: dict[str, Streams] = {}
        self._by_job: dict[str, Streams] = {}     # every job the gate holds or runs -> its pipeline's streams

    def configure(self, pipelines: Mapping[str, PipelineConfig], cpu_stages: frozenset[str]) -> None:
        """The real-time pipelines of the config in force (at start and on a reload: a pipeline
        whose stages did not change keeps its meter, its streams and its warmth)."""
        kept = self.pipelines
        self.pipelines = {}
        for name, p in pipelines.items():
            if p.realtime is None:
                continue
            old = kept.get(name)
            if old is not None and old.meter.stages == p.stages:
                old.config = p.realtime
                self.pipelines[name] = old
            else:
                self.pipelines[name] = Streams(name, p.realtime, Meter(p.stages, cpu_stages & frozenset(p.stages)))

    def streams(self, pipeline: str) -> Streams | None:
        return self.pipelines.get(pipeline)

    # ------------------------------------------------------------------ admission

    def check(self, pipeline: PipelineConfig) -> None:
        """Before a job is made: refuse it (503 over_capacity, with Retry-After) when it could not
        start now and may not wait."""
        s = self.pipelines.get(pipeline.name)
        if s is None or s.has_room(ahead=len(s.waiting)):
            return                          # (it starts now, or after the streams ahead of it ramp up)
        now = time.monotonic()
        if s.config.overload == "queue" and len(s.waiting) < s.config.max_waiting_streams:
            return
        s.refused += 1
        wait = s.retry_after(now)
        why = "it is warming up" if not s.warm else (
            f"it runs {len(s.running)} streams, as many as its measured capacity keeps on time "
            f"({s.meter.audio_per_s or 0:.2f} audio s a second, margin {s.config.margin})")
        waiting = f", and {len(s.waiting)} wait (max_waiting_streams)" if s.config.overload == "queue" else ""
        raise Refused(503, ErrorCode.OVER_CAPACITY, f"pipeline {pipeline.name!r} is at capacity: {why}{waiting}; "
                      f"try again in {wait} s", retry_after_s=wait, running=len(s.running), waiting=len(s.waiting))

    def admit(self, job: LiveJob, warm_up: bool = False) -> bool:
        """A new job of a real-time pipeline: True when it starts now (the caller feeds it), False
        when it waits (the gate starts it later). Other pipelines' jobs: True."""
        s = self.pipelines.get(job.pipeline.name)
        if s is None:
            return True
        self._by_job[job.id] = s
        if warm_up:
            s.warming = job.id
        if warm_up or (not s.waiting and s.has_room() and s.ramped(self._plays_until)):
            s.running[job.id] = time.monotonic()
            return True
        s.waiting.append(job)
        s.waiting.sort(key=lambda j: j.rank)
        return False

    def waiting(self, job_id: str) -> StreamPlace | None:
        """A waiting stream's place (1: next) and estimated start (seconds from now); None otherwise."""
        s = self._by_job.get(job_id)
        if s is None:
            return None
        for i, job in enumerate(s.waiting):
            if job.id == job_id:
                return {"position": i + 1, "estimated_start_s": s.estimates(time.monotonic()).get(job_id),
                        "running": len(s.running)}
        return None

    def ended(self, job_id: str) -> None:
        """A job left (its end, a cancel, a failure): its slot or its place is free; the next go."""
        s = self._by_job.pop(job_id, None)
        if s is None:
            return
        started = s.running.pop(job_id, None)
        stale = job_id in s.superseded
        s.superseded.discard(job_id)
        if started is not None and job_id != s.warming and not stale:
            s.lengths.append(time.monotonic() - started)
        s.waiting = [j for j in s.waiting if j.id != job_id]
        if job_id == s.warming:
            s.warming = None
            s.warm, s.warm_at = True, time.monotonic()   # (a failed warm-up is the scheduler's to log)
            if started is not None and s.warm_at - started >= MIN_WARM_LENGTH_S:   # (not one that failed at once)
                s.warm_length = s.warm_at - started
        self.release(s)

    def release(self, s: Streams) -> None:
        while s.waiting and s.has_room() and s.ramped(self._plays_until):
            job = s.waiting.pop(0)
            s.running[job.id] = time.monotonic()
            self._start(job)

    # ------------------------------------------------------------------ measuring, warming

    def heard(self, stages: tuple[str, ...], seconds: float) -> None:
        """A job's audio, counted by every real-time pipeline that shares a stage with the job's:
        the work its stages did for it is in their busy and CPU seconds too."""
        for s in self.pipelines.values():
            if not s.meter.stages or not set(stages).isdisjoint(s.meter.stages):
                s.meter.heard(seconds, time.monotonic())
                if s.waiting and s.config.start_slack_s > 0:
                    self.release(s)         # (the audio a starting stream holds may let the next one go)

    def tick(self) -> None:
        """Once a second: sample every real-time pipeline's stages, start what now fits, warm up
        the pipelines that need it."""
        now = time.monotonic()
        for s in self.pipelines.values():
            busy: dict[str, float] = {}
            cpu: dict[str, float] = {}
            as_of: dict[str, float] = {}
            ready = True
            for stage in s.meter.stages:
                group = self._groups.get(stage)
                if group is None:
                    continue
                ready = ready and group.state.serving
                n = len(group.replicas)
                for h in group.replicas:
                    stats = h.stats
                    busy[stage] = busy.get(stage, 0.0) + stats.busy_s / n
                    cpu[stage] = cpu.get(stage, 0.0) + stats.cpu_s
                    as_of[stage] = as_of.get(stage, 0.0) + (h.stats_at or now) / n     # (replicas: their mean)
            s.meter.sample(now, busy, cpu, cold=not s.warm or now - s.warm_at < WARM_GRACE_S, as_of=as_of,
                           starting=bool(s.starting(now)))
            if not ready:
                continue
            if not s.warm and s.warming is None:
                self._warm(s)
            self.release(s)

    def _warm(self, s: Streams) -> None:
        if s.config.warmup is None:
            s.warm = True
            return
        try:
            self._warm_up(s.name)           # (its job comes back through admit(warm_up=True))
        except Refused as e:                # (a stage failed for good, a full disk: tried again next tick)
            log.warning("warm-up job not taken", pipeline=s.name, error=e.message)

    def stage_restarted(self, stage: str) -> None:
        """A stage's worker died or is new: each real-time pipeline through it warms up again (on
        the next worker, once it is ready) before new streams start."""
        for s in self.pipelines.values():
            if stage in s.meter.stages:
                s.warm = False
                if s.warming is not None:   # (its end, a failure as this worker died or not, warms nothing)
                    s.superseded.add(s.warming)
                    s.warming = None

    def snapshots(self) -> dict[str, RealtimeState]:
        now = time.monotonic()
        return {name: s.snapshot(now) for name, s in self.pipelines.items()}

    def is_warm(self, pipeline: str) -> bool:
        s = self.pipelines.get(pipeline)
        return s is None or s.warm
