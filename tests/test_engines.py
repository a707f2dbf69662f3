"""Real engines on the tiny models: vLLM and diffusers in warm stage workers.

One daemon per module (loading vLLM costs ~10 s on 2 cores), running the
demo's stages on the tiny random-weight models in .models/ (built here if
missing). Nothing is mocked: tokens come from vLLM's LLMEngine, images from
a diffusers StableDiffusionPipeline.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import (
    MODELS,
    RunningDaemon,
    build_tiny_models,
    demo_stage,
    module_daemon,
    short_tmpdir,
    sleeper,
    tiny_llm,
    tiny_sd,
)

from omnictl.client import ApiError

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engines() -> Iterator[RunningDaemon]:
    build_tiny_models("llm", "sd")
    d = short_tmpdir()
    stages = {
        "expand": tiny_llm({"max_tokens": 16, "temperature": 0.9, "seed": 7, "include_prompt": True},
                           engine_core="process"),
        "draw": tiny_sd({"num_inference_steps": 4, "guidance_scale": 5.0, "seed": 0}, queue_capacity=2),
        "batch": tiny_llm({"max_tokens": 48, "ignore_eos": True}, max_inflight=3),
        "slowsink": sleeper(1.5, queue_capacity=1),
        "frame": demo_stage("frame"),
    }
    pipelines = {
        "t2i": {"stages": ["expand", "draw"],
                "edges": [{"from": "expand", "to": "draw", "window": -1, "map": {"prompt": "text"}}]},
        "llm": {"stages": ["expand"]},
        "batch": {"stages": ["batch"]},
        "batch_slow": {"stages": ["batch", "slowsink"]},
        "draw": {"stages": ["draw"]},
        "t2i_framed": {"stages": ["expand", "draw", "frame"]},
    }
    # expand -> draw passes `text`, but draw wants `prompt`: t2i_framed maps it like t2i.
    pipelines["t2i_framed"]["edges"] = [
        {"from": "expand", "to": "draw", "map": {"prompt": "text"}}, {"from": "draw", "to": "frame"}]
    with module_daemon(d, stages, pipelines, {"cancel_grace_s": 10.0, "heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def _first(events: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    for ev in events:
        if all(ev.get(k) == v for k, v in match.items()):
            return ev
    raise AssertionError(f"no event {match} in {events}")


def test_t2i_runs_real_vllm_and_diffusers(engines: RunningDaemon) -> None:
    job = engines.submit("t2i", {"prompt": "a lighthouse at dusk"})
    events = engines.events(job)
    doc = engines.client.job(job)
    assert doc["state"] == "succeeded", doc
    # tokens streamed from vLLM as text segments, the last one marked
    text_segments = [e for e in events if e["type"] == "segment" and e["stage"] == "expand"]
    assert len(text_segments) >= 8 and text_segments[-1]["is_last"]
    assert any(e.get("text", "").strip() for e in text_segments)
    # one progress event per denoising step from diffusers' callback
    steps = [e for e in events if e["type"] == "progress" and e["stage"] == "draw"]
    assert [(e["done"], e["total"]) for e in steps] == [(i, 4) for i in range(1, 5)]
    # the draw stage started only after expand finished (window -1)
    assert _first(events, type="stage_started", stage="draw")["ts"] >= \
        _first(events, type="stage_finished", stage="expand")["ts"]
    outputs = {o["name"]: o for o in doc["outputs"]}
    assert outputs["image"]["content_type"] == "image/png"
    data, ctype = engines.client.output(job, "image")
    assert ctype == "image/png" and data.startswith(PNG_MAGIC)
    prompt, ctype = engines.client.output(job, "prompt")
    assert ctype.startswith("text/plain")
    expanded = prompt.decode()
    assert expanded.startswith("a lighthouse at dusk") and len(expanded) > len("a lighthouse at dusk") + 8
    manifest = (engines.state_dir / "jobs" / job / "manifest.json")
    assert manifest.is_file()


def test_cpu_workers_come_from_their_engines_fork_server_with_its_libraries_imported(engines: RunningDaemon) -> None:
    """preload_workers: each CPU worker is a fork of its engine's server (the daemon's child), which
    imported that engine's libraries once (omnid.worker.preload): vLLM's (pyzmq is vLLM's alone
    here) and torch for the vllm stage; torch but not vLLM for the diffusers one."""
    servers = {s: psutil.Process(psutil.Process(engines.stage_pid(s)).ppid()) for s in ("expand", "draw")}
    assert {p.name() for p in servers.values()} == {"omnid-fs-vllm", "omnid-fs-diffus"}, servers
    assert servers["expand"].name() == "omnid-fs-vllm"
    assert all(p.ppid() == engines.proc.pid for p in servers.values())
    maps = {s: Path(f"/proc/{p.pid}/maps").read_text() for s, p in servers.items()}
    assert "libtorch_cpu" in maps["expand"] and "libzmq" in maps["expand"]
    assert "libtorch_cpu" in maps["draw"] and "libzmq" not in maps["draw"]


def test_second_job_reuses_warm_workers(engines: RunningDaemon) -> None:
    # Relative to the state the module's daemon is in now: an earlier test may have restarted a
    # worker (test_kill_9_of_vllm_worker_mid_job does); what matters is that these two jobs do not.
    for name in ("expand", "draw"):
        engines.wait_stage_state(name, ("ready",), timeout=180)
    before = engines.stages()
    first = engines.wait(engines.submit("t2i", {"prompt": "one"}))
    mid = engines.stages()
    second = engines.wait(engines.submit("t2i", {"prompt": "two"}))
    after = engines.stages()
    assert first["state"] == second["state"] == "succeeded"
    for name in ("expand", "draw"):
        assert before[name]["pid"] == mid[name]["pid"] == after[name]["pid"]
        assert before[name]["load_s"] == after[name]["load_s"]
        assert after[name]["restarts"] == before[name]["restarts"]
        assert after[name]["jobs_done"] >= before[name]["jobs_done"] + 2
    # warm: a whole job takes a small fraction of loading the engines
    assert second["finished_at"] - second["created_at"] < after["expand"]["load_s"]


def test_job_params_override_stage_defaults(engines: RunningDaemon) -> None:
    job = engines.submit("llm", {"prompt": "count"}, params={"expand": {"max_tokens": 5, "include_prompt": False}})
    events = engines.events(job)
    tokens = [e for e in events if e["type"] == "segment"]
    assert len(tokens) == 5
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["done"] == 5 and progress[-1]["total"] == 5
    text, _ = engines.client.output(job, "text")
    assert not text.decode().startswith("count")


def test_engine_errors_fail_only_that_job(engines: RunningDaemon) -> None:
    # A prompt whose own tokens are more than the model takes is refused at the door (400) ...
    with pytest.raises(ApiError) as door:
        engines.submit("llm", {"prompt": "word " * 700})
    assert door.value.status == 400 and door.value.code == "prompt_too_long", door.value
    # ... past the door's checks, refused by the engine itself: a prompt that fits by its own 512
    # tokens, but not with the BOS token vLLM adds (vLLM), and conflicting call arguments
    # (diffusers: prompt and prompt_embeds)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json"))
    fits_alone = tok.decode(tok.encode("word " * 700, add_special_tokens=False).ids[:512])
    assert len(tok.encode(fits_alone, add_special_tokens=False).ids) == 512
    too_long = engines.wait(engines.submit("llm", {"prompt": fits_alone}))
    assert too_long["state"] == "failed" and too_long["error"]["stage"] == "expand"
    assert too_long["error"]["code"] == "input_rejected", too_long["error"]
    assert "maximum context length is 512 tokens" in too_long["error"]["message"]
    conflict = engines.wait(engines.submit("draw", {"prompt": "x", "prompt_embeds": "nonsense"}))
    assert conflict["state"] == "failed" and conflict["error"]["stage"] == "draw"
    good = engines.wait(engines.submit("t2i", {"prompt": "x"}))
    assert good["state"] == "succeeded"


def test_cancel_running_diffusion_stops_within_a_step(engines: RunningDaemon) -> None:
    long = engines.submit("draw", {"prompt": "slow"}, params={"draw": {"num_inference_steps": 500}})
    nxt = engines.submit("draw", {"prompt": "next"})
    stream = engines.follow(long, 120, "5 denoising steps")
    step_times = []
    for ev in stream:
        if ev["type"] == "progress":
            step_times.append(ev["ts"])
            if len(step_times) == 5:
                break
    step = (step_times[-1] - step_times[0]) / 4
    t_cancel = time.time()
    assert engines.client.cancel(long)["state"] == "cancelled"
    nxt_events = engines.events(nxt)
    started = _first(nxt_events, type="stage_started", stage="draw")["ts"]
    assert engines.client.job(nxt)["state"] == "succeeded"
    # the cancelled call ended at its next denoising step: the next job started right after
    assert started - t_cancel < max(1.0, 20 * step), (started - t_cancel, step)
    progress_after = [e for e in engines.events(long) if e["type"] == "progress" and e["ts"] > t_cancel]
    assert len(progress_after) <= 2
    assert engines.stages()["draw"]["restarts"] == 0


def test_cancel_long_generation_aborts_in_vllm(engines: RunningDaemon) -> None:
    long = engines.submit("llm", {"prompt": "tell"}, params={"expand": {"max_tokens": 480, "ignore_eos": True}})
    nxt = engines.submit("llm", {"prompt": "next"})
    tokens = 0
    for ev in engines.follow(long, 120, "10 tokens"):
        if ev["type"] == "segment":
            tokens += 1
            if tokens == 10:
                break
    t_cancel = time.time()
    doc = engines.client.cancel(long)
    assert doc["state"] == "cancelled"
    nxt_started = _first(engines.events(nxt), type="stage_started", stage="expand")["ts"]
    late = [e for e in engines.events(long) if e["type"] == "segment" and e["ts"] > t_cancel]
    assert len(late) < 30, f"{len(late)} tokens after the cancel"
    assert nxt_started - t_cancel < 2.0
    assert engines.client.job(nxt)["state"] == "succeeded"


def test_timeout_names_the_stage(engines: RunningDaemon) -> None:
    job = engines.submit("draw", {"prompt": "slow"}, params={"draw": {"num_inference_steps": 500}}, timeout_s=1.0)
    doc = engines.wait(job)
    assert doc["state"] == "timed_out"
    assert "'draw'" in doc["error"]["message"]
    assert 0.9 <= doc["finished_at"] - doc["created_at"] < 3.0
    engines.wait_stage_state("draw", ("ready",), timeout=10)


def test_framed_pipeline_python_stage_gets_pil_image(engines: RunningDaemon) -> None:
    doc = engines.wait(engines.submit("t2i_framed", {"prompt": "a fox"}))
    assert doc["state"] == "succeeded", doc
    data, ctype = engines.client.output(doc["id"], "image")
    assert ctype == "image/png" and data.startswith(PNG_MAGIC)
    import struct
    width, height = struct.unpack(">II", data[16:24])
    assert width > 64 and height > 64       # framed and upscaled from the 64 px image


def test_kill_9_of_vllm_worker_mid_job(engines: RunningDaemon) -> None:
    restarts = engines.wait_stage_state("expand", ("ready",), timeout=180)["restarts"]
    pid = engines.stage_pid("expand")
    job = engines.submit("llm", {"prompt": "tell"}, params={"expand": {"max_tokens": 480, "ignore_eos": True}})
    for ev in engines.follow(job, 120, "the first token"):
        if ev["type"] == "segment":
            break
    queued = engines.submit("llm", {"prompt": "after"})
    os.kill(pid, signal.SIGKILL)
    doc = engines.wait(job)
    assert doc["state"] == "failed"
    assert "expand" in doc["error"]["message"] and "SIGKILL" in doc["error"]["message"]
    after = engines.wait(queued, timeout=180)
    assert after["state"] == "succeeded", after
    snap = engines.wait_stage_state("expand", ("ready",), timeout=180)
    assert snap["pid"] != pid and snap["restarts"] == restarts + 1


def test_vllm_stage_batches_up_to_max_inflight(engines: RunningDaemon) -> None:
    jobs = [engines.submit("batch", {"prompt": f"story {i}"}) for i in range(4)]
    docs = [engines.wait(j) for j in jobs[:3]]
    assert all(d["state"] == "succeeded" for d in docs), docs
    starts = [d["stages"]["batch"]["started_at"] for d in docs]
    ends = [d["stages"]["batch"]["finished_at"] for d in docs]
    # the first three ran together in one vLLM batch: all started before any finished
    assert max(starts) < min(ends)
    fourth = engines.wait(jobs[3])
    assert fourth["state"] == "succeeded"
    for d in docs + [fourth]:
        text, _ = engines.client.output(d["id"], "text")
        assert len(text.split()) >= 20


def test_cancel_one_request_of_a_vllm_batch(engines: RunningDaemon) -> None:
    params = {"batch": {"max_tokens": 400}}
    a, b = (engines.submit("batch", {"prompt": p}, params=params) for p in ("left", "right"))
    for ev in engines.follow(a, 120, "the first token"):
        if ev["type"] == "segment":
            break
    assert engines.client.cancel(a)["state"] == "cancelled"
    doc = engines.wait(b)
    assert doc["state"] == "succeeded"
    assert sum(1 for e in engines.events(b) if e["type"] == "segment") == 400


def test_bad_parameter_values_are_refused_at_the_door(engines: RunningDaemon) -> None:
    before = engines.stages()
    for pipeline, stage, params in (("draw", "draw", {"seed": "abc"}), ("draw", "draw", {"num_inference_steps": 0}),
                                    ("draw", "draw", {"width": 100}), ("llm", "expand", {"seed": 2**70}),
                                    ("llm", "expand", {"temperature": -3}), ("llm", "expand", {"max_tokens": "lots"})):
        with pytest.raises(ApiError) as err:
            engines.submit(pipeline, {"prompt": "x"}, params={stage: params})
        assert err.value.status == 400 and err.value.code == "invalid_param"
        assert f"params.{stage}.{next(iter(params))}" in err.value.message
    assert engines.wait(engines.submit("t2i", {"prompt": "still fine"}))["state"] == "succeeded"
    after = engines.stages()
    for name in ("expand", "draw"):
        assert after[name]["pid"] == before[name]["pid"] and after[name]["restarts"] == before[name]["restarts"]
