"""`engine_core = "process"`: a vllm stage's engine core in a child process of its worker, as
`vllm serve` runs it.

Real daemons, real vLLM on the tiny Llama, nothing mocked. One daemon serves the module with the
same model twice: `inline` (the engine core in the worker's thread) and `proc` (in a process of its
own), both greedy, both tapping hidden states. The two must give the same tokens and the same rows
(the tap's rows cross the process boundary), a cancel must stop the core's work, and a core
SIGKILLed alone must take its worker down: the stage restarts, the job running in it fails with a
clear error, nothing of the old worker's tree is left, and the next job runs. A supervisor that is
SIGKILLed leaves no core behind either (the core asks for PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import inject
import numpy as np
import psutil
import pytest
from conftest import (
    MODELS,
    TERMINAL,
    TINY_LLM_ARGS,
    RunningDaemon,
    close_in,
    module_daemon,
    short_tmpdir,
    wait_for,
    wait_gone,
    watch_descriptors,
)

pytestmark = pytest.mark.vllm

LLM = MODELS / "llm"


def llm_stage(engine_core: str, **extra: Any) -> dict[str, Any]:
    return {"engine": "vllm", "model": str(LLM), "devices": [], "max_inflight": 8, "engine_core": engine_core,
            "args": {"max_model_len": 512, **TINY_LLM_ARGS},
            "defaults": {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0},
            "outputs": ["token_ids", "hidden_states"], **extra}


@pytest.fixture(scope="module")
def d() -> Iterator[RunningDaemon]:
    if not (LLM / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)
    stages = {"inline": llm_stage("inline"), "proc": llm_stage("process")}
    pipelines = {"inline": {"stages": ["inline"]}, "proc": {"stages": ["proc"]}}
    # (a worker stopped under ptrace sends no heartbeat: the false-wake test's injected close is not a hang)
    with module_daemon(short_tmpdir(), stages, pipelines, {"cancel_grace_s": 5.0, "heartbeat_timeout_s": 90.0}) as rd:
        yield rd


def wait_end(d: RunningDaemon, job: str, timeout: float = 90) -> dict[str, Any]:
    return wait_for(lambda: (doc := d.client.job(job))["state"] in TERMINAL and doc, timeout,
                    f"job {job} to end", every=0.05)


def npy(d: RunningDaemon, job: str, name: str) -> np.ndarray:
    data, _ = d.client.output(job, name)
    return np.load(io.BytesIO(data), allow_pickle=False)


def core_pids(d: RunningDaemon, stage: str) -> list[int]:
    info = d.stages()[stage]["info"]
    assert info["engine_core"]["where"] in ("inline", "process"), info
    return list(info["engine_core"]["pids"])


def test_the_core_is_a_process_of_the_stage_worker_tree(d: RunningDaemon) -> None:
    assert core_pids(d, "inline") == []
    (core,) = core_pids(d, "proc")
    worker = d.stage_pid("proc")
    assert core in [c.pid for c in psutil.Process(worker).children(recursive=True)]
    assert os.getpgid(core) == os.getpgid(worker)       # the group the supervisor kills as one
    # The model runs in the core's process: no third vLLM process (vLLM's mp executor on a CPU,
    # whose idle worker polls its queue), so the tree is the worker and its core, and an idle
    # stage costs nothing.
    core_children = [c for c in psutil.Process(core).children(recursive=True) if c.name().startswith("VLLM")]
    assert core_children == [], [(c.pid, c.name()) for c in core_children]


def test_process_and_inline_cores_give_the_same_tokens_and_rows(d: RunningDaemon) -> None:
    prompt = {"prompt": "the engine core in a process of its own"}
    jobs = {where: d.submit(where, prompt, params={where: {"max_tokens": 20}}) for where in ("inline", "proc")}
    docs = {where: wait_end(d, job) for where, job in jobs.items()}
    for where, doc in docs.items():
        assert doc["state"] == "succeeded", (where, doc)
    assert d.client.output(jobs["proc"], "text")[0] == d.client.output(jobs["inline"], "text")[0]
    ids = {where: npy(d, job, "token_ids") for where, job in jobs.items()}
    assert ids["proc"].tolist() == ids["inline"].tolist() and len(ids["proc"]) == 20
    rows = {where: npy(d, job, "hidden_states") for where, job in jobs.items()}
    assert rows["proc"].shape == rows["inline"].shape == (20, rows["inline"].shape[1]), rows["proc"].shape
    assert rows["proc"].dtype == rows["inline"].dtype
    assert np.allclose(rows["proc"].astype(np.float32), rows["inline"].astype(np.float32), atol=0.05)


def test_many_jobs_at_once_through_the_core_process(d: RunningDaemon) -> None:
    jobs = [d.submit("proc", {"prompt": f"job {i}"}, params={"proc": {"max_tokens": 16}}) for i in range(12)]
    for job in jobs:
        doc = wait_end(d, job)
        assert doc["state"] == "succeeded", doc
        assert len(npy(d, job, "token_ids")) == 16 and npy(d, job, "hidden_states").shape[0] == 16


def test_a_cancel_stops_the_work_in_the_core_process(d: RunningDaemon) -> None:
    job = d.submit("proc", {"prompt": "a long one"}, params={"proc": {"max_tokens": 400}})
    wait_for(lambda: d.client.job(job)["state"] == "running", 60, "the job to run")
    time.sleep(0.3)
    t0 = time.monotonic()
    d.client.cancel(job)
    doc = wait_end(d, job, timeout=30)
    assert doc["state"] == "cancelled", doc
    assert time.monotonic() - t0 < 5.0
    nxt = wait_end(d, d.submit("proc", {"prompt": "next"}))
    assert nxt["state"] == "succeeded", nxt


def burner(seconds: float) -> list[subprocess.Popen[bytes]]:
    """A busy loop on every CPU: a loaded machine is not a dead core."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]


