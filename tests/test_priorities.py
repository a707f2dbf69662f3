"""Who goes first: priorities, fair share between owners, the bound on waiting, and keys that are
not root, with real daemons.

One module daemon (python stages, and one tiny vLLM stage for the engine's preemption by priority;
its tests are marked `vllm`) serves the socket and a TCP port, its keys made with the real `omnictl key add`. Two small
python-only daemons of their own: one with a short `max_wait_s` (no starvation), one killed with
SIGKILL and started again on its state (priorities kept with the queue).
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import (
    RunningDaemon,
    build_tiny_models,
    module_daemon,
    omnictl,
    py_stage,
    short_tmpdir,
    sleeper,
    tiny_llm,
    wait_end,
    wait_for,
    wait_started,
)

httpx = pytest.importorskip("httpx")

PLAIN_UID, BOSS_UID, CAPPED_UID = 61010, 61011, 61012
WEIGHTS = {"w1": 1, "w2": 2, "w3": 3}
FAIR_JOBS = {"w1": 40, "w2": 80, "w3": 120}
WINDOW = 180            # the first jobs started, all three owners still backlogged: 30 / 60 / 90 expected


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_key(d: RunningDaemon, name: str, *args: str) -> str:
    """`omnictl key add`, for real: the key is the last line it prints."""
    done = omnictl(d, "key", "add", name, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def tcp(d: RunningDaemon, key: str) -> Any:
    return httpx.Client(base_url=d.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)  # type: ignore[attr-defined]


def started_order(d: RunningDaemon, jobs: list[str]) -> list[str]:
    docs = {j: wait_end(d, j, timeout=120) for j in jobs}
    for j, doc in docs.items():
        assert doc["state"] == "succeeded", doc
    return sorted(jobs, key=lambda j: docs[j]["started_at"])


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm")
    d = short_tmpdir()
    port = free_port()
    stages = {
        "slow": sleeper(0.3),
        "fair": sleeper(0.01),
        "hold": sleeper(30.0),
        "spare": py_stage("echo"),
        # The KV cache is 6 blocks of 32 tokens: three long answers cannot all hold theirs, so vLLM
        # preempts, the least urgent first (scheduling_policy "priority", omnid's default).
        "gen": tiny_llm({"max_tokens": 16, "ignore_eos": True, "temperature": 0.0}, max_model_len=128,
                        args={"block_size": 32, "num_gpu_blocks_override": 6}, max_inflight=8),
    }
    pipelines = {name: {"stages": [name]} for name in stages}
    owners = {"default": {"max_priority": 0}, "key:boss": {"max_priority": -5}, "key:capped": {"max_queued": 2},
              **{f"key:{k}": {"weight": w} for k, w in WEIGHTS.items()}}
    with module_daemon(d, stages, pipelines, {"listen": [f"127.0.0.1:{port}"], "max_queued_jobs": 1000,
                                              "max_wait_s": 120.0, "owners": owners}) as rd:
        rd.base = f"http://127.0.0.1:{port}"          # type: ignore[attr-defined]
        yield rd


@pytest.fixture(scope="module")
def keys(daemon: RunningDaemon) -> dict[str, str]:
    made = {"plain": add_key(daemon, "plain", "--uid", str(PLAIN_UID)),
            "root0": add_key(daemon, "root0", "--uid", "0"),
            "boss": add_key(daemon, "boss", "--uid", str(BOSS_UID), "--admin"),
            "capped": add_key(daemon, "capped", "--uid", str(CAPPED_UID))}
    for i, name in enumerate(WEIGHTS):
        made[name] = add_key(daemon, name, "--uid", str(61020 + i))
    return made


# ------------------------------------------------------------------------- priorities


@pytest.mark.vllm
def test_a_stage_takes_its_queued_jobs_by_priority_and_omnictl_says_where_each_waits(daemon: RunningDaemon) -> None:
    gate = daemon.submit("slow", params={"slow": {"seconds": 60.0}})       # cancelled once they all wait
    wait_started(daemon, gate, "slow")
    priorities = [0, 5, -1, 3, -2]           # root on the socket may ask any priority
    jobs = []
    for p in priorities:
        if p == 3:                              # omnictl submit --priority
            done = omnictl(daemon, "submit", "slow", "--priority", str(p))
            assert done.returncode == 0, done.stderr
            jobs.append(done.stdout.strip())
        else:
            jobs.append(daemon.client.submit("slow", {}, None, None, p)["id"])
    by_priority = [j for _, j in sorted(zip(priorities, jobs))]
    # Where each waits, while the gate runs: its place is its rank among them.
    last = by_priority[-1]
    doc = daemon.client.job(last)
    assert doc["priority"] == 5 and doc["queue"]["slow"]["position"] == 5, doc.get("queue")
    assert doc["queue"]["slow"]["ahead_by_priority"] == {"-2": 1, "-1": 1, "0": 1, "3": 1}
    shown = omnictl(daemon, "status", last)
    assert shown.returncode == 0, shown.stderr
    assert "queue slow" in shown.stdout and "5th: 4 ahead" in shown.stdout and "1 running" in shown.stdout, shown.stdout
    assert "priority" in shown.stdout
    assert "queue" not in daemon.client.job(gate)         # running: in no queue
    daemon.client.cancel(gate)
    assert started_order(daemon, jobs) == by_priority


@pytest.mark.vllm
def test_priority_is_checked_and_bounded_by_max_priority_in_each_paths_error_shape(
        daemon: RunningDaemon, keys: dict[str, str]) -> None:
    with tcp(daemon, keys["plain"]) as c:
        for bad in ("high", 1.5, True, 10**7):
            r = c.post("/v1/jobs", json={"pipeline": "spare", "priority": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        r = c.post("/v1/jobs", json={"pipeline": "spare", "inputs": {"text": "x"}, "priority": -1})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "priority_not_allowed" and r.json()["error"]["max_priority"] == 0
        r = c.post("/v1/jobs", json={"pipeline": "spare", "inputs": {"text": "x"}, "priority": 4})
        assert r.status_code == 201 and r.json()["priority"] == 4 and r.json()["key"] == "plain", r.text
        # vLLM's extra field on the OpenAI paths: the same bound, in OpenAI's error shape
        r = c.post("/v1/chat/completions", json={"model": "gen", "priority": -3,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "priority_not_allowed" and err["param"] == "priority" and "type" in err, err
        r = c.post("/v1/completions", json={"model": "gen", "prompt": "a", "priority": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    with tcp(daemon, keys["boss"]) as c:     # its own max_priority: -5
        r = c.post("/v1/completions", json={"model": "gen", "prompt": "the sea", "max_tokens": 4, "priority": -5})
        assert r.status_code == 200, r.text
        job = r.headers["X-Omnid-Job"]
        assert c.get(f"/v1/jobs/{job}").json()["priority"] == -5
        assert c.post("/v1/jobs", json={"pipeline": "spare", "priority": -6}).status_code == 403


@pytest.mark.vllm
def test_an_owners_queued_jobs_are_bounded_with_429_and_retry_after(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    with tcp(daemon, keys["capped"]) as c:
        first = c.post("/v1/jobs", json={"pipeline": "hold"}).json()["id"]
        wait_started(daemon, first, "hold")
        queued = [c.post("/v1/jobs", json={"pipeline": "hold"}).json()["id"] for _ in range(2)]
        r = c.post("/v1/jobs", json={"pipeline": "hold"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "owner_queue_full", r.text
        assert int(r.headers["Retry-After"]) >= 1
        for job in [first, *queued]:
            c.post(f"/v1/jobs/{job}/cancel")
        r = c.post("/v1/jobs", json={"pipeline": "spare", "inputs": {"text": "again"}})
        assert r.status_code == 201, r.text


@pytest.mark.vllm
def test_vllm_preempts_running_requests_for_a_more_urgent_one(daemon: RunningDaemon) -> None:
    long = {"gen": {"max_tokens": 112}}
    lows = [daemon.client.submit("gen", {"prompt": f"tell a long story {i}"}, long, None, 5)["id"] for i in range(3)]
    for job in lows:
        wait_started(daemon, job, "gen")
    # Past 32 tokens each holds two blocks: the cache is full, the urgent one waits for room.
    wait_for(lambda: all(daemon.client.job(j)["stages"]["gen"]["segments"] >= 40 for j in lows), 120,
             "the three low-priority answers to stream")
    urgent = daemon.client.submit("gen", {"prompt": "quick"}, {"gen": {"max_tokens": 8}}, None, -5)["id"]
    docs = {j: wait_end(daemon, j, timeout=240) for j in [*lows, urgent]}
    assert all(doc["state"] == "succeeded" for doc in docs.values()), docs
    ahead_of = [j for j in lows if docs[j]["finished_at"] > docs[urgent]["finished_at"]]
    # When a running answer needs a block, vLLM preempts one: under "fcfs" the urgent one waits behind
    # the preempted ones (it ends after two of the long ones); under "priority" it goes in at the
    # first room and ends before at least two of them.
    assert len(ahead_of) >= 2, {j: (d["priority"], d["started_at"], d["finished_at"]) for j, d in docs.items()}


# ------------------------------------------------------------------------- fair share


@pytest.mark.vllm
def test_fair_share_serves_three_owners_by_their_weights(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    gate = daemon.submit("fair", params={"fair": {"seconds": 60.0}})
    wait_started(daemon, gate, "fair")
    owner: dict[str, str] = {}
    for name, n in FAIR_JOBS.items():           # all of w1's first: arrival order would serve w1 first
        with tcp(daemon, keys[name]) as c:
            for _ in range(n):
                r = c.post("/v1/jobs", json={"pipeline": "fair"})
                assert r.status_code == 201, r.text
                owner[r.json()["id"]] = name
    daemon.client.cancel(gate)
    order = started_order(daemon, list(owner))
    counts = Counter(owner[j] for j in order[:WINDOW])
    total = sum(WEIGHTS.values())
    for name, weight in WEIGHTS.items():
        expected = WINDOW * weight / total
        assert abs(counts[name] - expected) <= 0.1 * expected, (counts, {n: WINDOW * w / total for n, w in WEIGHTS.items()})


# ------------------------------------------------------------------------- keys that are not root


@pytest.mark.vllm
def test_root_must_name_a_keys_uid(daemon: RunningDaemon) -> None:
    done = omnictl(daemon, "key", "add", "nobody-said")
    assert done.returncode != 0 and "--uid" in done.stderr, (done.stdout, done.stderr)


@pytest.mark.vllm
def test_a_key_without_admin_is_refused_every_admin_action_and_an_admin_key_may(
        daemon: RunningDaemon, keys: dict[str, str]) -> None:
    with tcp(daemon, keys["plain"]) as plain:
        theirs = plain.post("/v1/jobs", json={"pipeline": "hold"}).json()["id"]
    actions: list[tuple[str, str]] = [("POST", "/v1/stages/spare/restart"), ("POST", "/v1/stages/spare/sleep"),
                                      ("POST", "/v1/stages/spare/wake"), ("POST", "/v1/reload"),
                                      ("GET", "/v1/stages/spare/logs?tail=1"), ("GET", "/v1/logs?tail=1")]
    for name in ("plain", "root0"):             # uid 0 alone is not enough over TCP
        with tcp(daemon, keys[name]) as c:
            for method, path in actions:
                r = c.request(method, path)
                assert r.status_code == 403 and r.json()["error"]["code"] == "not_admin", (name, path, r.text)
            if name == "root0":
                r = c.post(f"/v1/jobs/{theirs}/cancel")
                assert r.status_code == 403 and r.json()["error"]["code"] == "not_yours", r.text
                assert c.get(f"/v1/jobs/{theirs}").status_code == 403
    assert daemon.client.job(theirs)["state"] in ("queued", "running")
    with tcp(daemon, keys["boss"]) as boss:
        assert boss.get(f"/v1/jobs/{theirs}").status_code == 200
        r = boss.post(f"/v1/jobs/{theirs}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert boss.post("/v1/stages/spare/sleep").status_code in (200, 202)
        wait_for(lambda: daemon.stages()["spare"]["state"] == "sleeping", 60, "spare to sleep")
        assert boss.post("/v1/stages/spare/wake").status_code in (200, 202)
        daemon.wait_stage_state("spare", ("ready",), 60)
        assert boss.post("/v1/stages/spare/restart").status_code == 202
        r = boss.post("/v1/reload")
        assert r.status_code == 200 and r.json()["reloaded"] is True, r.text
        assert boss.get("/v1/stages/spare/logs?tail=1").status_code == 200
        assert boss.get("/v1/logs?tail=1").status_code == 200
    daemon.wait_stage_state("spare", ("ready",), 60)
    audit = [json.loads(line) for line in daemon.log().splitlines() if '"audit"' in line and line.startswith("{")]
    done = {(a.get("action"), a.get("key")) for a in audit}
    for action in ("restart_stage", "sleep_stage", "wake_stage", "reload", "cancel"):
        assert (action, "boss") in done, (action, sorted(map(str, done)))
    refused = [a for a in audit if a.get("action") == "refused" and a.get("why") == "not_admin"]
    assert {a.get("key") for a in refused} >= {"plain", "root0"}


# ------------------------------------------------------------------------- daemons of their own


def test_no_job_starves_under_a_stream_of_more_urgent_ones(start_daemon: Callable[..., RunningDaemon]) -> None:
    max_wait = 1.5
    d = start_daemon({"s": sleeper(0.1, queue_capacity=1)}, {"s": {"stages": ["s"]}}, {"max_wait_s": max_wait})
    urgent = [d.client.submit("s", {}, None, None, -1)["id"] for _ in range(4)]
    low = d.client.submit("s", {}, None, None, 5)["id"]
    deadline = time.monotonic() + 60
    while d.client.job(low)["state"] == "queued" and time.monotonic() < deadline:
        queued = sum(1 for j in urgent[-8:] if d.client.job(j)["state"] == "queued")
        for _ in range(max(0, 4 - queued)):        # always more urgent work waiting
            urgent.append(d.client.submit("s", {}, None, None, -1)["id"])
        time.sleep(0.05)
    doc = wait_end(d, low, timeout=60)
    assert doc["state"] == "succeeded"
    later = [j for j in urgent if (u := d.client.job(j))["created_at"] > doc["created_at"] and u["started_at"]
             and u["started_at"] < doc["started_at"]]
    still_queued = [j for j in urgent if (u := d.client.job(j))["started_at"] is None or u["started_at"] > doc["started_at"]]
    assert still_queued, "the urgent stream ran dry: the test proved nothing"
    # The bound: once it waited max_wait_s it goes next; a 0.1 s stage runs about max_wait_s / 0.1 jobs
    # meanwhile, plus the ones already given a place in the stage's queue (queue_capacity + 1).
    assert len(later) <= max_wait / 0.1 + 3, (len(later), doc["started_at"] - doc["created_at"])
    for j in urgent:
        d.client.cancel(j)


def test_priorities_are_kept_across_a_kill_9(start_daemon: Callable[..., RunningDaemon]) -> None:
    stages = {"s": sleeper(0.2, queue_capacity=1)}
    pipelines = {"s": {"stages": ["s"]}}
    d = start_daemon(stages, pipelines)
    gate = d.submit("s", params={"s": {"seconds": 60.0}})
    wait_started(d, gate, "s")
    priorities = [3, 0, -2, 1, 2]
    jobs = [d.client.submit("s", {}, None, None, p)["id"] for p in priorities]
    d.kill9()
    again = start_daemon(stages, pipelines, dir=d.dir)
    assert [again.client.job(j)["priority"] for j in jobs] == priorities
    assert started_order(again, jobs) == [j for _, j in sorted(zip(priorities, jobs))]
    assert wait_end(again, gate)["state"] == "failed"        # it was running: no retries
