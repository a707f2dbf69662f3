"""Call-level batching of a diffusers stage (`max_inflight > 1`, `batching = "call"`) on the tiny
Stable Diffusion model. (Step-level batching, the default: tests/test_diffusers_joining.py.)

One daemon for the module with two stages on the same model directory: `solo` (`max_inflight = 1`,
one job per pipeline call, as before batching) and `batch` (`max_inflight = 5`, `batching = "call"`:
compatible jobs run as one pipeline call). Nothing is mocked.

To make "submitted at once" deterministic, each test first starts a `gate` job on `batch` (an
incompatible, 1000-step job that runs alone), submits its jobs, waits until the worker has admitted
every one of them into the engine (`stage_started`), then cancels the gate: the engine then forms
its next batches from what it holds. (Hence `max_inflight = 5`: the gate and four jobs.)
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir, wait_for, wait_started
from PIL import Image

pytestmark = pytest.mark.engines

STEPS = 4
# Batching may change the UNet's arithmetic slightly (other batch shapes, other kernels): pixels
# may differ by a rounding step. On the 2-core CPU host a batch of four gave exactly the images
# each seed gives alone, and after a cancelled row left the batch the others were off by at most 1.
PIXEL_TOLERANCE = 2


def _models() -> None:
    if not (MODELS / "sd" / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)


@pytest.fixture(scope="module")
def sd() -> Iterator[RunningDaemon]:
    _models()
    d = short_tmpdir()
    # 32 px (4x4 latents): the cheapest steps the tiny model takes, the machine may be loaded
    defaults = {"num_inference_steps": STEPS, "guidance_scale": 5.0, "seed": 0, "height": 32, "width": 32}
    stages = {
        "solo": {"engine": "diffusers", "model": str(MODELS / "sd"), "devices": [], "queue_capacity": 8,
                 "defaults": defaults},
        "batch": {"engine": "diffusers", "model": str(MODELS / "sd"), "devices": [], "queue_capacity": 8,
                  "max_inflight": 5, "batching": "call", "defaults": defaults},
    }
    pipelines = {"solo": {"stages": ["solo"]}, "batch": {"stages": ["batch"]}}
    # A cancel takes effect at the end of the running denoising step; on a loaded 2-core host one
    # step of a batch can take seconds: a long grace keeps the supervisor from killing the worker.
    with module_daemon(d, stages, pipelines, {"heartbeat_timeout_s": 60.0, "cancel_grace_s": 60.0}, ready_timeout=240) as rd:
        yield rd


def _gated(sd: RunningDaemon, jobs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Submit `jobs` ((inputs, params) each) to `batch` while a gate job holds it; then open it."""
    gate = sd.submit("batch", {"prompt": "gate"},
                     {"batch": {"num_inference_steps": 500, "height": 16, "width": 16}})
    wait_started(sd, gate, "batch", timeout=90)
    ids = [sd.submit("batch", inputs, {"batch": params}) for inputs, params in jobs]
    for job in ids:
        wait_started(sd, job, "batch", timeout=90)
    assert sd.client.cancel(gate)["state"] == "cancelled"
    return ids


def _pixels(sd: RunningDaemon, job: str) -> np.ndarray:
    data, ctype = sd.client.output(job, "image")
    assert ctype == "image/png"
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def _progress(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "progress"]


def _running_without(sd: RunningDaemon, job: str) -> list[str] | None:
    running: list[str] = sd.stages()["batch"]["running"]
    return None if job in running else running


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and int(np.abs(a - b).max()) <= PIXEL_TOLERANCE


