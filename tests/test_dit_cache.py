"""DiT caching on a diffusers stage: `cache = { kind = "first_block", threshold = ... }`.

Real daemons on the tiny DiT (.models/dit, a random-weight FluxPipeline built by
omnid.tinymodels): a job on a cached stage succeeds, its stage result counts the cache's hits
and misses (`usage` of its stage_finished event) and /metrics the stage's; an uncached stage
of the same model reports none. `omnid --check` refuses a cache the model cannot take (the tiny
SD: a UNet pipeline, seen in its model_index.json), an unknown kind and a bad option, each
naming the key.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir, toml_dumps, wait_for

from omnid import config as C

pytestmark = pytest.mark.engines

DIT = MODELS / "dit"
SIZE = {"height": 64, "width": 64}      # the Flux pipeline's own default is 128 latent px: 4096 tokens
THRESHOLD = 0.5                         # the tiny random DiT's first-block residual moves ~0.2-0.4 a step


def _models() -> None:
    if not ((DIT / ".omnid-tiny-ok").exists() and (MODELS / "sd" / ".omnid-tiny-ok").exists()):
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)


@pytest.fixture(scope="module")
def dit() -> Iterator[RunningDaemon]:
    _models()
    defaults = {**SIZE, "num_inference_steps": 8, "seed": 0}
    stages = {
        "cached": {"engine": "diffusers", "model": str(DIT), "devices": [], "defaults": defaults,
                   "cache": {"kind": "first_block", "threshold": THRESHOLD}},
        "plain": {"engine": "diffusers", "model": str(DIT), "devices": [], "defaults": defaults},
    }
    pipelines = {"cached": {"stages": ["cached"]}, "plain": {"stages": ["plain"]}}
    with module_daemon(short_tmpdir(), stages, pipelines, {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def _stage_metric(d: RunningDaemon, name: str, stage: str) -> float:
    """A per-worker sample of /metrics (replica 0 of `stage`)."""
    for line in d.client.metrics().splitlines():
        if line.startswith(name + "{") and f'stage="{stage}"' in line and 'replica="0"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} of stage {stage} in /metrics")


def _finished(events: list[dict[str, Any]], stage: str) -> dict[str, Any]:
    found = [ev for ev in events if ev["type"] == "stage_finished" and ev.get("stage") == stage]
    assert found, f"no stage_finished of {stage} in {events}"
    return found[0]


def test_cached_job_succeeds_and_counts_hits(dit: RunningDaemon) -> None:
    job = dit.submit("cached", {"prompt": "a red cat"})
    events = dit.events(job)
    doc = dit.client.job(job)
    assert doc["state"] == "succeeded", doc
    assert any(o["name"] == "image" for o in doc["outputs"]), doc["outputs"]
    usage = _finished(events, "cached").get("usage")
    assert usage is not None, events
    # one count per transformer call: 8 steps, no CFG pass; the first step always computes
    assert usage["cache_hits"] + usage["cache_misses"] == 8, usage
    assert usage["cache_misses"] >= 1 and usage["cache_hits"] >= 1, usage
    # (a heartbeat sent during the call carries its hits so far: wait for one sent after it)
    wait_for(lambda: _stage_metric(dit, "omnid_stage_cache_hits_total", "cached") >= usage["cache_hits"], 10,
             "the heartbeat to carry the stage's cache hits")
    assert _stage_metric(dit, "omnid_stage_cache_misses_total", "cached") >= usage["cache_misses"]
    assert dit.stages()["cached"]["info"].get("cache") == "first_block"


def test_uncached_stage_reports_no_cache(dit: RunningDaemon) -> None:
    job = dit.submit("plain", {"prompt": "a red cat"})
    events = dit.events(job)
    assert dit.client.job(job)["state"] == "succeeded"
    assert "usage" not in _finished(events, "plain")
    assert _stage_metric(dit, "omnid_stage_cache_hits_total", "plain") == 0
    assert _stage_metric(dit, "omnid_stage_cache_misses_total", "plain") == 0


def test_cached_batch_of_jobs(dit: RunningDaemon) -> None:
    """Two jobs in turn on the cached stage: the hook's state is reset per call, so each counts alike."""
    jobs = [dit.submit("cached", {"prompt": "a red cat"}) for _ in range(2)]
    usages = [_finished(dit.events(j), "cached")["usage"] for j in jobs]
    assert usages[0] == usages[1], usages


# ------------------------------------------------------------------------- omnid --check


