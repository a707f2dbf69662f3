"""Streaming edges (`window = N`): an upstream's segments travel downstream N at a time, as they
are produced, into a python stage that iterates them.

Real daemons, real stage processes, real vLLM on the tiny model, real kills; nothing mocked.
The stage functions are tests/fixtures/teststages.py's `stream_source` (a generator yielding
numbered segments, ticking a file per segment) and `stream_sink` (a generator that logs every
window it receives, as one JSON line with its job id, window number, arrival time and values,
and ticks a file per window), and `stream_join` (a plain function that blocks in its iterator for
each window). Every wait has a deadline.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    RunningDaemon,
    build_tiny_models,
    check_config,
    module_daemon,
    py_stage,
    short_tmpdir,
    tiny_llm,
    tiny_sd,
    wait_end,
    wait_for,
)

Start = Callable[..., RunningDaemon]


# ------------------------------------------------------------------ helpers


def up_down(window: int, pipeline: str = "p", up: dict[str, Any] | None = None,
            down: dict[str, Any] | None = None, **edge: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stages `up` (stream_source) -> `down` (stream_sink) over one streaming edge."""
    stages = {"up": up or py_stage("stream_source"), "down": down or py_stage("stream_sink")}
    pipelines = {pipeline: {"stages": ["up", "down"],
                            "edges": [{"from": "up", "to": "down", "window": window, **edge}]}}
    return stages, pipelines


def windows(d: RunningDaemon, job: str, output: str = "log") -> list[dict[str, Any]]:
    """The windows `stream_sink` logged for a job, in the order it received them."""
    data, _ = d.client.output(job, output)
    return [json.loads(line) for line in data.decode().splitlines()]