def test_compatible_jobs_run_as_one_batch_with_their_solo_images(sd: RunningDaemon) -> None:
    assert sd.stages()["batch"]["info"]["batching"] == "call"
    seeds = [11, 12, 13, 14]
    # the images each seed gives alone, through the max_inflight = 1 stage (one call per job)
    alone = [sd.submit("solo", {"prompt": f"a fox {s}"}, {"solo": {"seed": s}}) for s in seeds]
    ids = _gated(sd, [({"prompt": f"a fox {s}"}, {"seed": s}) for s in seeds])
    events = {job: sd.events(job, timeout=90) for job in ids}
    for job in ids:
        assert sd.client.job(job)["state"] == "succeeded", sd.diagnose(job)
        assert [(e["done"], e["total"]) for e in _progress(events[job])] == [(i, STEPS) for i in range(1, STEPS + 1)]
    # one pipeline call: every job's step k is reported before any job's step k + 1, and no job
    # finished before all had done their last step
    for k in range(1, STEPS):
        last_k = max(e["ts"] for job in ids for e in _progress(events[job]) if e["done"] == k)
        first_next = min(e["ts"] for job in ids for e in _progress(events[job]) if e["done"] == k + 1)
        assert last_k <= first_next
    last_step = max(e["ts"] for job in ids for e in _progress(events[job]))
    assert all(e["ts"] >= last_step for job in ids for e in events[job] if e["type"] == "stage_finished")
    # each image is the one its seed gives alone
    for job, solo, seed in zip(ids, alone, seeds):
        assert sd.wait(solo, timeout=90)["state"] == "succeeded", sd.diagnose(solo)
        diff = np.abs(_pixels(sd, job) - _pixels(sd, solo))
        assert diff.max() <= PIXEL_TOLERANCE, (seed, int(diff.max()))
    # and the seeds really differ (the batch did not give every row the same noise)
    assert not _close(_pixels(sd, ids[0]), _pixels(sd, ids[1]))


def test_incompatible_jobs_are_not_batched_together(sd: RunningDaemon) -> None:
    a, big, fewer, d = _gated(sd, [
        ({"prompt": "a"}, {"seed": 1}),
        ({"prompt": "big"}, {"seed": 1, "height": 64, "width": 64}),
        ({"prompt": "fewer"}, {"seed": 1, "num_inference_steps": STEPS - 1}),
        ({"prompt": "d"}, {"seed": 2}),
    ])
    events = {job: sd.events(job, timeout=90) for job in (a, big, fewer, d)}
    for job in events:
        assert sd.client.job(job)["state"] == "succeeded", sd.diagnose(job)
    assert _pixels(sd, big).shape == (64, 64, 3) and _pixels(sd, a).shape == (32, 32, 3)
    assert len(_progress(events[fewer])) == STEPS - 1
    # the oldest job's batch took the compatible `d` (progress interleaves), then `big` ran
    # alone, then `fewer`: three pipeline calls, one after the other
    ts = {job: [e["ts"] for e in _progress(evs)] for job, evs in events.items()}
    assert ts[a][0] <= ts[d][0] <= ts[a][1]
    assert max(ts[a] + ts[d]) <= min(ts[big])
    assert max(ts[big]) <= min(ts[fewer])


def test_cancel_one_job_of_a_running_batch(sd: RunningDaemon) -> None:
    steps = 30
    ids = _gated(sd, [({"prompt": f"long {i}"}, {"seed": 20 + i, "num_inference_steps": steps})
                      for i in range(4)])
    victim, others = ids[1], [ids[0], ids[2], ids[3]]
    stream = sd.follow(victim, 60, "two denoising steps of the batch")
    times = []
    for ev in stream:
        if ev["type"] == "progress":
            times.append(ev["ts"])
            if len(times) == 2:
                break
    t_cancel = time.time()
    assert sd.client.cancel(victim)["state"] == "cancelled"
    # the worker slot is free at the next step, while the other three are still running (before
    # batching, a cancelled row would have stayed until its whole batch ended)
    running = wait_for(lambda: _running_without(sd, victim), 30, "the cancelled job to leave the batch stage")
    assert set(others) <= set(running), (running, others)
    for job in others:
        doc = sd.wait(job, timeout=90)
        assert doc["state"] == "succeeded", sd.diagnose(job)
        assert len(_progress(sd.events(job))) == steps
    after = [e for e in _progress(sd.events(victim)) if e["ts"] > t_cancel]
    assert len(after) <= 2, after
    doc = sd.client.job(victim)
    assert doc["state"] == "cancelled" and doc["stages"]["batch"]["state"] == "cancelled"
    assert sd.stages()["batch"]["restarts"] == 0


def test_a_bad_job_fails_alone(sd: RunningDaemon) -> None:
    good1, bad, good2 = _gated(sd, [
        ({"prompt": "good one"}, {"seed": 3}),
        # past the door's checks, refused by the pipeline: prompt and prompt_embeds together
        ({"prompt": "bad", "prompt_embeds": "nonsense"}, {"seed": 3}),
        ({"prompt": "good two"}, {"seed": 4}),
    ])
    doc = sd.wait(bad, timeout=90)
    assert doc["state"] == "failed" and doc["error"]["stage"] == "batch", doc
    for job in (good1, good2):
        assert sd.wait(job, timeout=90)["state"] == "succeeded", sd.diagnose(job)
    assert sd.stages()["batch"]["restarts"] == 0