def _check(tmp_path: Path, stage: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    cfg = {"daemon": {"socket": str(tmp_path / "omnid.sock"), "state_dir": "state", "lock_dir": "lock"},
           "stages": {"draw": stage}, "pipelines": {"draw": {"stages": ["draw"]}}}
    path = tmp_path / "omnid.toml"
    path.write_text(toml_dumps(cfg))
    return subprocess.run([sys.executable, "-m", "omnid", "-c", str(path), "--check"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def _refused(result: subprocess.CompletedProcess[str], key: str, fragment: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line.strip() for line in result.stderr.splitlines() if line.startswith("  ")]
    assert any(line.startswith(f"{key}: ") and fragment in line for line in lines), result.stderr


def test_check_accepts_a_cache_on_the_dit(tmp_path: Path) -> None:
    _models()
    result = _check(tmp_path, {"engine": "diffusers", "model": str(DIT),
                               "cache": {"kind": "first_block", "threshold": 0.2}})
    assert result.returncode == 0, result.stderr


def test_check_refuses_a_cache_on_a_unet_pipeline(tmp_path: Path) -> None:
    _models()
    result = _check(tmp_path, {"engine": "diffusers", "model": str(MODELS / "sd"),
                               "cache": {"kind": "first_block", "threshold": 0.2}})
    _refused(result, "stages.draw.cache", "needs a DiT pipeline (one with a transformer)")
    _refused(result, "stages.draw.cache", "StableDiffusionPipeline with a unet")


def test_check_refuses_a_bad_kind_and_bad_options(tmp_path: Path) -> None:
    _models()
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT), "cache": {"kind": "tea_cache"}}),
             "stages.draw.cache.kind", "unknown cache kind 'tea_cache' (known: first_block,")
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT), "cache": {"threshold": 0.2}}),
             "stages.draw.cache.kind", "is required")
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT),
                               "cache": {"kind": "first_block", "treshold": 0.2}}),
             "stages.draw.cache.treshold", "unknown option for cache kind 'first_block' (known: threshold)")
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT),
                               "cache": {"kind": "first_block", "threshold": "high"}}),
             "stages.draw.cache.threshold", "must be a number")
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT), "cache": {"kind": "mag_cache"}}),
             "stages.draw.cache", "needs mag_ratios")
    _refused(_check(tmp_path, {"engine": "diffusers", "model": str(DIT), "cache": "first_block"}),
             "stages.draw.cache", "must be a table")
    _refused(_check(tmp_path, {"engine": "python", "function": "json:dumps",
                               "cache": {"kind": "first_block"}}),
             "stages.draw.cache", "only diffusers stages take a cache")


def test_parsed_cache_reaches_the_stage(tmp_path: Path) -> None:
    _models()
    cfg = C.parse({"stages": {"draw": {"engine": "diffusers", "model": str(DIT),
                                       "cache": {"kind": "pyramid_attention_broadcast",
                                                 "spatial_attention_block_skip_range": 2,
                                                 "spatial_attention_timestep_skip_range": [100, 800]}}},
                   "pipelines": {"draw": {"stages": ["draw"]}}}, base=tmp_path)
    assert dict(cfg.stages["draw"].cache) == {"kind": "pyramid_attention_broadcast",
                                              "spatial_attention_block_skip_range": 2,
                                              "spatial_attention_timestep_skip_range": [100, 800]}
    assert not C.parse({"stages": {"draw": {"engine": "diffusers", "model": str(DIT)}},
                        "pipelines": {"draw": {"stages": ["draw"]}}}, base=tmp_path).stages["draw"].cache


def test_example_config_checks() -> None:
    _models()
    example = Path(__file__).resolve().parent.parent / "etc" / "examples" / "dit_cache.toml"
    result = subprocess.run([sys.executable, "-m", "omnid", "-c", str(example), "--check"], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


def test_worker_refuses_a_stateful_kind_without_cache_context() -> None:
    """In-process: a DiT pipeline whose __call__ opens no transformer.cache_context (PixArt, SD3 in
    diffusers 0.42) cannot take first_block: the worker's load fails, saying so."""
    from omnid.engines.diffusers_engine import _apply_cache

    class Transformer:
        def enable_cache(self, config: Any) -> None:
            raise AssertionError("must be refused before")

    class PixArtLikePipeline:
        transformer = Transformer()

        def __call__(self, prompt: str) -> None:
            return None

    stage = C.StageConfig(name="draw", engine="diffusers", cache={"kind": "first_block", "threshold": 0.2})
    with pytest.raises(ValueError, match=r"stages\.draw\.cache: PixArtLikePipeline does not open a "
                                         r"transformer\.cache_context"):
        _apply_cache(stage, PixArtLikePipeline())
