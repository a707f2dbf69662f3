"""A vLLM stage on the CPU as vLLM runs it by default: the model torch.compile'd, its compile cache
written where VLLM_CACHE_ROOT says; one whose cache has no room, which runs eager and says why
instead of failing to load (inductor raises ENOSPC); and every other tiny vLLM model (the vision- and
audio-language models, the omni thinker, the codec LM) on vLLM's defaults, as a user's first stage
would be: no `args` at all, compiled. Real daemon, real engines, a real full tmpfs.

(The rest of the suite sets enforce_eager: a compiled load costs ~30 s on 2 cores.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir
from omnidtest import tmpfs

from omnid.engines import vllm_compat

LLM = MODELS / "llm"
# every other tiny model vLLM loads: stage name -> model folder
DEFAULTS = {"vlm": MODELS / "vlm", "alm": MODELS / "alm", "thinker": MODELS / "omni" / "thinker", "tts": MODELS / "tts"}
# vLLM 0.28's Transformers modeling backend (the tiny LLaVA names it as its architecture) cannot
# compile the model: Dynamo's fake tensors fail the attention's view ("shape '[1, s77, -1, 64]' is
# invalid for input of size 128"), a load error on that vLLM alone (0.32 compiles it; with torchvision
# a LLaVA loads as vLLM's own LlavaForConditionalGeneration). docs/operations/upgrades.md says so.
_VLLM = vllm_compat.installed()
if _VLLM is not None and vllm_compat._release(_VLLM[1])[:2] == (0, 28):
    del DEFAULTS["vlm"]

# Compiling the graph at start takes ~70 s on 2 quiet cores, and past the suite's 300 s per test on
# loaded ones (seen under a 2-process burner): the module's setup has the 600 s its daemon waits.
pytestmark = [pytest.mark.timeout(720), pytest.mark.vllm]


def compiled_stage(cache_root: Path) -> dict[str, Any]:
    return {"engine": "vllm", "model": str(LLM), "devices": [], "max_inflight": 4,
            "args": {"max_model_len": 256, "dtype": "bfloat16", "seed": 0},      # no enforce_eager
            "env": {"VLLM_CACHE_ROOT": str(cache_root)},
            "defaults": {"max_tokens": 8, "ignore_eos": True, "temperature": 0.0}}


@pytest.fixture(scope="module")
def d() -> Iterator[RunningDaemon]:
    if not (LLM / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)
    top = short_tmpdir()
    stack = contextlib.ExitStack()
    try:
        full = stack.enter_context(tmpfs(top / "full", 4))
        subprocess.run(["dd", "if=/dev/zero", f"of={full / 'ballast'}", "bs=64k"], capture_output=True)  # until ENOSPC
        stages = {"compiled": compiled_stage(top / "cache"), "nocache": compiled_stage(full / "vllm"),
                  # nothing but the model (and where its compile cache goes): vLLM's own defaults; the
                  # core inline (omnid's placement, not vLLM's: "compiled" above runs the default one)
                  **{name: {"engine": "vllm", "model": str(model), "engine_core": "inline",
                            "env": {"VLLM_CACHE_ROOT": str(top / "cache")}}
                     for name, model in DEFAULTS.items()}}
        pipelines = {name: {"stages": [name]} for name in stages}
        (top / "d").mkdir()
        with module_daemon(top / "d", stages, pipelines, ready_timeout=600) as rd:
            rd.top = top          # type: ignore[attr-defined]
            yield rd
    finally:
        stack.close()
        shutil.rmtree(top, ignore_errors=True)


def run_one(d: RunningDaemon, pipeline: str) -> dict[str, Any]:
    doc = d.wait(d.submit(pipeline, {"prompt": "a compiled model"}))
    assert doc["state"] == "succeeded", doc
    return doc


def test_a_cpu_stage_compiles_by_default_and_caches_the_graph(d: RunningDaemon) -> None:
    for _ in range(2):
        text, _ = d.client.output(run_one(d, "compiled")["id"], "text")
        assert text
    cache = d.top / "cache" / "torch_compile_cache"          # type: ignore[attr-defined]
    assert cache.is_dir() and any(p.is_file() for p in cache.rglob("*")), "no compiled graph was cached"
    assert "compile caches have no room" not in log_of(d, "compiled")
    info = d.stages()["compiled"]["info"]
    assert info["compiled"] is True and info["threads"] == max(1, len(os.sched_getaffinity(0)) - 1), info


def test_a_stage_whose_compile_cache_is_full_runs_eager_and_says_why(d: RunningDaemon) -> None:
    run_one(d, "nocache")
    said = log_of(d, "nocache")
    assert "compile caches have no room" in said and str(d.top / "full" / "vllm") in said, said[-3000:]  # type: ignore[attr-defined]
    assert not (d.top / "full" / "vllm" / "torch_compile_cache").exists()     # type: ignore[attr-defined]
    assert d.stages()["nocache"]["info"]["compiled"] is False


def test_every_tiny_model_loads_compiled_on_vllms_defaults(d: RunningDaemon) -> None:
    """The daemon came up, so each stage loaded: each says it is compiled, runs the vLLM it names,
    and answers a prompt with tokens (greedy here: `temperature` is the only thing a job sets)."""
    installed = vllm_compat.installed()
    assert installed is not None
    stages = d.stages()
    for name in DEFAULTS:
        info = stages[name]["info"]
        assert info["compiled"] is True, (name, info)
        assert info["vllm"].split("+")[0] == installed[1].split("+")[0], (name, info, installed)
        assert info["max_model_len"] >= 512, (name, info)        # the model's own length
        doc = d.wait(d.submit(name, {"prompt": "hello there"}, params={name: {"max_tokens": 4}}))
        assert doc["state"] == "succeeded", (name, doc)
        if name != "tts":                       # (the codec LM writes codes, which decode to no text)
            assert d.client.output(doc["id"], "text")[0], name


def log_of(d: RunningDaemon, stage: str) -> str:
    return "\n".join(line for line in d.log().splitlines() if stage in line)
