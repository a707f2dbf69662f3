"""How data moves through pipelines: pipelining, backpressure, edge mapping and
transforms, fan-out/fan-in, stages shared between pipelines, streamed segments.

Every test runs a real daemon (`start_daemon`) with python stages from
tests/fixtures/teststages.py; waits are on events or polled conditions with
deadlines, and timing figures are asserted only loosely.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from conftest import RunningDaemon, py_stage, wait_for

T = 0.3            # one stage's work in the pipelining test, seconds


def metric(text: str, name: str, stage: str) -> float:
    """One sample of a per-stage metric in Prometheus text format."""
    m = re.search(rf'^{name}(?:_total)?\{{replica="0",stage="{stage}"\}} (\S+)$', text, re.M)
    assert m, f"no {name} for stage {stage} in /metrics:\n{text}"
    return float(m.group(1))


# ------------------------------------------------------------------ (a) pipelining


def test_two_stages_pipeline_jobs(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"a": py_stage("sleep", defaults={"seconds": T}),
                      "b": py_stage("sleep", defaults={"seconds": T})},
                     {"ab": {"stages": ["a", "b"]}})
    n = 6
    t0 = time.monotonic()
    jobs = [d.submit("ab", {"text": f"j{k}"}) for k in range(n)]
    docs = [d.wait(j, timeout=60) for j in jobs]
    total = time.monotonic() - t0

    assert [doc["state"] for doc in docs] == ["succeeded"] * n, docs
    serial = 2 * n * T
    # Pipelined: about (n + 1) * T; one stage after the other would take 2 * n * T.
    assert total < 0.8 * serial, f"{n} jobs took {total:.2f} s; serial would be {serial:.1f} s"
    for k in range(n - 1):
        a_next = docs[k + 1]["stages"]["a"]
        b_this = docs[k]["stages"]["b"]
        assert a_next["started_at"] < b_this["finished_at"], \
            f"stage a started job {k + 1} only after stage b finished job {k}"
    # Some overlap really happened: a ran a job while b ran an earlier one.
    overlaps = [max(0.0, min(docs[k + 1]["stages"]["a"]["finished_at"], docs[k]["stages"]["b"]["finished_at"])
                    - max(docs[k + 1]["stages"]["a"]["started_at"], docs[k]["stages"]["b"]["started_at"]))
                for k in range(n - 1)]
    assert sum(overlaps) > T, f"stages barely overlapped: {overlaps}"
    # Each job passed through both stages, in order.
    text, _ = d.client.output(jobs[0], "text")
    assert text.decode() == "j0|a|b"


# ------------------------------------------------------------------ (b) backpressure


def test_backpressure_blocks_upstream_and_keeps_order(start_daemon: Callable[..., RunningDaemon]) -> None:
    slow = 0.4
    d = start_daemon({"fast": py_stage("sleep", defaults={"seconds": 0.1}),
                      "slow": py_stage("sleep", defaults={"seconds": slow}, queue_capacity=1)},
                     {"fs": {"stages": ["fast", "slow"]}})
    n = 5
    jobs = [d.submit("fs", {"text": f"j{k}"}) for k in range(n)]

    depths: list[int] = []
    done = threading.Event()
    finished: list[dict[str, Any]] = []

    def waiter() -> None:
        try:
            finished.extend(d.wait(j, timeout=60) for j in jobs)
        finally:
            done.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    blocked_seen = 0.0
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        snap = d.stages()["slow"]
        assert snap["queue_capacity"] == 1
        depths.append(snap["queue_depth"])
        blocked_seen = max(blocked_seen, metric(d.client.metrics(), "omnid_stage_blocked_seconds", "fast"))
        time.sleep(0.03)
    t.join(5)

    assert [doc["state"] for doc in finished] == ["succeeded"] * n, finished
    # The queue filled up to its watermark, and never past it.
    assert max(depths) == 1, f"slow's queue depths: {depths}"
    # The upstream really waited on the downstream's watermark ...
    blocked_end = metric(d.client.metrics(), "omnid_stage_blocked_seconds", "fast")
    assert max(blocked_seen, blocked_end) > slow / 2, f"fast was never blocked: {blocked_end}"
    # ... so it could not run far ahead: it finished job k + 2 only after slow started job k
    # (slow holds one job and its queue one more).
    for k in range(n - 2):
        assert finished[k + 2]["stages"]["fast"]["finished_at"] >= finished[k]["stages"]["slow"]["started_at"], \
            f"fast finished job {k + 2} before slow took job {k} out of its queue"
    # Everything came out in order.
    ends = [doc["stages"]["slow"]["finished_at"] for doc in finished]
    assert ends == sorted(ends)
    for k, job in enumerate(jobs):
        assert d.client.output(job, "text")[0].decode() == f"j{k}|fast|slow"


# ------------------------------------------------------------------ (c) edge map and transform


def test_edge_map_renames_outputs(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(
        {"up": py_stage("echo", defaults={"tag": "up"}), "down": py_stage("collect")},
        {"same": {"stages": ["up", "down"], "edges": [{"from": "up", "to": "down", "map": {"text": "text"}}]},
         "renamed": {"stages": ["up", "down"],
                     "edges": [{"from": "up", "to": "down", "map": {"prompt": "text", "up_pid": "pid"}}]},
         "missing": {"stages": ["up", "down"],
                     "edges": [{"from": "up", "to": "down", "map": {"text": "no_such_output"}}]}})
    same = d.wait(d.submit("same", {"text": "x"}))
    assert same["state"] == "succeeded", same
    assert d.client.output(same["id"], "keys")[0].decode() == "text"          # `pid` was not mapped

    renamed = d.wait(d.submit("renamed", {"text": "x"}))
    assert renamed["state"] == "succeeded", renamed
    assert d.client.output(renamed["id"], "keys")[0].decode() == "prompt,up_pid"
    got = json.loads(d.client.output(renamed["id"], "got")[0])
    assert got == {"prompt": "up:x", "up_pid": d.stage_pid("up")}

    missing = d.wait(d.submit("missing", {"text": "x"}))
    assert missing["state"] == "failed", missing
    msg = missing["error"]["message"]
    assert missing["error"]["code"] == "edge_failed"
    assert msg.startswith("stage 'up': edge up -> down maps 'no_such_output'"), msg
    assert missing["stages"]["down"]["state"] != "succeeded"
    # A per-job error: the stages keep serving.
    assert d.wait(d.submit("same", {"text": "y"}))["state"] == "succeeded"


def test_edge_transform(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(
        {"up": py_stage("echo", defaults={"tag": "up"}), "down": py_stage("collect")},
        {"t": {"stages": ["up", "down"],
               "edges": [{"from": "up", "to": "down", "transform": "teststages:shout"}]},
         "tm": {"stages": ["up", "down"],
                "edges": [{"from": "up", "to": "down", "transform": "teststages:shout",
                           "map": {"text": "loud"}}]},
         "bad": {"stages": ["up", "down"],
                 "edges": [{"from": "up", "to": "down", "transform": "teststages:not_a_dict"}]},
         "raises": {"stages": ["up", "down"],
                    "edges": [{"from": "up", "to": "down", "transform": "teststages:broken_transform"}]}})
    doc = d.wait(d.submit("t", {"text": "hi"}))
    assert doc["state"] == "succeeded", doc
    assert json.loads(d.client.output(doc["id"], "got")[0]) == {"loud": "UP:HI!", "via": "shout"}

    doc = d.wait(d.submit("tm", {"text": "hi"}))                # transform first, then the map
    assert doc["state"] == "succeeded", doc
    assert json.loads(d.client.output(doc["id"], "got")[0]) == {"text": "UP:HI!"}

    doc = d.wait(d.submit("bad", {"text": "hi"}))
    assert doc["state"] == "failed"
    assert doc["error"]["code"] == "edge_failed"
    assert "up -> down" in doc["error"]["message"] and "not_a_dict" in doc["error"]["message"], doc["error"]

    doc = d.wait(d.submit("raises", {"text": "hi"}))
    assert doc["state"] == "failed" and doc["error"]["code"] == "edge_failed"
    msg = doc["error"]["message"]
    assert "edge up -> down" in msg and "ValueError: no can do" in msg, msg
    assert d.wait(d.submit("t", {"text": "again"}))["state"] == "succeeded"     # the stage lives on


# ------------------------------------------------------------------ (d) fan-out / fan-in


def test_fan_out_fan_in(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(
        {"a": py_stage("echo", defaults={"tag": "A"}), "b": py_stage("echo", defaults={"tag": "B"}),
         "c": py_stage("echo", defaults={"tag": "C"}), "d": py_stage("collect")},
        {"diamond": {"stages": ["a", "b", "c", "d"],
                     "edges": [{"from": "a", "to": "b"}, {"from": "a", "to": "c"},
                               {"from": "b", "to": "d", "map": {"left": "text"}},
                               {"from": "c", "to": "d", "map": {"right": "text"}}]}})
    jobs = [d.submit("diamond", {"text": f"x{k}"}, params={"c": {"tag": "c"}}) for k in range(3)]
    for k, job in enumerate(jobs):
        doc = d.wait(job)
        assert doc["state"] == "succeeded", doc
        assert all(st["state"] == "succeeded" for st in doc["stages"].values()), doc["stages"]
        got = json.loads(d.client.output(job, "got")[0])
        assert got == {"left": f"B:A:x{k}", "right": f"c:A:x{k}"}
        # d ran once, with both of its inputs (checked above), and every stage ran once.
        started = [ev for ev in d.events(job) if ev["type"] == "stage_started"]
        assert sorted(ev["stage"] for ev in started) == ["a", "b", "c", "d"]


# ------------------------------------------------------------------ (e) a stage shared by pipelines


def test_shared_stage_one_worker(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(
        {"shared": py_stage("echo", defaults={"tag": "s"}), "tail": py_stage("collect")},
        {"alone": {"stages": ["shared"]},
         "chain": {"stages": ["shared", "tail"],
                   "edges": [{"from": "shared", "to": "tail", "map": {"text": "text", "shared_pid": "pid"}}]}})
    before = d.stages()
    pid = before["shared"]["pid"]
    assert pid and before["shared"]["load_s"] is not None

    first = d.wait(d.submit("alone", {"text": "1"}))
    second = d.wait(d.submit("chain", {"text": "2"}))
    assert first["state"] == second["state"] == "succeeded", (first, second)
    assert json.loads(d.client.output(first["id"], "pid")[0]) == pid
    assert json.loads(d.client.output(second["id"], "got")[0]) == {"text": "s:2", "shared_pid": pid}

    again = d.wait(d.submit("chain", {"text": "3"}))
    assert again["state"] == "succeeded"
    after = d.stages()
    for name in ("shared", "tail"):           # no reload: same process, same load
        assert after[name]["pid"] == before[name]["pid"]
        assert after[name]["load_s"] == before[name]["load_s"]
        assert after[name]["restarts"] == 0
    # Counters come with the workers' heartbeats: give them one beat to catch up.
    wait_for(lambda: [d.stages()[s]["jobs_done"] for s in ("shared", "tail")] == [3, 2], 5,
             "jobs_done of shared = 3 and tail = 2")


# ------------------------------------------------------------------ (f) streamed segments


def test_generator_streams_segments(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"gen": py_stage("count", defaults={"n": 4, "delay": 0.05})}, {"g": {"stages": ["gen"]}})
    job = d.submit("g")
    seen: list[tuple[dict[str, Any], float]] = []
    for ev in d.follow(job, 60, f"job {job} to end"):
        seen.append((ev, time.monotonic()))
    segments = [ev for ev, _ in seen if ev["type"] == "segment"]
    assert segments, seen
    assert [s["index"] for s in segments] == list(range(len(segments)))
    assert all(s["stage"] == "gen" and s["job"] == job and "ts" in s for s in segments)
    texts = [s.get("text") for s in segments if s.get("text")]
    assert texts == ["0 ", "1 ", "2 ", "3 "]
    assert segments[-1]["is_last"] is True
    assert not any(s["is_last"] for s in segments[:-1])
    # Streamed: the segments arrived over time, before the job's end.
    times = [t for ev, t in seen if ev["type"] == "segment" and ev.get("text")]
    end = [t for ev, t in seen if ev["type"] == "state" and ev["state"] == "succeeded"][0]
    assert times[-1] - times[0] > 0.05 and times[0] < end
    assert d.client.output(job, "text")[0].decode() == "0 1 2 3 "
    assert d.client.job(job)["stages"]["gen"]["segments"] == len(segments)
