"""Real-time pipelines (`realtime = {...}`): capacity measured online, admission by it, the
listener's clock, through a real daemon.

The stage is `speakers:Speaker` (tests/fixtures/speakers.py): a sessions stage whose speech has a
known cost, 0.02 s of wall time per session a step for 0.1 s of audio, so that it saturates at a
few streams. Each test reads the daemon's own capacity figure (`GET /v1/stages`' `realtime`) and
fills it: the host's speed does not matter, only that the admitted streams stay on time, the others
wait in a known place (or are refused at once), and the capacity follows the stage.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RunningDaemon, check_config, module_daemon, short_tmpdir, wait_for

from omnictl.client import ApiError
from omnictl.transport import UnixHTTPConnection

SPEAKER = {"engine": "python", "sessions": "speakers:Speaker", "python_path": [str(FIXTURES)], "max_inflight": 8,
           "queue_capacity": 16}
LONG = {"packets": 50}          # a stream of 5 audio seconds: still running while the others come
WARM = {"warmup": {}, "warmup_params": {}}
RAMP_SLACK_S = 0.5
HEAVY_LOAD_CPU_S = 4.0          # the `heavy` pipeline's stage burns this much CPU as it loads


@pytest.fixture(scope="module")
def d() -> Iterator[RunningDaemon]:
    folder = short_tmpdir()
    stages = {"q": {**SPEAKER, "defaults": {"slow_file": str(folder / "slow")}},
              "r": dict(SPEAKER), "b": dict(SPEAKER),
              "h": {**SPEAKER, "env": {"SPEAKER_LOAD_CPU_S": str(HEAVY_LOAD_CPU_S)}}}
    pipelines = {
        # (margin 0.75: 3.75 streams at the stage's bound of 5 audio s/s, 3.5 at 7 % overhead: far
        # from a whole number, which a 1 % change of the measured figure would cross)
        "speech": {"stages": ["q"], "realtime": {"max_waiting_streams": 3, "margin": 0.75, **WARM,
                                                 "warmup_params": {"q": {"packets": 40}}}},
        "refusing": {"stages": ["r"], "realtime": {"overload": "refuse", "margin": 0.8, **WARM,
                                                   "warmup_params": {"r": {"packets": 40}}}},
        "ramping": {"stages": ["b"], "realtime": {"margin": 0.8, "start_slack_s": RAMP_SLACK_S, **WARM,
                                                  "warmup_params": {"b": {"packets": 40}}}},
        "heavy": {"stages": ["h"], "realtime": {**WARM, "warmup_params": {"h": {"packets": 40}}}},
        "plain": {"stages": ["b"]},             # no admission: the listener's clock orders its batches all the same
    }
    with module_daemon(folder, stages, pipelines, ready_timeout=120) as rd:
        yield rd


def realtime(d: RunningDaemon, pipeline: str) -> dict[str, Any]:
    return dict(d.client.stages()["realtime"][pipeline])


def measured(d: RunningDaemon, pipeline: str) -> dict[str, Any]:
    """The pipeline's snapshot once its capacity is measured (its warm-up job measures it)."""
    return dict(wait_for(lambda: (s := realtime(d, pipeline))["audio_per_s"] is not None and s, 30,
                         f"{pipeline}'s capacity to be measured"))


