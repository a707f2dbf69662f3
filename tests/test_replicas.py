"""Stage replicas (`replicas = N`): real daemons, real worker processes, real kill -9s.

- jobs spread over the replicas by load, each replica its own process (and its own device set);
  a job's record names the replica that served each stage, and a job stays with its replica;
- one replica killed mid-run: only the job on it is touched (fails, or retries); the others keep
  serving, the stage says `degraded` (and which replica is down) until it is back;
- a replica given up for good hands its queued jobs to the others;
- `/v1/stages`, `/metrics` (label `replica`), `omnictl stages`, `omnictl logs --replica`;
- a reload that changes only `replicas` starts or stops replicas without touching the others.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from conftest import FIXTURES, RunningDaemon, py_stage, wait_for, wait_gone, wait_started
from conftest import omnictl as run_omnictl

Start = Callable[..., RunningDaemon]
omnictl = functools.partial(run_omnictl, timeout=60)


def replica_pids(d: RunningDaemon, stage: str) -> list[int | None]:
    return [r["pid"] for r in d.stages()[stage]["replicas"]]



def test_jobs_spread_over_the_replicas_and_run_at_once(start_daemon: Start, tmp_path: Path) -> None:
    stages = {"front": py_stage("echo"), "slow": py_stage("sleep", defaults={"seconds": 0.6}, replicas=2)}
    d = start_daemon(stages, {"p": {"stages": ["front", "slow"]}})
    snap = d.stages()["slow"]
    assert snap["replica_count"] == 2 and len(snap["replicas"]) == 2 and snap["state"] == "ready"
    pids = replica_pids(d, "slow")
    assert None not in pids and len(set(pids)) == 2
    t0 = time.monotonic()
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(4)]
    docs = [d.wait(j, timeout=60) for j in jobs]
    took = time.monotonic() - t0
    assert [doc["state"] for doc in docs] == ["succeeded"] * 4, [doc["error"] for doc in docs]
    # Each job's record names its replica; the work was shared, two at a time.
    served = [doc["stages"]["slow"]["replica"] for doc in docs]
    assert sorted(served) == [0, 0, 1, 1], served
    ran_on = {int(d.client.output(doc["id"], "pid")[0]) for doc in docs}
    assert ran_on == set(pids)
    assert took < 4 * 0.6, f"4 jobs of 0.6 s on 2 replicas took {took:.2f} s: not in parallel"
    done = [r["jobs_done"] for r in d.stages()["slow"]["replicas"]]
    assert done == [2, 2] and d.stages()["slow"]["jobs_done"] == 4
    # /metrics: every replica, labelled
    text = d.client.metrics()
    assert 'omnid_stage_jobs_done_total{replica="0",stage="slow"} 2.0' in text
    assert 'omnid_stage_jobs_done_total{replica="1",stage="slow"} 2.0' in text
    assert 'omnid_stage_replicas{stage="slow"} 2.0' in text
    assert 'omnid_stage_replicas_up{stage="slow"} 2.0' in text
    # omnictl stages: the stage's row, then one per replica
    out = omnictl(d, "stages").stdout
    assert "  slow#1" in out and "  slow " in out, out
    for pid in pids:
        assert str(pid) in out


def test_each_replica_has_its_own_devices(start_daemon: Start, tmp_path: Path) -> None:
    (tmp_path / "probe_cvd.py").write_text(
        "import os\n"
        "def cvd(inputs, params, ctx):\n"
        "    return {'cvd': os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}\n")
    stage = {"engine": "python", "function": "probe_cvd:cvd", "python_path": [str(tmp_path)],
             "devices": [[0], [1]], "max_inflight": 1}
    d = start_daemon({"s": stage}, {"p": {"stages": ["s"]}})
    snap = d.stages()["s"]
    assert snap["devices"] == [0, 1] and [r["devices"] for r in snap["replicas"]] == [[0], [1]]
    seen = {}
    for _ in range(2):      # one at a time: both idle, the least loaded is the first, then ... each one
        docs = [d.submit("p", {}) for _ in range(2)]
        for doc in (d.wait(j, timeout=60) for j in docs):
            assert doc["state"] == "succeeded", doc
            seen[doc["stages"]["s"]["replica"]] = d.client.output(doc["id"], "cvd")[0].decode()
    assert seen == {0: "0", 1: "1"}


def test_kill_9_of_one_replica_loses_only_its_job(start_daemon: Start) -> None:
    stages = {"slow": py_stage("sleep", defaults={"seconds": 1.5}, replicas=2)}
    d = start_daemon(stages, {"p": {"stages": ["slow"]}}, {"restart_backoff_s": 3.0})
    pids = replica_pids(d, "slow")
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(4)]     # two running, two queued behind them
    for j in jobs[:2]:
        wait_started(d, j, "slow")
    victim = next(j for j in jobs[:2] if d.client.job(j)["stages"]["slow"]["replica"] == 1)
    os.kill(pids[1], signal.SIGKILL)
    # degraded, and saying which replica is down, until it is back
    snap = d.wait_stage_state("slow", ("degraded",), timeout=10)
    assert snap["down"] == ["slow#1"]
    ok, body = d.client.ready()
    assert ok and body["stages"]["slow"] == "degraded" and list(body["replicas_down"]["slow"]) == ["slow#1"]
    health = omnictl(d, "health")
    assert health.returncode == 0 and "down: slow#1" in health.stdout, health.stdout
    docs = {j: d.wait(j, timeout=60) for j in jobs}
    failed = [j for j, doc in docs.items() if doc["state"] != "succeeded"]
    assert failed == [victim], {j: (doc["state"], doc["error"]) for j, doc in docs.items()}
    assert docs[victim]["error"]["code"] == "worker_died"
    assert "replica 1" in docs[victim]["error"]["message"], docs[victim]["error"]
    # the other replica never stopped; the killed one came back
    d.wait_stage_state("slow", ("ready",), timeout=30)
    new = replica_pids(d, "slow")
    assert new[0] == pids[0] and new[1] not in (None, pids[1])
    assert [r["restarts"] for r in d.stages()["slow"]["replicas"]] == [0, 1]


def test_a_replica_given_up_hands_its_queued_jobs_to_the_others(start_daemon: Start) -> None:
    stages = {"slow": py_stage("sleep", defaults={"seconds": 1.0}, replicas=2)}
    d = start_daemon(stages, {"p": {"stages": ["slow"], "retries": 1}}, {"max_restarts": 0})
    pids = replica_pids(d, "slow")
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(6)]
    wait_for(lambda: all(d.client.job(j)["stages"]["slow"]["state"] == "running" for j in jobs[:2]), 20,
             "both replicas to run a job")
    on_one = [j for j in jobs if d.client.job(j)["stages"]["slow"]["replica"] == 1]
    assert len(on_one) == 3
    os.kill(pids[1], signal.SIGKILL)        # max_restarts = 0: replica 1 is given up at once
    snap = d.wait_stage_state("slow", ("degraded",), timeout=10)
    wait_for(lambda: d.stages()["slow"]["replicas"][1]["state"] == "failed", 10, "replica 1 to be given up")
    docs = [d.wait(j, timeout=60) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 6, [(doc["state"], doc["error"]) for doc in docs]
    # everything ended on replica 0: the running one retried there, the queued ones moved there
    assert {doc["stages"]["slow"]["replica"] for doc in docs} == {0}
    assert "slow#1" in snap["down"]
    # new jobs keep going to the replica that serves; the stage is not refused
    doc = d.wait(d.submit("p", {"text": "later"}), timeout=30)
    assert doc["state"] == "succeeded" and doc["stages"]["slow"]["replica"] == 0


def test_a_streamed_pipeline_stays_with_its_replicas(start_daemon: Start) -> None:
    sink = {"engine": "python", "function": "streamstages:shout", "python_path": [str(FIXTURES)], "replicas": 2}
    stages = {"gen": py_stage("count", replicas=2), "sink": sink}
    pipelines = {"p": {"stages": ["gen", "sink"], "edges": [{"from": "gen", "to": "sink", "window": 2}]}}
    d = start_daemon(stages, pipelines)
    jobs = [d.submit("p", {}, params={"gen": {"n": 6, "delay": 0.02}}) for _ in range(4)]
    docs = [d.wait(j, timeout=60) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 4, [doc["error"] for doc in docs]
    for doc in docs:
        text = d.client.output(doc["id"], "text")[0].decode()
        assert text == "0 1 2 3 4 5 ", text
    assert sorted(doc["stages"]["sink"]["replica"] for doc in docs) == [0, 0, 1, 1]


def test_logs_of_each_replica(start_daemon: Start, tmp_path: Path) -> None:
    (tmp_path / "talk.py").write_text(
        "import os\n"
        "def shout(inputs, params, ctx):\n"
        "    print('shout:', inputs['text'], os.getpid(), flush=True)\n"
        "    return {'text': inputs['text']}\n")
    stage = {"engine": "python", "function": "talk:shout", "python_path": [str(tmp_path)], "replicas": 2}
    d = start_daemon({"s": stage}, {"p": {"stages": ["s"]}})
    for k in range(2):
        assert d.wait(d.submit("p", {"text": f"hello{k}"}), timeout=30)["state"] == "succeeded"
    pids = replica_pids(d, "s")
    zero = omnictl(d, "logs", "s").stdout
    one = omnictl(d, "logs", "s", "--replica", "1").stdout
    assert f"shout: hello0 {pids[0]}" in zero and f"shout: hello1 {pids[1]}" in one, (zero, one)
    assert "hello1" not in zero and "hello0" not in one
    bad = omnictl(d, "logs", "s", "--replica", "2")
    assert bad.returncode != 0 and "replica must be from 0 to 1" in bad.stderr


def test_reload_changes_replicas_without_touching_the_others(start_daemon: Start) -> None:
    stages = {"s": py_stage("sleep", defaults={"seconds": 0.2})}
    d = start_daemon(stages, {"p": {"stages": ["s"]}})
    first = replica_pids(d, "s")

    def reload(replicas: int) -> None:
        config = d.config_path.read_text().replace('"replicas" = 2\n', "").replace('"replicas" = 1\n', "")
        config = config.replace('[stages."s"]\n', f'[stages."s"]\n"replicas" = {replicas}\n')
        d.config_path.write_text(config)
        d.proc.send_signal(signal.SIGHUP)

    reload(2)
    wait_for(lambda: len(replica_pids(d, "s")) == 2 and None not in replica_pids(d, "s")
             and d.stages()["s"]["state"] == "ready", 30, "a second replica")
    grown = replica_pids(d, "s")
    assert grown[0] == first[0], "the first replica was restarted"
    docs = [d.wait(d.submit("p", {"text": str(k)}), timeout=30) for k in range(2)]
    assert all(doc["state"] == "succeeded" for doc in docs)
    reload(1)
    wait_for(lambda: len(replica_pids(d, "s")) == 1, 30, "the second replica to go")
    assert replica_pids(d, "s") == [first[0]]
    assert wait_gone([grown[1]]) == []
    assert '"resized": ["s"]' in d.log()
    assert d.wait(d.submit("p", {"text": "after"}), timeout=30)["state"] == "succeeded"
