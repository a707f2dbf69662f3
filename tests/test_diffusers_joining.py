"""Step-level batching of a diffusers stage (`max_inflight > 1`, `batching = "step"`, the default):
a job joins the running batch at the next denoising step and leaves when its own schedule ends.

One daemon for the module, on the tiny models, nothing mocked: `solo` (tiny SD, max_inflight 1:
one pipeline `__call__` per job, the image a job gets alone) and `join` (tiny SD, max_inflight 4,
omnid's own denoising loop), both with the tiny SD's LoRA adapter `style`; `dsolo` and `djoin`,
the same on the tiny Flux DiT with a first-block cache. A job's image through `join` is compared
with its image through `solo` (same seed, steps, guidance, adapter).

Tolerance: PIXEL_TOLERANCE (8-bit pixel values). Measured on the 2-core CPU host: 0, for jobs alone,
four at once and jobs joining at different steps, on both models (the loop does the pipeline's own
arithmetic per row; on the CPU a batch of other shape changed no bit).
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir, wait_for
from omnidtest import build_tiny_models
from PIL import Image

pytestmark = pytest.mark.engines

PIXEL_TOLERANCE = 1
SD = {"num_inference_steps": 8, "guidance_scale": 5.0, "seed": 0, "height": 32, "width": 32}
DIT = {"num_inference_steps": 8, "seed": 0, "height": 64, "width": 64}
LORA = {"adapters": {"style": str(MODELS / "sd-loras" / "style")}}
CACHE = {"kind": "first_block", "threshold": 0.5}


@pytest.fixture(scope="module")
def d() -> Iterator[RunningDaemon]:
    build_tiny_models("sd", "dit", "sd-loras")

    def sd(**extra: Any) -> dict[str, Any]:
        return {"engine": "diffusers", "model": str(MODELS / "sd"), "devices": [], "defaults": SD, "lora": LORA,
                **extra}

    def dit(**extra: Any) -> dict[str, Any]:
        return {"engine": "diffusers", "model": str(MODELS / "dit"), "devices": [], "defaults": DIT,
                "cache": CACHE, **extra}

    stages = {"solo": sd(), "join": sd(max_inflight=4, queue_capacity=8),
              "dsolo": dit(), "djoin": dit(max_inflight=4, queue_capacity=8)}
    # a cancel takes effect at the end of a step; on a loaded 2-core host a step may take long
    with module_daemon(short_tmpdir(), stages, {name: {"stages": [name]} for name in stages},
                       {"heartbeat_timeout_s": 60.0, "cancel_grace_s": 60.0}, ready_timeout=300) as rd:
        yield rd


def _pixels(d: RunningDaemon, job: str) -> np.ndarray:
    data, ctype = d.client.output(job, "image")
    assert ctype == "image/png"
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def _alone(d: RunningDaemon, stage: str, prompt: str, params: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """The image (and stage_finished event) a job gets alone, through the pipeline's own call."""
    job = d.submit(stage, {"prompt": prompt}, {stage: params})
    events = d.events(job, timeout=120)
    assert d.client.job(job)["state"] == "succeeded", d.diagnose(job)
    return _pixels(d, job), next(e for e in events if e["type"] == "stage_finished")