def post(d: RunningDaemon, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    conn = UnixHTTPConnection(str(d.socket), timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def packets(d: RunningDaemon, job: str) -> list[tuple[float, float]]:
    return [(float(e["ts"]), float(e["audio_s"])) for e in d.events(job, timeout=120)
            if e.get("type") == "segment" and e.get("audio_s")]


def late(pk: list[tuple[float, float]], slop: float = 0.05) -> int:
    """Packets a listener who plays from the first one on waits for (more than `slop`)."""
    n, clock = 0, None
    for ts, seconds in pk:
        if clock is not None and ts > clock + slop:
            n += 1
        clock = (max(clock, ts) if clock is not None else ts) + seconds
    return n


def started_at(d: RunningDaemon, job: str) -> float:
    return next(float(e["ts"]) for e in d.events(job, timeout=120) if e.get("type") == "stage_started")


def ended_at(d: RunningDaemon, job: str) -> float:
    return float(d.events(job, timeout=120)[-1]["ts"])


def fill(d: RunningDaemon, pipeline: str) -> tuple[list[str], tuple[int, dict[str, str], dict[str, Any]]]:
    """Streams until the pipeline admits no more: (the ids of those that started at once, the answer
    to the first that did not: a 201 with its place in line, or a 503). (The daemon's capacity figure
    may move as streams start, on a busy host: the answers say what it decided.)"""
    snap = measured(d, pipeline)
    stage = "q" if pipeline == "speech" else "r"
    running: list[str] = []
    for _ in range(8):
        status, headers, doc = post(d, "/v1/jobs", {"pipeline": pipeline, "params": {stage: LONG}})
        if status == 201 and "stream" not in doc:
            running.append(doc["id"])
            continue
        assert running, (snap, status, doc)            # (an idle pipeline always takes one)
        return running, (status, headers, doc)
    raise AssertionError(f"8 streams started at once: {snap}, {realtime(d, pipeline)}")


def test_past_capacity_streams_wait_in_a_known_place_then_are_refused(d: RunningDaemon) -> None:
    running, (status, _, doc) = fill(d, "speech")
    n = len(running)
    waiting = []
    for i in range(3):
        if i:
            status, _, doc = post(d, "/v1/jobs", {"pipeline": "speech", "params": {"q": LONG}})
        assert status == 201, doc
        assert doc["stream"]["position"] == i + 1 and doc["stream"]["running"] == n, doc
        assert doc["stream"]["estimated_start_s"] > 0, doc
        waiting.append(doc["id"])
        got = d.client.job(doc["id"])
        assert got["state"] == "queued" and got["stream"]["position"] == i + 1, got
    estimates = [d.client.job(j)["stream"]["estimated_start_s"] for j in waiting]
    # (each read is seconds from its own moment: streams that start together read a few ms apart)
    assert all(b >= a - 0.05 for a, b in zip(estimates, estimates[1:])), estimates
    # past max_waiting_streams: 503 over_capacity, with a Retry-After of when a stream should end
    status, headers, doc = post(d, "/v1/jobs", {"pipeline": "speech", "params": {"q": LONG}})
    assert status == 503 and doc["error"]["code"] == "over_capacity", doc
    assert int(headers["retry-after"]) >= 1, headers
    assert "max_waiting_streams" in doc["error"]["message"], doc
    snap = realtime(d, "speech")
    assert snap["running"] == n and snap["waiting"] == 3 and snap["refused"] >= 1, snap
    # the admitted streams play on time; each waiting one starts only when a running one has ended
    for job in running:
        assert d.wait(job)["state"] == "succeeded"
        pk = packets(d, job)
        assert len(pk) == LONG["packets"] and late(pk) == 0, (n, pk)
    first_end = min(ended_at(d, j) for j in running)
    early = 0
    for job in waiting:
        assert d.wait(job)["state"] == "succeeded"
        early += started_at(d, job) < first_end - 0.05
    # a waiting stream starts when a slot frees: a stream's end, or (on a loaded host, whose lone
    # warm-up measured the stage dearer than its batches) the first window of these streams
    # raising the capacity: by as many as it rose, no more
    rose = max(0, realtime(d, "speech")["streams"] - n)
    assert early <= rose, f"{early} waiting streams started before a slot freed (capacity {n} -> {n + rose})"
    # and never past the stage's bound: 0.2 busy s an audio s at least, 5 audio s/s x margin 0.75
    assert n + rose <= 3, (n, rose, realtime(d, "speech"))


def test_refuse_mode_answers_503_at_once_with_retry_after(d: RunningDaemon) -> None:
    running, (status, headers, doc) = fill(d, "refusing")
    assert status == 503 and doc["error"]["code"] == "over_capacity", doc
    assert int(headers["retry-after"]) >= 1, headers
    t0 = time.monotonic()
    status, headers, doc = post(d, "/v1/jobs", {"pipeline": "refusing", "params": {"r": LONG}})
    took = time.monotonic() - t0
    assert status == 503 and int(headers["retry-after"]) >= 1 and took < 5, (status, headers, took)
    # the Python client hands its caller the wait
    with pytest.raises(ApiError) as refused:
        d.client.submit("refusing", {}, {"r": LONG})
    assert refused.value.status == 503 and refused.value.code == "over_capacity", refused.value
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1, refused.value.retry_after
    # OpenAI's shape on the OpenAI paths, with the same header
    status, headers, doc = post(d, "/v1/audio/speech", {"model": "refusing", "input": "hello"})
    assert status == 503, doc
    assert doc["error"]["code"] == "over_capacity" and int(headers["retry-after"]) >= 1, (headers, doc)
    for job in running:
        assert d.wait(job)["state"] == "succeeded"
    status, _, doc = post(d, "/v1/jobs", {"pipeline": "refusing", "params": {"r": {"packets": 5}}})
    assert status == 201, doc               # capacity free again
    assert d.wait(doc["id"])["state"] == "succeeded"


def test_a_higher_priority_stream_starts_first(d: RunningDaemon) -> None:
    running, (status, _, first) = fill(d, "speech")
    assert status == 201 and first["stream"]["position"] == 1, first
    status, _, low = post(d, "/v1/jobs", {"pipeline": "speech", "priority": 5, "params": {"q": {"packets": 5}}})
    assert status == 201 and low["stream"]["position"] == 2, low
    status, _, high = post(d, "/v1/jobs", {"pipeline": "speech", "priority": -1, "params": {"q": {"packets": 5}}})
    assert status == 201 and high["stream"]["position"] == 1, high     # ahead of the earlier, less urgent ones
    assert d.client.job(low["id"])["stream"]["position"] == 3
    for job in running + [first["id"], low["id"], high["id"]]:
        assert d.wait(job)["state"] == "succeeded"
    assert started_at(d, high["id"]) <= started_at(d, first["id"]) <= started_at(d, low["id"])


def test_slack_orders_a_batch(d: RunningDaemon) -> None:
    """A stage that steps one session a step (`max_batch = 1`): a stream that joins late, with no audio
    yet, is stepped before the one that has seconds of audio buffered at its listener (in the order
    the sessions opened, the first would take every step until it ended)."""
    params = {"b": {"packets": 60, "max_batch": 1}}
    a = d.submit("plain", {}, params)
    wait_for(lambda: d.client.job(a)["stages"]["b"]["segments"] >= 15, 30,
             "the first stream to be well ahead of its listener")
    b = d.submit("plain", {}, {"b": {"packets": 10, "max_batch": 1}})
    assert d.wait(b)["state"] == "succeeded" and d.wait(a)["state"] == "succeeded"
    a_packets, b_packets = packets(d, a), packets(d, b)
    assert len(a_packets) == 60 and len(b_packets) == 10
    # b spoke while a was still speaking: its last packet came before a's last one
    assert b_packets[-1][0] < a_packets[-1][0], (b_packets[-1], a_packets[-1])
    # and neither listener waited: a had audio to spare while b caught up
    assert late(a_packets) == 0 and late(b_packets) == 0


def test_a_stream_far_ahead_yields_its_steps_to_a_starting_one(d: RunningDaemon) -> None:
    """`yield_ahead_s` (default 1 s): while a stream starts (no audio yet, then under half a second at
    its listener), one holding seconds of audio sits out the steps, so that the newcomer's first
    packets come as fast as alone's; it goes on after, and neither listener waits."""
    ahead = d.submit("plain", {}, {"b": {"packets": 100, "packet_s": 0.5, "pace_ahead_s": 0}})
    wait_for(lambda: d.client.job(ahead)["stages"]["b"]["segments"] >= 10, 30,
             "the first stream to hold seconds of audio at its listener")
    new = d.submit("plain", {}, {"b": {"packets": 10}})
    assert d.wait(new)["state"] == "succeeded" and d.wait(ahead)["state"] == "succeeded"
    a_packets, b_packets = packets(d, ahead), packets(d, new)
    start, held = b_packets[0][0], b_packets[4][0]      # the newcomer's first packet, and its fifth (0.5 s)
    assert a_packets[-1][0] > held, "the first stream ended before the second started: nothing to yield"
    during = [ts for ts, _ in a_packets if start < ts < held]
    assert during == [], f"the stream far ahead was stepped {len(during)} times while the new one started"
    assert late(a_packets) == 0 and late(b_packets) == 0


def test_a_new_stream_waits_until_the_one_before_it_holds_start_slack(d: RunningDaemon) -> None:
    """`start_slack_s`: with room for both, the second of two streams submitted together waits (in
    line, not refused) until the first holds that much audio at its listener: a start's burst never
    lands on a stream that has not buffered yet."""
    snap = measured(d, "ramping")
    assert snap["streams"] >= 2, snap
    status, _, first = post(d, "/v1/jobs", {"pipeline": "ramping", "params": {"b": {"packets": 30}}})
    assert status == 201 and "stream" not in first, first          # an idle pipeline: at once
    status, _, second = post(d, "/v1/jobs", {"pipeline": "ramping", "params": {"b": {"packets": 10}}})
    assert status == 201 and second["stream"]["position"] == 1, second     # room, yet it waits
    assert d.wait(first["id"])["state"] == "succeeded" and d.wait(second["id"])["state"] == "succeeded"
    a = packets(d, first["id"])
    began = started_at(d, second["id"])
    held = sum(s for ts, s in a if ts <= began) - (began - a[0][0])     # the first's listener's buffer then
    assert held >= RAMP_SLACK_S - 0.1, (held, a[:8], began)
    assert began - a[0][0] < 2.0, (began, a[0])     # and no longer than that took: a packet let it go
    assert late(a) == 0 and late(packets(d, second["id"])) == 0


def test_capacity_follows_a_stage_that_slows_down(d: RunningDaemon) -> None:
    before = measured(d, "speech")
    slow = Path(d.dir) / "slow"

    def keep_speaking() -> None:
        job = d.submit("speech", {}, {"q": {"packets": 30}})
        assert d.wait(job)["state"] == "succeeded"

    try:
        slow.touch()                        # each step now costs three times as much
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            keep_speaking()
            now = realtime(d, "speech")
            if now["audio_per_s"] < 0.6 * before["audio_per_s"]:
                break
        else:
            pytest.fail(f"capacity did not follow: before {before}, now {now}")
        assert now["streams"] < before["streams"] or before["streams"] <= 1, (before, now)
    finally:
        slow.unlink(missing_ok=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:      # and back, with no restart
        keep_speaking()
        if realtime(d, "speech")["audio_per_s"] > 0.8 * before["audio_per_s"]:
            break
    else:
        pytest.fail(f"capacity did not come back: before {before}, now {realtime(d, 'speech')}")


def test_the_capacity_at_ready_counts_no_loading_work(d: RunningDaemon) -> None:
    """The warm-up job's figure is what serving costs: the CPU seconds its stage's engine took to load
    (4 s, for the 4 audio seconds the warm-up speaks) are not counted as the warm-up's work. Counted,
    they read as 1 CPU s per audio s, and the pipeline would admit a fraction of what it serves."""
    snap = measured(d, "heavy")
    cores = len(os.sched_getaffinity(0))
    cpu_per_audio_s = snap["cost_per_audio_s"]["cpu"] * cores
    assert cpu_per_audio_s < 0.25 * HEAVY_LOAD_CPU_S / 4.0, snap
    busy_bound = 1.0 / snap["cost_per_audio_s"]["h"]        # (0.02 s of sleep a 0.1 s packet: about 5)
    assert snap["audio_per_s"] >= 0.9 * busy_bound, snap


def test_kill9_mid_stream_fails_exactly_its_streams_then_the_waiting_start(d: RunningDaemon) -> None:
    running, (status, _, doc) = fill(d, "speech")
    assert status == 201 and doc["stream"]["position"] == 1, doc
    queued = doc["id"]
    wait_for(lambda: all(d.client.job(j)["state"] == "running" for j in running), 30, "the streams to run")
    os.kill(d.stage_pid("q"), signal.SIGKILL)
    for job in running:
        doc = d.wait(job)
        assert doc["state"] == "failed" and doc["error"]["code"] == "worker_died", doc
    # their slots are free, but the waiting stream does not start into the restart: it waits for
    # the next worker's warm-up (it used to start at once, its first packet behind the reload)
    waiting = d.client.job(queued)
    assert waiting.get("stream", {}).get("position") == 1, waiting
    # the restarted worker warms up again, then the waiting stream starts and plays
    assert d.wait(queued, timeout=120)["state"] == "succeeded"
    assert len(packets(d, queued)) == LONG["packets"]


def test_bad_realtime_config_is_exit_2_naming_the_key(tmp_path: Path) -> None:
    proc = check_config(tmp_path, {"s": dict(SPEAKER)},
                        {"p": {"stages": ["s"], "realtime": {"overload": "drop", "margin": 1.5,
                                                             "max_waiting_streams": -1, "sure": True}}})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for words in ("pipelines.p.realtime.overload", "pipelines.p.realtime.margin",
                  "pipelines.p.realtime.max_waiting_streams", "pipelines.p.realtime.sure"):
        assert words in proc.stderr, proc.stderr


def test_a_client_that_hangs_up_while_waiting_leaves_the_line_at_once(d: RunningDaemon) -> None:
    running, (status, _, first) = fill(d, "speech")
    assert status == 201, first
    conn = UnixHTTPConnection(str(d.socket), timeout=30)
    conn.request("POST", "/v1/audio/speech", json.dumps({"model": "speech", "input": "hello", "stream_format": "sse"}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    job = resp.getheader("X-Omnid-Job")
    assert job and int(resp.getheader("X-Omnid-Queue-Position") or 0) == 2, resp.getheaders()
    assert float(resp.getheader("X-Omnid-Estimated-Start") or -1) >= 0, resp.getheaders()
    assert realtime(d, "speech")["waiting"] == 2
    conn.close()                            # the client goes away while its stream waits
    t0 = time.monotonic()
    wait_for(lambda: d.client.job(job)["state"] == "cancelled", 10, "the waiting stream to leave the line")
    assert time.monotonic() - t0 < 3
    assert "stream" not in d.client.job(job) and realtime(d, "speech")["waiting"] <= 1
    for j in running + [first["id"]]:
        assert d.wait(j)["state"] == "succeeded"


def test_the_stream_documents_match_the_openapi_document(d: RunningDaemon) -> None:
    import jsonschema
    from test_discovery import check

    conn = UnixHTTPConnection(str(d.socket), timeout=30)
    conn.request("GET", "/v1/openapi.json")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    running, (status, _, first) = fill(d, "speech")
    assert status == 201
    check(doc, "POST", "/v1/jobs", 201, first)
    check(doc, "GET", "/v1/jobs/{id}", 200, d.client.job(first["id"]))
    check(doc, "GET", "/v1/stages", 200, d.client.stages())
    check(doc, "GET", "/v1/pipelines", 200, d.client.pipelines())
    status, _, refused = post(d, "/v1/jobs", {"pipeline": "refusing", "params": {"r": LONG}})
    for job in running:
        wait_for(lambda: "stream" in d.client.job(job) or d.client.job(job)["state"] != "running", 30, "audio")
        check(doc, "GET", "/v1/jobs/{id}", 200, d.client.job(job))
    for job in running + [first["id"]]:
        assert d.wait(job)["state"] == "succeeded"
    with __import__("pytest").raises(jsonschema.ValidationError):      # (the check is a real one)
        check(doc, "GET", "/v1/jobs/{id}", 200, {**d.client.job(first["id"]), "stream": {"position": "first"}})