@pytest.mark.skipif(not inject.supported(), reason="needs x86-64 Linux, to close a descriptor inside a process (ptrace)")
def test_a_wake_that_is_no_exit_never_ends_a_live_core_under_load(d: RunningDaemon) -> None:
    (core,) = core_pids(d, "proc")
    worker = d.stage_pid("proc")
    restarts = d.stages()["proc"]["restarts"]
    fds = watch_descriptors(worker, core)
    assert fds, "found no descriptor that watches the core"
    burners = burner(60)
    try:
        jobs = [d.submit("proc", {"prompt": f"short {i}"}, params={"proc": {"max_tokens": 4}}) for i in range(12)]
        close_in(worker, fds)           # every watch wakes at once: POLLNVAL, then numbers reused
        jobs += [d.submit("proc", {"prompt": f"after {i}"}, params={"proc": {"max_tokens": 4}}) for i in range(12)]
        docs = [wait_end(d, job, timeout=120) for job in jobs]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert [doc["state"] for doc in docs] == ["succeeded"] * len(jobs), [doc["error"] for doc in docs]
    time.sleep(1.5)                     # past a watch's recheck
    snap = d.stages()["proc"]
    assert snap["pid"] == worker and snap["restarts"] == restarts, snap
    assert core_pids(d, "proc") == [core] and psutil.pid_exists(core)
    assert "woke, but" in d.log() or "woke with no child exited" in d.log()


def test_a_core_killed_alone_restarts_its_stage_and_fails_its_job(d: RunningDaemon) -> None:
    (core,) = core_pids(d, "proc")
    worker = d.stage_pid("proc")
    tree = [c.pid for c in psutil.Process(worker).children(recursive=True)]
    restarts = d.stages()["proc"]["restarts"]
    job = d.submit("proc", {"prompt": "killed under it"}, params={"proc": {"max_tokens": 400}})
    wait_for(lambda: d.client.job(job)["state"] == "running", 60, "the job to run")
    time.sleep(0.3)
    os.kill(core, signal.SIGKILL)
    doc = wait_end(d, job, timeout=60)
    assert doc["state"] == "failed", doc
    assert "engine core" in doc["error"]["message"], doc["error"]
    assert not wait_gone([worker, *tree], timeout=15), "the old worker's tree outlived it"
    snap = d.wait_stage_state("proc", ("ready",), timeout=180)
    assert snap["pid"] != worker and snap["restarts"] == restarts + 1, snap
    assert "engine core" in snap["last_error"], snap
    (new_core,) = core_pids(d, "proc")
    assert new_core != core
    nxt = wait_end(d, d.submit("proc", {"prompt": "after the restart"}))
    assert nxt["state"] == "succeeded", nxt
    assert d.stages()["inline"]["restarts"] == 0        # the other stage never noticed


def test_no_core_outlives_a_supervisor_killed_by_sigkill(start_daemon: Callable[..., RunningDaemon]) -> None:
    rd = start_daemon({"proc": llm_stage("process")}, {"p": {"stages": ["proc"]}})
    (core,) = core_pids(rd, "proc")
    tree = rd.worker_pids()
    assert core in tree
    rd.kill9()
    assert not wait_gone(tree, timeout=20), f"{wait_gone(tree, 0)} outlived the supervisor"


def test_engine_core_is_checked() -> None:
    from omnid.config import ConfigError, parse

    base = {"stages": {"f": {"engine": "python", "function": "x:y", "engine_core": "process"},
                       "g": {"engine": "vllm", "model": str(LLM), "engine_core": "elsewhere"}},
            "pipelines": {"p": {"stages": ["f", "g"]}}}
    with pytest.raises(ConfigError) as e:
        parse(base, base=MODELS)
    text = str(e.value)
    assert "stages.f.engine_core: only vllm stages have an engine core to place, not 'python'" in text, text
    assert "stages.g.engine_core: must be one of 'inline', 'process', not 'elsewhere'" in text, text