def _same(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = int(np.abs(a - b).max())
    assert diff <= PIXEL_TOLERANCE, diff
    return diff


def _steps(events: list[dict[str, Any]]) -> list[float]:
    return [e["ts"] for e in events if e["type"] == "progress"]


def _after(d: RunningDaemon, job: str, done: int) -> None:
    """Follow `job` until it reported `done` denoising steps."""
    for ev in d.follow(job, 120, f"{done} steps of {job}"):
        if ev["type"] == "progress" and ev["done"] >= done:
            return
    raise AssertionError(f"{job} ended before its step {done}")


def _joins_mid_batch(d: RunningDaemon, stage: str, solo: str) -> dict[str, Any]:
    """A long job runs; another arrives after its 4th step. Returns what the test checks on both."""
    assert d.stages()[stage]["info"]["batching"] == "step"
    long_params, late_params = {"seed": 5, "num_inference_steps": 30}, {"seed": 7}
    first = d.submit(stage, {"prompt": "a long red fox"}, {stage: long_params})
    _after(d, first, 4)
    late = d.submit(stage, {"prompt": "a small blue bird"}, {stage: late_params})
    late_events = d.events(late, timeout=120)
    first_events = d.events(first, timeout=120)
    for job in (first, late):
        assert d.client.job(job)["state"] == "succeeded", d.diagnose(job)
    started = next(e["ts"] for e in late_events if e["type"] == "stage_started")
    late_steps, first_steps = _steps(late_events), _steps(first_events)
    # it started at a step boundary of the running job: at most two of its steps in between
    assert len([t for t in first_steps if started < t < late_steps[0]]) <= 2, (started, late_steps, first_steps)
    # it left when its own 8 steps ended, the long job still running
    finished = next(e["ts"] for e in late_events if e["type"] == "stage_finished")
    assert len(late_steps) == 8 and finished < first_steps[-1]
    # both images are the ones they get alone, the late one's and the long one's (which ran alone,
    # then with the late one beside it at another timestep, then alone again)
    late_alone, late_end = _alone(d, solo, "a small blue bird", late_params)
    first_alone, first_end = _alone(d, solo, "a long red fox", long_params)
    _same(_pixels(d, late), late_alone)
    _same(_pixels(d, first), first_alone)
    assert not (_pixels(d, late) == _pixels(d, first)).all()
    return {"late": next(e for e in late_events if e["type"] == "stage_finished"), "late_alone": late_end,
            "first": next(e for e in first_events if e["type"] == "stage_finished"), "first_alone": first_end}


def test_a_job_arriving_mid_batch_starts_within_two_steps_with_its_image_alone(d: RunningDaemon) -> None:
    _joins_mid_batch(d, "join", "solo")


def test_a_long_forward_gives_way_to_a_job_that_arrives_in_it(d: RunningDaemon) -> None:
    """On the CPU a forward of 3 rows at 128 px takes longer than a lone job's prepare and first step:
    a job submitted as one begins is taken at once (the forward given up), its first step runs, then
    the forward again; the given-up forward moved no row, so the batch's images are their own."""
    wide = {"height": 128, "width": 128}
    d.wait(d.submit("join", {"prompt": "warm"}, {"join": {**wide, "num_inference_steps": 4}}), timeout=120)
    before = d.stages()["join"]["info"].get("gave_way", 0)
    batch = [d.submit("join", {"prompt": f"a wide fox {i}"}, {"join": {**wide, "seed": 40 + i, "num_inference_steps": 24}})
             for i in range(3)]
    newcomers: list[tuple[str, float]] = []
    for ev in d.follow(batch[0], 120, "the batch's steps"):
        # (3 rows stepped together twice by step 4: their forward is timed) a newcomer as a forward of the
        # batch begins: right after a step's event, read while it is fresh
        if ev["type"] == "progress" and ev["done"] >= 4 and ev["done"] % 3 == 0 and time.time() - ev["ts"] < 0.05:
            sent = time.time()
            newcomers.append((d.submit("join", {"prompt": f"a quick bird {ev['done']}"},
                                       {"join": {**wide, "seed": 50, "num_inference_steps": 1}}), sent))
    batch_steps = _steps(d.events(batch[0], timeout=120))
    for job in batch + [job for job, _ in newcomers]:
        assert d.wait(job, timeout=120)["state"] == "succeeded", d.diagnose(job)

    def given_up() -> int | None:
        return max(0, d.stages()["join"]["info"].get("gave_way", 0) - before) or None

    assert newcomers and wait_for(given_up, 10, "a forward given up, in the stage's info") >= 1
    forward_ms = d.stages()["join"]["info"]["forward_ms"]["128x128"]
    assert {"prepare", "1", "3"} <= set(forward_ms), forward_ms
    # a newcomer's first step came before the batch's next step: the forward in progress gave way
    first_steps = [(sent, _steps(d.events(job))[0]) for job, sent in newcomers]
    assert any(not [t for t in batch_steps if sent < t < first] for sent, first in first_steps), \
        (first_steps, batch_steps, forward_ms)
    alone, _ = _alone(d, "solo", "a wide fox 1", {**wide, "seed": 41, "num_inference_steps": 24})
    _same(_pixels(d, batch[1]), alone)


def test_a_dit_job_joins_with_its_own_cache(d: RunningDaemon) -> None:
    ends = _joins_mid_batch(d, "djoin", "dsolo")
    # each row's first-block cache decided on its own residuals: the hits and misses a job gets alone
    for job in ("late", "first"):
        usage, alone = ends[job].get("usage"), ends[f"{job}_alone"].get("usage")
        assert usage and usage == alone, (job, usage, alone)
        assert usage["cache_hits"] + usage["cache_misses"] == (8 if job == "late" else 30)


def test_a_cancel_mid_batch_ends_that_job_only(d: RunningDaemon) -> None:
    ids = [d.submit("join", {"prompt": f"a dog {i}"}, {"join": {"seed": 30 + i, "num_inference_steps": 24}})
           for i in range(3)]
    victim, others = ids[1], [ids[0], ids[2]]
    _after(d, victim, 3)
    t_cancel = time.time()
    assert d.client.cancel(victim)["state"] == "cancelled"

    def without_victim() -> list[str] | None:
        running: list[str] = d.stages()["join"]["running"]
        return None if victim in running else running

    running = wait_for(without_victim, 30, "the cancelled job to leave the stage")
    assert set(others) <= set(running), (running, others)
    for job in others:
        assert d.wait(job, timeout=120)["state"] == "succeeded", d.diagnose(job)
        assert len(_steps(d.events(job))) == 24
    assert len([t for t in _steps(d.events(victim)) if t > t_cancel]) <= 2
    doc = d.client.job(victim)
    assert doc["state"] == "cancelled" and doc["stages"]["join"]["state"] == "cancelled"
    alone, _ = _alone(d, "solo", "a dog 2", {"seed": 32, "num_inference_steps": 24})
    _same(_pixels(d, ids[2]), alone)        # the batch shrank under it: its image did not change
    assert d.stages()["join"]["restarts"] == 0


def test_a_timed_out_job_leaves_the_batch_alone(d: RunningDaemon) -> None:
    keep = d.submit("join", {"prompt": "a cat"}, {"join": {"seed": 3, "num_inference_steps": 30}})
    late = d.client.submit("join", {"prompt": "a slow cat"}, {"join": {"seed": 4, "num_inference_steps": 999}},
                           timeout_s=3)["id"]
    doc = d.wait(late, timeout=120)
    assert doc["state"] == "timed_out", (doc["error"], doc["stages"])
    assert d.wait(keep, timeout=120)["state"] == "succeeded", d.diagnose(keep)
    alone, _ = _alone(d, "solo", "a cat", {"seed": 3, "num_inference_steps": 30})
    _same(_pixels(d, keep), alone)


def test_a_job_failing_in_its_own_step_fails_alone(d: RunningDaemon) -> None:
    keep = d.submit("join", {"prompt": "a bird"}, {"join": {"seed": 6, "num_inference_steps": 20}})
    _after(d, keep, 1)
    # the tiny SD's DDIM (steps_offset 1) indexes past its 1000 training steps with 1000 steps: its
    # scheduler step raises, as in the pipeline's own call
    bad = d.submit("join", {"prompt": "a bad bird"}, {"join": {"seed": 6, "num_inference_steps": 1000}})
    doc = d.wait(bad, timeout=120)
    assert doc["state"] == "failed" and "IndexError" in doc["error"]["message"], doc["error"]
    assert d.wait(keep, timeout=120)["state"] == "succeeded", d.diagnose(keep)
    alone, _ = _alone(d, "solo", "a bird", {"seed": 6, "num_inference_steps": 20})
    _same(_pixels(d, keep), alone)


def test_another_size_or_adapter_does_not_join_a_batch_it_cannot_share(d: RunningDaemon) -> None:
    base = d.submit("join", {"prompt": "a house"}, {"join": {"seed": 8, "num_inference_steps": 30}})
    _after(d, base, 2)
    small = d.submit("join", {"prompt": "a small house"}, {"join": {"seed": 9, "height": 16, "width": 16}})
    styled = d.submit("join", {"prompt": "a styled house"}, {"join": {"seed": 9, "adapter": "style"}})
    after = d.submit("join", {"prompt": "a house after"}, {"join": {"seed": 10}})
    events = {job: d.events(job, timeout=180) for job in (base, small, styled, after)}
    for job in events:
        assert d.client.job(job)["state"] == "succeeded", d.diagnose(job)
    steps = {job: _steps(evs) for job, evs in events.items()}
    # another size: a batch of its own beside the running one (it ran before the long job ended)
    assert steps[small][0] < steps[base][-1]
    # another adapter set: it waited for the base batch to end, and the base job behind it waited
    # for it (no overtaking); the LoRA never reached a base job
    assert steps[styled][0] > max(steps[base] + steps[small])
    assert steps[after][0] > steps[styled][0]
    for job, prompt, params in [(small, "a small house", {"seed": 9, "height": 16, "width": 16}),
                                (styled, "a styled house", {"seed": 9, "adapter": "style"}),
                                (base, "a house", {"seed": 8, "num_inference_steps": 30}),
                                (after, "a house after", {"seed": 10})]:
        alone, _ = _alone(d, "solo", prompt, params)
        _same(_pixels(d, job), alone)
    plain, _ = _alone(d, "solo", "a styled house", {"seed": 9})
    assert int(np.abs(plain - _pixels(d, styled)).max()) > 10      # the adapter did change the image


def test_kill_9_mid_batch_fails_exactly_the_batch_jobs_then_the_next_run(d: RunningDaemon) -> None:
    pid = d.stage_pid("join")
    held = [d.submit("join", {"prompt": f"a tree {i}"}, {"join": {"seed": i, "num_inference_steps": 900}})
            for i in range(4)]
    waiting = [d.submit("join", {"prompt": f"a river {i}"}, {"join": {"seed": 40 + i}}) for i in range(2)]
    wait_for(lambda: set(held) <= set(d.stages()["join"]["running"]), 60, "four jobs in the batch")
    _after(d, held[-1], 1)      # (each has stepped: the loop's rows; on the CPU two at a time, oldest on)
    assert all(d.client.job(j)["stages"]["join"]["state"] == "queued" for j in waiting)
    os.kill(pid, signal.SIGKILL)
    for job in held:
        doc = d.wait(job, timeout=60)
        assert doc["state"] == "failed" and doc["error"]["code"] == "worker_died", doc
        assert "stage 'join'" in doc["error"]["message"], doc
    for i, job in enumerate(waiting):
        assert d.wait(job, timeout=180)["state"] == "succeeded", d.diagnose(job)
        alone, _ = _alone(d, "solo", f"a river {i}", {"seed": 40 + i})
        _same(_pixels(d, job), alone)
    assert d.stage_pid("join") != pid and d.stages()["join"]["restarts"] == 1