def first(events: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    for ev in events:
        if all(ev.get(k) == v for k, v in match.items()):
            return ev
    raise AssertionError(f"no event {match} in {events}")


def tracked_idle(d: RunningDaemon, *stages: str, timeout: float = 10) -> None:
    wait_for(lambda: all(d.stages()[s]["tracked_jobs"] == 0 for s in stages), timeout,
             f"tracked_jobs == 0 on {stages} (now {[d.stages()[s]['tracked_jobs'] for s in stages]})", every=0.1)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def metric_value(text: str, name: str, labels: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ------------------------------------------------------------------ 1. windows of N


def test_generator_windows_of_n_stitched_in_order_while_upstream_runs(start_daemon: Start) -> None:
    stages, pipelines = up_down(3, up=py_stage("stream_source", defaults={"delay": 0.06}))
    d = start_daemon(stages, pipelines)
    k, n = 10, 3
    job = d.submit("p", params={"up": {"n": k, "bytes": True, "lists": True}})
    doc = wait_end(d, job)
    assert doc["state"] == "succeeded", doc
    got = windows(d, job)

    # ceil(K/N) windows, in order, each N consecutive segments stitched; the last one shorter
    assert len(got) == math.ceil(k / n) == 4, got
    assert [w["w"] for w in got] == [0, 1, 2, 3]
    assert all(w["job"] == job for w in got)
    for w, idx in zip(got, ([0, 1, 2], [3, 4, 5], [6, 7, 8], [9])):
        v = w["v"]
        assert v["text"] == "".join(f"s{i};" for i in idx), got            # text concatenated
        assert v["blob"] == {"hex": bytes(idx).hex()}, got                  # bytes concatenated
        assert v["items"] == idx, got                                       # lists extended
        assert v["i"] == idx[-1], got                                       # others: the latest value
    assert json.loads(d.client.output(job, "kinds")[0]) == {k: "InputStream" for k in ("blob", "i", "items", "text")}

    # streamed: the consumer started, and got its first window, before the upstream finished
    events = d.events(job)
    up_done = first(events, type="stage_finished", stage="up")["ts"]
    down_started = first(events, type="stage_started", stage="down")["ts"]
    assert down_started < up_done, (down_started, up_done)
    assert got[0]["t"] < up_done - 0.15, (got[0]["t"], up_done)          # 7 segments (0.4 s) still to come
    # ... and the windows came over time, not all at the end
    assert got[-1]["t"] - got[0]["t"] > 0.2, [w["t"] for w in got]
    tracked_idle(d, "up", "down")


def test_exact_multiple_of_n_ends_with_an_empty_last_window(start_daemon: Start) -> None:
    stages, pipelines = up_down(3)
    d = start_daemon(stages, pipelines)
    job = d.submit("p", params={"up": {"n": 9}})
    assert wait_end(d, job)["state"] == "succeeded"
    got = windows(d, job)
    # 3 full windows; the empty last one only says "that was all" and is not iterated
    assert [w["v"]["text"] for w in got] == ["s0;s1;s2;", "s3;s4;s5;", "s6;s7;s8;"]
    # fewer segments than N: one short last window
    job = d.submit("p", params={"up": {"n": 2}})
    assert wait_end(d, job)["state"] == "succeeded"
    assert [w["v"]["text"] for w in windows(d, job)] == ["s0;s1;"]


# ------------------------------------------------------------------ 2. a plain upstream


def test_plain_function_upstream_arrives_as_one_last_window(start_daemon: Start) -> None:
    stages, pipelines = up_down(4, up=py_stage("echo", defaults={"tag": "up"}))
    d = start_daemon(stages, pipelines)
    job = d.submit("p", {"text": "hello"})
    doc = wait_end(d, job)
    assert doc["state"] == "succeeded", doc
    got = windows(d, job)
    assert len(got) == 1, got
    assert got[0]["v"] == {"text": "up:hello", "pid": d.stage_pid("up")}
    assert json.loads(d.client.output(job, "kinds")[0]) == {"pid": "InputStream", "text": "InputStream"}
    tracked_idle(d, "up", "down")


# ------------------------------------------------------------------ 3, 4. vLLM upstream


@pytest.fixture(scope="module")
def llm() -> Iterator[RunningDaemon]:
    """One daemon for the vLLM tests (loading vLLM costs ~10 s on 2 cores)."""
    build_tiny_models("llm")
    stages = {
        "gen": tiny_llm({"max_tokens": 64, "ignore_eos": True}, max_model_len=256, max_inflight=8),
        "down": py_stage("stream_sink", max_inflight=4),
        "keep": py_stage("passthrough"),
    }
    pipelines = {
        "s": {"stages": ["gen", "down"], "edges": [{"from": "gen", "to": "down", "window": 8}]},
        # the same stream, and vLLM's final `text` kept whole beside it
        "both": {"stages": ["gen", "down", "keep"],
                 "edges": [{"from": "gen", "to": "down", "window": 8}, {"from": "gen", "to": "keep"}]},
    }
    with module_daemon(short_tmpdir(), stages, pipelines, {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def llm_segments(events: list[dict[str, Any]]) -> list[str]:
    segs = [e for e in events if e["type"] == "segment" and e["stage"] == "gen"]
    assert [e["index"] for e in segs] == list(range(len(segs)))
    return [e.get("text") or "" for e in segs]


@pytest.mark.vllm
def test_vllm_tokens_stream_into_python_stage(llm: RunningDaemon) -> None:
    job = llm.submit("both", {"prompt": "a lighthouse at dusk"}, params={"gen": {"max_tokens": 128}})
    doc = wait_end(llm, job, timeout=60)
    assert doc["state"] == "succeeded", doc
    got = windows(llm, job, "down.log")
    events = llm.events(job)
    tokens = llm_segments(events)
    assert len(tokens) == 128
    # 8 tokens per window, the last one marked on vLLM's last token: 16 windows, in order
    assert [w["w"] for w in got] == list(range(16)), [w["w"] for w in got]
    assert [w["v"]["text"] for w in got] == ["".join(tokens[i:i + 8]) for i in range(0, 128, 8)]
    streamed = "".join(w["v"]["text"] for w in got)
    final = llm.client.output(job, "keep.text")[0].decode()
    assert final and streamed.strip() == final          # vLLM's final text is the stripped generation
    # the first window was there long before vLLM finished
    gen_done = first(events, type="stage_finished", stage="gen")["ts"]
    assert first(events, type="stage_started", stage="down")["ts"] < gen_done
    assert got[0]["t"] < gen_done and got[0]["t"] < got[-1]["t"]
    tracked_idle(llm, "gen", "down", "keep")


@pytest.mark.vllm
def test_eight_vllm_streams_at_once_never_cross(llm: RunningDaemon) -> None:
    jobs = [llm.submit("s", {"prompt": f"job{i} tells a story"}) for i in range(8)]
    docs = [wait_end(llm, j, timeout=60) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 8, [(doc["state"], doc["error"]) for doc in docs]
    starts = [doc["stages"]["gen"]["started_at"] for doc in docs]
    ends = [doc["stages"]["gen"]["finished_at"] for doc in docs]
    assert max(starts[:4]) < min(ends), "vLLM did not batch the streamed jobs"
    for job in jobs:
        got = windows(llm, job)
        tokens = llm_segments(llm.events(job))
        assert len(tokens) == 64                          # the upstream's text is whole
        assert {w["job"] for w in got} == {job}, got       # the consumer ran each window under its own job
        assert [w["w"] for w in got] == list(range(8))
        # exactly this job's tokens, 8 by 8, in order: no window crossed jobs
        assert [w["v"]["text"] for w in got] == ["".join(tokens[i:i + 8]) for i in range(0, 64, 8)], job
    # the consumer (max_inflight = 4) ran several streams at once
    down = [(doc["stages"]["down"]["started_at"], doc["stages"]["down"]["finished_at"]) for doc in docs]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(down) for b in down[i + 1:]), down
    tracked_idle(llm, "gen", "down")


# ------------------------------------------------------------------ 5. backpressure


def test_a_fast_generator_waits_for_a_slow_consumer(start_daemon: Start, tmp_path: Path) -> None:
    """Backpressure reaches a generator upstream: it is not advanced while its unsent windows
    are at the queue's capacity, so it stays a bounded distance ahead of the consumer."""
    tick = tmp_path / "tick"
    stages, pipelines = up_down(
        1, up=py_stage("stream_source", queue_capacity=2, defaults={"n": 40, "delay": 0.0}),
        down=py_stage("stream_sink", queue_capacity=2, defaults={"delay": 0.1}))
    d = start_daemon(stages, pipelines)
    job = d.submit("p", params={"up": {"tick": str(tick)}})
    wait_for(lambda: d.client.job(job)["stages"]["down"]["segments"] >= 5, 20, "the consumer's 5th window")
    produced, consumed = lines(tick), d.client.job(job)["stages"]["down"]["segments"]
    # in flight at most: the consumer's stream buffer (2) and input queue (1), the upstream's
    # unsent windows (2), and a window or two being handed over
    assert produced - consumed <= 8, (produced, consumed)
    assert wait_end(d, job, timeout=30)["state"] == "succeeded"
    assert len(windows(d, job)) == 40


def test_backpressure_on_streams_cannot_deadlock(start_daemon: Start) -> None:
    stages, pipelines = up_down(
        2, up=py_stage("stream_source", max_inflight=3, defaults={"n": 6, "delay": 0.01}),
        down=py_stage("stream_sink", queue_capacity=1, defaults={"delay": 0.12}))
    d = start_daemon(stages, pipelines)
    n_jobs = 5
    t0 = time.monotonic()
    jobs = [d.submit("p", params={"up": {"n": 6}}) for _ in range(n_jobs)]
    depths: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                depths.append(d.stages()["down"]["queue_depth"])
            except Exception:
                pass
            time.sleep(0.03)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        docs = [wait_end(d, j, timeout=30) for j in jobs]
    finally:
        stop.set()
        sampler.join(5)
    took = time.monotonic() - t0
    assert [doc["state"] for doc in docs] == ["succeeded"] * n_jobs, [(doc["state"], doc["error"]) for doc in docs]
    # serial downstream: 5 jobs x 3 windows x 0.12 s = 1.8 s, with room for a busy machine
    assert took < 25, took
    assert depths and max(depths) <= 1, f"down's queue depths: {depths}"
    # the upstream had several jobs' streams going at once
    up = [(doc["stages"]["up"]["started_at"], doc["stages"]["up"]["finished_at"]) for doc in docs]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(up) for b in up[i + 1:]), up
    for job in jobs:
        got = windows(d, job)
        assert [w["v"]["text"] for w in got] == ["s0;s1;", "s2;s3;", "s4;s5;"], (job, got)
        assert {w["job"] for w in got} == {job}
    tracked_idle(d, "up", "down")


# ------------------------------------------------------------------ 6, 7. cancel and timeout mid-stream


def _slow_stream(start_daemon: Start, consumer: str = "stream_sink") -> RunningDaemon:
    """up -> down, window 2: 400 segments 30 ms apart; `stream_sink` works 40 ms per window,
    `stream_join` (a plain function) spends its time blocked in its iterator, waiting for windows."""
    stages, pipelines = up_down(2, up=py_stage("stream_source", defaults={"n": 400, "delay": 0.03}),
                                down=py_stage(consumer, defaults={"delay": 0.04}))
    return start_daemon(stages, pipelines, {"cancel_grace_s": 5.0})


def _files(tmp_path: Path) -> tuple[dict[str, dict[str, str]], dict[str, Path]]:
    paths = {name: tmp_path / name for name in ("up.tick", "up.marker", "down.tick", "down.marker")}
    params = {s: {"tick": str(paths[f"{s}.tick"]), "marker": str(paths[f"{s}.marker"])} for s in ("up", "down")}
    return params, paths


def _assert_both_stopped(d: RunningDaemon, paths: dict[str, Path], pids: dict[str, int],
                         ticks_at_end: dict[str, int]) -> None:
    # both functions saw it, within a step (up) and a window (down)
    wait_for(lambda: paths["up.marker"].exists() and paths["down.marker"].exists(), 5,
             "both stages to notice the end of the job")
    assert paths["up.marker"].read_text() in ("cancelled\n", "closed\n")
    assert paths["down.marker"].read_text() in ("Cancelled\n", "GeneratorExit\n")
    time.sleep(0.2)
    sizes = {s: lines(paths[f"{s}.tick"]) for s in ("up", "down")}
    time.sleep(0.6)
    assert {s: lines(paths[f"{s}.tick"]) for s in ("up", "down")} == sizes, "a stage went on working"
    # ... and soon: a few 30 ms segments / 40 ms windows while the cancel travels (slack for a busy machine)
    assert sizes["up"] <= ticks_at_end["up"] + 10 and sizes["down"] <= ticks_at_end["down"] + 5, (sizes, ticks_at_end)
    assert sizes["up"] < 400
    # stopped inside the workers, not by killing them
    snap = d.stages()
    assert {s: snap[s]["pid"] for s in pids} == pids
    assert snap["up"]["restarts"] == snap["down"]["restarts"] == 0
    tracked_idle(d, "up", "down")


@pytest.mark.parametrize("consumer", ["stream_sink", "stream_join"])
def test_cancel_mid_stream_stops_both_stages(consumer: str, start_daemon: Start, tmp_path: Path) -> None:
    d = _slow_stream(start_daemon, consumer)
    pids = {s: d.stage_pid(s) for s in ("up", "down")}
    params, paths = _files(tmp_path)
    job = d.submit("p", params=params)
    wait_for(lambda: lines(paths["down.tick"]) >= 3, 15, "the consumer to take 3 windows")
    ticks = {s: lines(paths[f"{s}.tick"]) for s in ("up", "down")}
    assert d.client.cancel(job)["state"] == "cancelled"
    doc = wait_end(d, job, timeout=10)
    assert doc["state"] == "cancelled"
    _assert_both_stopped(d, paths, pids, ticks)
    if consumer == "stream_join":       # it waited in its iterator, which raised Cancelled at once
        assert paths["down.marker"].read_text() == "Cancelled\n"
    # the stages serve the next stream
    nxt = d.submit("p", params={"up": {"n": 5, "delay": 0.01}})
    assert wait_end(d, nxt)["state"] == "succeeded"
    if consumer == "stream_join":
        assert d.client.output(nxt, "log")[0].decode() == "s0;s1;|s2;s3;|s4;"
    else:
        assert [w["v"]["text"] for w in windows(d, nxt)] == ["s0;s1;", "s2;s3;", "s4;"]


def test_timeout_mid_stream_stops_both_stages(start_daemon: Start, tmp_path: Path) -> None:
    d = _slow_stream(start_daemon)
    pids = {s: d.stage_pid(s) for s in ("up", "down")}
    params, paths = _files(tmp_path)
    job = d.submit("p", params=params, timeout_s=1.5)
    wait_for(lambda: lines(paths["down.tick"]) >= 1, 15, "the consumer to take a window")
    doc = wait_end(d, job, timeout=15)
    ticks = {s: lines(paths[f"{s}.tick"]) for s in ("up", "down")}
    assert doc["state"] == "timed_out", doc
    assert 1.4 <= doc["finished_at"] - doc["created_at"] < 4.0, doc
    assert "timed out after 1.5 s" in doc["error"]["message"] and doc["error"]["stage"] in ("up", "down"), doc
    _assert_both_stopped(d, paths, pids, ticks)


# ------------------------------------------------------------------ 8. a worker killed mid-stream


@pytest.mark.parametrize("victim", ["up", "down"])
def test_sigkill_mid_stream_fails_the_job_clearly(victim: str, start_daemon: Start, tmp_path: Path) -> None:
    d = _slow_stream(start_daemon)
    survivor = "down" if victim == "up" else "up"
    params, paths = _files(tmp_path)
    job = d.submit("p", params=params)
    wait_for(lambda: lines(paths["down.tick"]) >= 3, 15, "the consumer to take 3 windows")
    old = d.stage_pid(victim)
    survivor_pid = d.stage_pid(survivor)
    os.kill(old, signal.SIGKILL)

    doc = wait_end(d, job, timeout=20)                    # never hangs
    assert doc["state"] == "failed", doc
    msg = doc["error"]["message"]
    assert f"'{victim}'" in msg and "SIGKILL" in msg and "streaming" in msg, msg
    assert doc["error"]["stage"] == victim
    # the survivor stopped its side of the stream, in the same process
    wait_for(lambda: paths[f"{survivor}.marker"].exists(), 5, f"{survivor} to stop the job")
    n = lines(paths[f"{survivor}.tick"])
    time.sleep(0.5)
    assert lines(paths[f"{survivor}.tick"]) == n
    tracked_idle(d, survivor)
    assert d.stage_pid(survivor) == survivor_pid
    # the killed stage comes back, and streams again
    snap = d.wait_stage_state(victim, ("ready",), timeout=30)
    assert snap["pid"] != old and snap["restarts"] == 1
    nxt = d.submit("p", params={"up": {"n": 5, "delay": 0.01}})
    assert wait_end(d, nxt)["state"] == "succeeded"
    assert [w["v"]["text"] for w in windows(d, nxt)] == ["s0;s1;", "s2;s3;", "s4;"]
    tracked_idle(d, "up", "down")


# ------------------------------------------------------------------ 9. --check


def test_check_window_edges(tmp_path: Path) -> None:
    ok = check_config(tmp_path, {"a": py_stage("stream_source"), "b": py_stage("stream_sink"), "c": py_stage("stream_sink")},
                {"ab": {"stages": ["a", "b"], "edges": [{"from": "a", "to": "b", "window": 3}]},
                 "abc": {"stages": ["a", "b", "c"], "edges": [{"from": "a", "to": "b", "window": 1},
                                                              {"from": "b", "to": "c", "window": 5}]}})
    assert ok.returncode == 0, ok.stdout + ok.stderr

    draw = tiny_sd()
    bad = check_config(tmp_path, {"a": py_stage("stream_source"), "draw": draw},
                 {"t2i": {"stages": ["a", "draw"], "edges": [{"from": "a", "to": "draw", "window": 4}]}})
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "pipelines.t2i.edges[0].window" in bad.stderr
    assert "stage 'draw' (diffusers) cannot be fed by a window edge" in bad.stderr, bad.stderr

    two = check_config(tmp_path, {"a": py_stage("stream_source"), "b": py_stage("echo"), "c": py_stage("stream_sink")},
                 {"fanin": {"stages": ["a", "b", "c"], "edges": [{"from": "a", "to": "c", "window": 2},
                                                                 {"from": "b", "to": "c"}]}})
    assert two.returncode == 2, two.stdout + two.stderr
    assert "stage 'c' is fed by a window edge from 'a' and also by 'b'" in two.stderr, two.stderr


# ------------------------------------------------------------------ 10. metrics


def test_metrics_count_windows_and_first_segment(start_daemon: Start) -> None:
    stages, pipelines = up_down(3, pipeline="mp")
    d = start_daemon(stages, pipelines)
    job = d.submit("mp", params={"up": {"n": 10}})
    assert wait_end(d, job)["state"] == "succeeded"
    assert len(windows(d, job)) == 4
    # window counts come with the upstream's heartbeats
    text = wait_for(lambda: (t := d.client.metrics()) and
                    metric_value(t, "omnid_edge_windows_total", 'dst="down",src="up"') == 4 and t, 5,
                    "omnid_edge_windows_total to count 4 windows")
    assert metric_value(text, "omnid_first_segment_seconds_count", 'pipeline="mp"') == 1, text
    job2 = d.submit("mp", params={"up": {"n": 9}})         # 3 full windows and an empty last one
    assert wait_end(d, job2)["state"] == "succeeded"
    text = wait_for(lambda: (t := d.client.metrics()) and
                    metric_value(t, "omnid_edge_windows_total", 'dst="down",src="up"') == 8 and t, 5,
                    "omnid_edge_windows_total to count 8 windows")
    assert metric_value(text, "omnid_first_segment_seconds_count", 'pipeline="mp"') == 2, text
