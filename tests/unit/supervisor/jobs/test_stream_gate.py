"""The real-time pipelines' meter and gate (omnid/supervisor/jobs/streams.py), in-process: known
busy and CPU seconds per audio second in, the capacity and the admission decisions out."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest

from omnid.config_types import PipelineConfig, RealtimeConfig
from omnid.supervisor.errors import Refused
from omnid.supervisor.jobs import streams as S


def feed(meter: S.Meter, seconds: float, busy_per_audio: dict[str, float], audio_per_s: float = 1.0,
         cpu_per_audio: dict[str, float] | None = None, start: float = 0.0,
         totals: tuple[dict[str, float], dict[str, float]] | None = None,
         starting: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """`seconds` of samples, one a second, the pipeline making `audio_per_s` (`starting`: while a
    stream starts)."""
    busy, cpu = totals or ({}, {})
    for t in range(int(seconds) + 1):
        if t:
            meter.heard(audio_per_s, start + t)
            for st, v in busy_per_audio.items():
                busy[st] = busy.get(st, 0.0) + v * audio_per_s
            for st, v in (cpu_per_audio or {}).items():
                cpu[st] = cpu.get(st, 0.0) + v * audio_per_s
        meter.sample(start + t, busy, cpu, starting=starting)
    return busy, cpu


def test_capacity_is_one_over_the_slowest_stage_cost() -> None:
    meter = S.Meter(("talker", "code2wav"), frozenset())
    feed(meter, S.WINDOW_S, {"talker": 0.1, "code2wav": 0.25})
    assert meter.audio_per_s == pytest.approx(4.0)         # code2wav: 0.25 s a audio second
    assert meter.cost == {"talker": 0.1, "code2wav": 0.25}


def test_cpu_stages_share_the_cores() -> None:
    meter = S.Meter(("a", "b"), frozenset({"a", "b"}))
    feed(meter, S.WINDOW_S, {"a": 0.01, "b": 0.01}, cpu_per_audio={"a": 0.3 * S.CORES, "b": 0.2 * S.CORES})
    assert meter.audio_per_s == pytest.approx(2.0)         # 0.5 of all the cores a audio second
    assert meter.cost["cpu"] == pytest.approx(0.5)


def test_no_estimate_from_too_little_audio_or_time() -> None:
    meter = S.Meter(("a",), frozenset())
    feed(meter, S.WINDOW_S, {"a": 0.5}, audio_per_s=S.MIN_AUDIO_S / (S.WINDOW_S * 2))
    assert meter.audio_per_s is None
    meter = S.Meter(("a",), frozenset())
    feed(meter, S.WINDOW_S / 2 - 1, {"a": 0.5})
    assert meter.audio_per_s is None


def test_the_estimate_follows_a_slower_stage_and_a_restart_starts_a_new_window() -> None:
    meter = S.Meter(("a",), frozenset())
    totals = feed(meter, S.WINDOW_S, {"a": 0.2})
    assert meter.audio_per_s == pytest.approx(5.0)
    t = S.WINDOW_S
    for _ in range(6):                                      # the stage is 4 times slower now
        totals = feed(meter, S.WINDOW_S, {"a": 0.8}, start=t, totals=totals)
        t += S.WINDOW_S + 1
    assert meter.audio_per_s == pytest.approx(1.25, rel=0.05)
    meter.sample(t + 1, {"a": 0.0}, {})                     # the worker restarted: its counters are 0
    feed(meter, S.WINDOW_S, {"a": 0.8}, start=t + 1, totals=({"a": 0.0}, {}))
    assert meter.audio_per_s == pytest.approx(1.25, rel=0.05)   # no negative or huge window from the reset


def test_each_stage_is_measured_between_its_own_heartbeats() -> None:
    """Audio comes with each packet, a stage's busy seconds with its heartbeats (a second apart, at
    any phase to the meter's samples): a window whose first heartbeat was staler than its last
    must not read a second more work than audio, nor the reverse. The stage costs 0.2 s an audio
    second, exactly; its heartbeats are 0.9 s stale at every 3rd sample, fresh at the others."""
    meter = S.Meter(("a",), frozenset({"a"}))
    packet, cost = 0.1, 0.2
    seen = []
    for tick in range(1, 41):
        for k in range(10):                                 # a packet every 0.1 s
            meter.heard(packet, tick - 1 + (k + 1) * 0.1)
        beat = tick - (0.9 if tick % 3 == 0 else 0.0)       # its latest heartbeat
        made = packet * round(beat / packet)                # the audio made by then
        meter.sample(float(tick), {"a": cost * made}, {"a": cost * S.CORES * made}, as_of={"a": beat})
        if meter.audio_per_s is not None:
            seen.append(meter.audio_per_s)
    assert len(seen) > 20
    assert all(v == pytest.approx(1 / cost, rel=0.03) for v in seen), seen


def test_while_streams_start_the_window_grows_until_their_audio_has_come() -> None:
    """A start's work comes before its audio: while a stream is starting no estimate is made, up
    to LOWER_S, whichever way it would go (taking the rises at once would pick the noise's highs);
    a window that held a start is measured over WINDOW_S, not half of it."""
    w = S.WINDOW_S
    meter = S.Meter(("a",), frozenset())
    totals = feed(meter, w, {"a": 0.2})
    assert meter.audio_per_s == pytest.approx(5.0)
    totals = feed(meter, w, {"a": 0.5}, start=w, totals=totals, starting=True)      # a wave starts: dearer
    assert meter.audio_per_s == pytest.approx(5.0)          # not yet: its audio is still to come
    feed(meter, S.LOWER_S - w + 1, {"a": 0.5}, start=2 * w, totals=totals, starting=True)
    assert meter.audio_per_s < 4.0                          # still starting, still dearer: it counts, late
    cheap = S.Meter(("a",), frozenset())
    totals = feed(cheap, w, {"a": 0.2})
    totals = feed(cheap, w, {"a": 0.1}, start=w, totals=totals, starting=True)
    assert cheap.audio_per_s == pytest.approx(5.0)          # a rise waits too
    totals = feed(cheap, w / 2, {"a": 0.1}, start=2 * w, totals=totals)
    assert cheap.audio_per_s is not None and cheap.audio_per_s > 5.0           # the starts are over: it counts
    # the next window held no start: half a window is enough again
    before = cheap.audio_per_s
    feed(cheap, w / 2, {"a": 0.1}, start=2.5 * w, totals=totals)
    assert cheap.audio_per_s > before


def test_a_warm_up_of_a_worker_that_died_warms_nothing() -> None:
    """The stage died while its pipeline's warm-up job ran: that job's end (its failure) does not
    make the pipeline warm; the next worker's warm-up does."""
    p = PipelineConfig(name="speech", stages=("s",), edges=(), realtime=RealtimeConfig(margin=0.9))
    started: list[str] = []
    g = S.Gate({}, lambda job: started.append(job.id), lambda name: None)
    g.configure({"speech": p}, frozenset())
    s = g.streams("speech")
    assert s is not None
    s.meter.audio_per_s = 3.4
    assert g.admit(FakeJob("warm1", p), warm_up=True)
    assert not g.admit(FakeJob("a", p))                     # cold: it waits
    g.stage_restarted("s")                                  # the worker died
    g.ended("warm1")                                        # so its warm-up failed
    assert not s.warm and started == [] and s.lengths == deque()
    assert g.admit(FakeJob("warm2", p), warm_up=True)       # the next worker's
    g.ended("warm2")
    assert s.warm and started == ["a"]


class FakeJob:
    def __init__(self, name: str, pipeline: PipelineConfig, priority: int = 0, order: int = 0) -> None:
        self.id = name
        self.pipeline = pipeline
        self.rank = (priority, 0.0, order)


def gate(overload: str = "queue", waiting: int = 2, audio_per_s: float = 3.4) -> tuple[S.Gate, PipelineConfig, list[str]]:
    p = PipelineConfig(name="speech", stages=("s",), edges=(),
                       realtime=RealtimeConfig(overload=overload, max_waiting_streams=waiting, margin=0.9))
    started: list[str] = []
    g = S.Gate({}, lambda job: started.append(job.id), lambda name: None)
    g.configure({"speech": p}, frozenset())
    s = g.streams("speech")
    assert s is not None
    s.warm = True
    s.meter.audio_per_s = audio_per_s                       # 0.9 x 3.4 = 3.06: 3 streams
    return g, p, started


def test_the_gate_admits_what_fits_then_queues_by_rank_then_refuses() -> None:
    g, p, started = gate()
    jobs: list[Any] = [FakeJob(f"j{i}", p, order=i) for i in range(3)]
    assert all(g.admit(j) for j in jobs)
    late, urgent = FakeJob("late", p, priority=5, order=3), FakeJob("urgent", p, priority=0, order=4)
    g.check(p)
    assert not g.admit(late)
    g.check(p)
    assert not g.admit(urgent)
    assert g.waiting("urgent")["position"] == 1 and g.waiting("late")["position"] == 2     # type: ignore[index]
    est = [g.waiting(n)["estimated_start_s"] for n in ("urgent", "late")]                 # type: ignore[index]
    assert 0 < est[0] <= est[1] + 0.05      # (each is seconds from its own reading: a slow host reads them ms apart)
    with pytest.raises(Refused) as e:
        g.check(p)
    assert e.value.status == 503 and str(e.value.code) == "over_capacity" and e.value.extra["retry_after_s"] >= 1
    g.ended("j0")                                           # a slot frees: the most urgent starts
    assert started == ["urgent"] and g.waiting("late")["position"] == 1                    # type: ignore[index]
    g.ended("late")                                         # it hung up while waiting: it leaves the line
    assert g.waiting("late") is None and g.snapshots()["speech"]["waiting"] == 0


def test_refuse_mode_refuses_as_soon_as_it_is_full_and_an_idle_pipeline_always_takes_one() -> None:
    g, p, _ = gate(overload="refuse", audio_per_s=0.5)      # less than one stream of capacity
    g.check(p)
    assert g.admit(FakeJob("first", p))                     # one stream always may start
    with pytest.raises(Refused):
        g.check(p)


def test_a_cold_pipeline_waits_for_its_warm_up() -> None:
    g, p, started = gate()
    s = g.streams("speech")
    assert s is not None
    g.stage_restarted("s")
    assert not s.warm and not g.admit(FakeJob("a", p))
    warm = FakeJob("warm", p)
    assert g.admit(warm, warm_up=True) and s.warming == "warm"
    g.ended("warm")
    assert s.warm and started == ["a"]


def test_with_start_slack_a_new_stream_waits_for_the_young_ones_to_hold_that_much_audio() -> None:
    p = PipelineConfig(name="speech", stages=("s",), edges=(),
                       realtime=RealtimeConfig(overload="refuse", margin=0.9, start_slack_s=0.5))
    started: list[str] = []
    until: dict[str, float] = {}
    g = S.Gate({}, lambda job: started.append(job.id), lambda name: None, until.get)
    g.configure({"speech": p}, frozenset())
    s = g.streams("speech")
    assert s is not None
    s.warm, s.meter.audio_per_s = True, 10.0                # room for 9
    assert g.admit(FakeJob("a", p))                         # an idle pipeline: at once
    g.check(p)                                              # room: never refused for a ramp, even in "refuse"
    assert not g.admit(FakeJob("b", p))                     # "a" has no audio yet: "b" waits
    until["a"] = time.time() + 0.2
    g.heard(("s",), 0.2)
    assert started == []                                    # 0.2 s held: not yet
    until["a"] = time.time() + 0.6
    g.heard(("s",), 0.4)
    assert started == ["b"]                                 # 0.6 s held: the next one goes, from a packet
    s.running["b"] -= S.RAMP_S                              # "b" began long ago: not waited for
    assert g.admit(FakeJob("c", p))
    assert not g.admit(FakeJob("e", p))                     # "c" has no audio yet: "e" waits ...
    assert s.held_since is not None
    assert not g.admit(FakeJob("f", p))                     # (and "f" after it: each start's hold in its estimate)
    est = [g.waiting(n)["estimated_start_s"] for n in ("e", "f")]                        # type: ignore[index]
    assert S.MAX_HOLD_S - 0.1 <= est[0] <= S.MAX_HOLD_S and est[1] == pytest.approx(est[0] + S.MAX_HOLD_S, abs=0.01)
    g.ended("f")
    s.held_since -= S.MAX_HOLD_S
    g.heard(("s",), 0.1)
    assert started == ["b", "e"]                            # ... a second at most
    s.running["e"] -= S.RAMP_S
    p0 = PipelineConfig(name="speech", stages=("s",), edges=(), realtime=RealtimeConfig(margin=0.9))
    g.configure({"speech": p0}, frozenset())                # (start_slack_s 0: off; a reload keeps the streams)
    assert g.admit(FakeJob("d", p0))                        # "c" has no audio, and "d" starts all the same


def test_a_warm_ups_figure_is_provisional(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's cold steps (loads, compiles: 0.2 audio s a busy second here) give a first
    figure, which the first warm window's (4 audio s/s) replaces: not their mean."""
    from types import SimpleNamespace as NS
    clock = [1000.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    stats = NS(busy_s=0.0, cpu_s=0.0)
    groups: Any = {"s": NS(state=NS(serving=True), replicas=[NS(stats=stats, stats_at=0.0)])}
    p = PipelineConfig(name="speech", stages=("s",), edges=(), realtime=RealtimeConfig(margin=0.9))
    g = S.Gate(groups, lambda job: None, lambda name: None)
    g.configure({"speech": p}, frozenset())
    s = g.streams("speech")
    assert s is not None
    assert g.admit(FakeJob("warm", p), warm_up=True) and s.warming == "warm"     # its warm-up job in flight
    for _ in range(8):
        clock[0] += 1.0
        s.meter.heard(0.2, clock[0])
        stats.busy_s += 1.0
        g.tick()
    assert s.meter.audio_per_s == pytest.approx(0.2) and s.meter.provisional
    for audio, busy in [(0.0, 1.0)] + [(1.0, 0.25)] * 10:
        if audio == 0.0:
            s.meter.heard(1.5, clock[0])                    # its last packets, heard after the last tick,
            g.ended("warm")                                 # then its end; its last busy second with the next stats
        clock[0] += 1.0
        s.meter.heard(audio, clock[0])
        stats.busy_s += busy
        g.tick()
    assert s.meter.audio_per_s == pytest.approx(4.0)
    assert not s.meter.provisional


def test_before_a_stream_has_ended_estimates_use_the_warm_ups_length() -> None:
    """A waiting stream's estimate and a refusal's Retry-After come from the streams' expected
    length: before any has ended, the warm-up's duration (not DEFAULT_STREAM_S); a warm-up that
    failed at once says nothing; the ended streams' mean once there is one."""
    g, p, _ = gate()
    s = g.streams("speech")
    assert s is not None
    s.warm = False
    assert g.admit(FakeJob("quick", p), warm_up=True)
    g.ended("quick")                                        # failed at once: no length from it
    assert s.expected_length() == S.DEFAULT_STREAM_S
    s.warm = False
    assert g.admit(FakeJob("warm", p), warm_up=True)
    time.sleep(0.3)
    g.ended("warm")
    assert s.warm and 0.3 <= s.expected_length() < 1.5
    jobs = [FakeJob(f"j{i}", p, order=i) for i in range(4)]
    assert all(g.admit(j) for j in jobs[:3]) and not g.admit(jobs[3])   # 3 fit; the 4th waits
    assert 0 < g.waiting("j3")["estimated_start_s"] <= 1.5  # type: ignore[index]
    s.running["j0"] -= 2.0                                  # j0 ran for 2 s
    g.ended("j0")
    assert s.expected_length() == pytest.approx(2.0, abs=0.1)
