"""LoRA adapters on one warm base model: a vLLM stage and a diffusers stage on the tiny models, each
with the tiny adapters `make models` builds (.models/llm-loras/{a,b}, .models/sd-loras/style).

One daemon for the module, two stage starts (vLLM inline, diffusers). The references run in the
test process: transformers + peft loading the same adapter (greedy, float32 as the stage runs), and
diffusers alone with the same seed. Nothing is mocked.
"""

from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    MODELS,
    RunningDaemon,
    build_tiny_models,
    module_daemon,
    omnictl,
    openai_on_socket,
    short_tmpdir,
    tiny_llm,
    tiny_sd,
    wait_for,
)
from PIL import Image

from omnictl.client import ApiError

# (the daemon starts in the first test: two model loads, slow on a loaded 2-core host)
pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]

LLM_LORAS = MODELS / "llm-loras"
SD_LORAS = MODELS / "sd-loras"
MAX_TOKENS = 12
PROMPT = "the cat sat on the mat"
SD_PARAMS = {"num_inference_steps": 3, "guidance_scale": 5.0, "seed": 7, "height": 32, "width": 32}
PIXEL_TOLERANCE = 2         # (as tests/test_diffusers_batching.py: a rounding step between call shapes)


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm", "sd", "llm-loras", "sd-loras")
    stages = {
        "chat": tiny_llm({"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
                         args={"dtype": "float32"}, max_inflight=8, queue_capacity=16,
                         lora={"adapters": {"a": str(LLM_LORAS / "a"), "b": str(LLM_LORAS / "b")},
                               "max_loras": 2, "max_lora_rank": 8}),
        "draw": tiny_sd(SD_PARAMS, max_inflight=4, queue_capacity=8,
                        lora={"adapters": {"style": str(SD_LORAS / "style")}, "max_lora_rank": 8}),
    }
    pipelines = {"chat": {"stages": ["chat"]}, "draw": {"stages": ["draw"]}}
    port = _free_port()
    with module_daemon(short_tmpdir(), stages, pipelines, {"heartbeat_timeout_s": 60.0,
                                                           "listen": [f"127.0.0.1:{port}"]}, ready_timeout=600) as rd:
        rd.base = f"http://127.0.0.1:{port}"          # type: ignore[attr-defined]
        yield rd


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp(d: RunningDaemon, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    """A request over the TCP listener with an API key: (status, JSON answer)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(d.base + path, data=data, method=method,  # type: ignore[attr-defined]
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ------------------------------------------------------------------ references


@pytest.fixture(scope="module")
def reference_text() -> Any:
    """Greedy text of transformers (+ peft with an adapter), float32, as the stage decodes it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "llm"))
    cache: dict[tuple[str | None, str], str] = {}

    def text(adapter: str | None, prompt: str = PROMPT) -> str:
        if (adapter, prompt) not in cache:
            model = AutoModelForCausalLM.from_pretrained(str(MODELS / "llm"), dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, str(LLM_LORAS / adapter))
            ids = torch.tensor([tok(prompt).input_ids])
            with torch.no_grad():
                out = model.eval().generate(input_ids=ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                            do_sample=False)
            cache[(adapter, prompt)] = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        return cache[(adapter, prompt)]
    return text


_PIPES: dict[tuple[tuple[str, float], ...], Any] = {}


def _reference_image(weights: dict[str, float] | None, prompt: str) -> np.ndarray:
    """diffusers alone: the tiny SD (+ the adapters at these weights), the job's seed and parameters
    (one pipeline per adapter set, kept for the module)."""
    import torch
    from diffusers import StableDiffusionPipeline

    key = tuple(sorted((weights or {}).items()))
    pipe = _PIPES.get(key)
    if pipe is None:
        pipe = _PIPES[key] = StableDiffusionPipeline.from_pretrained(str(MODELS / "sd"), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        for name, _ in key:
            pipe.load_lora_weights(str(SD_LORAS / name), adapter_name=name)
        if key:
            pipe.set_adapters([n for n, _ in key], adapter_weights=[w for _, w in key])
    params = {k: v for k, v in SD_PARAMS.items() if k != "seed"}
    image = pipe(prompt=prompt, generator=torch.Generator().manual_seed(int(SD_PARAMS["seed"])), **params).images[0]
    return np.asarray(image.convert("RGB")).astype(np.int16)


def _text(d: RunningDaemon, job: str) -> str:
    assert d.wait(job, timeout=180)["state"] == "succeeded", d.diagnose(job)
    return d.client.output(job, "text")[0].decode()


def _pixels(d: RunningDaemon, job: str) -> np.ndarray:
    assert d.wait(job, timeout=180)["state"] == "succeeded", d.diagnose(job)
    data, _ = d.client.output(job, "image")
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and int(np.abs(a - b).max()) <= PIXEL_TOLERANCE


def _span(d: RunningDaemon, job: str) -> tuple[float, float]:
    run = d.client.job(job)["stages"]["chat"]
    return float(run["started_at"]), float(run["finished_at"])


def _refused(call: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    return e.value


# ------------------------------------------------------------------ vLLM


def test_adapters_in_one_vllm_batch_each_match_transformers_and_peft(daemon: RunningDaemon,
                                                                      reference_text: Any) -> None:
    # a long base job holds the engine; base, a, b, a, base, b join its batch (max_inflight = 8)
    gate = daemon.submit("chat", {"prompt": "a long story"}, {"chat": {"max_tokens": 400}})
    wait_for(lambda: daemon.client.job(gate)["state"] == "running", timeout=120, what="the gate job runs")
    order = [None, "a", "b", "a", None, "b"]
    jobs = [daemon.submit("chat", {"prompt": PROMPT}, {"chat": {"adapter": a}} if a else None) for a in order]
    texts = [_text(daemon, job) for job in jobs]
    by = {a: {t for t, b in zip(texts, order) if b == a} for a in set(order)}
    assert all(len(v) == 1 for v in by.values()), by            # the same adapter, the same greedy text
    base, a, b = by[None].pop(), by["a"].pop(), by["b"].pop()
    assert len({base, a, b}) == 3, (base, a, b)                  # an adapter changes the output
    assert base == reference_text(None)
    assert a == reference_text("a")
    assert b == reference_text("b")
    assert daemon.wait(gate, timeout=180)["state"] == "succeeded", daemon.diagnose(gate)
    g0, g1 = _span(daemon, gate)
    spans = {job: _span(daemon, job) for job in jobs}
    for job, (s0, s1) in spans.items():
        assert s0 < g1 and g0 < s1, (job, spans, (g0, g1))      # in the engine with the base gate job
    a_spans = [spans[j] for j, x in zip(jobs, order) if x == "a"]
    b_spans = [spans[j] for j, x in zip(jobs, order) if x == "b"]
    assert any(x0 < y1 and y0 < x1 for x0, x1 in a_spans for y0, y1 in b_spans), spans    # a beside b


def test_openai_models_list_each_adapter_and_route_by_model(daemon: RunningDaemon, reference_text: Any) -> None:
    openai = pytest.importorskip("openai")
    with openai_on_socket(daemon, 120) as client:
        models = {m.id: m for m in client.models.list()}
        assert {"chat", "chat:a", "chat:b", "draw", "draw:style"} <= set(models)
        assert models["chat:a"].model_extra["parent"] == "chat"
        assert models["chat:a"].model_extra["root"] == str(LLM_LORAS / "a")
        assert client.models.retrieve("chat:b").model_extra["parent"] == "chat"
        done = client.completions.create(model="chat:a", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].text.strip() == reference_text("a")
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="chat:nope", prompt=PROMPT, max_tokens=2)
        assert e.value.code == "model_not_found" and "nope" in str(e.value)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("chat:nope")


def test_an_unknown_adapter_is_refused_at_the_door(daemon: RunningDaemon) -> None:
    e = _refused(lambda: daemon.submit("chat", {"prompt": PROMPT}, {"chat": {"adapter": "nope"}}))
    assert e.status == 400 and e.code == "invalid_param"
    assert "params.chat.adapter" in e.message and "'nope'" in e.message and "a, b" in e.message
    e = _refused(lambda: daemon.submit("draw", {"prompt": "x"}, {"draw": {"adapters": {"style": 0.5, "ink": 1}}}))
    assert e.status == 400 and "params.draw.adapters" in e.message and "'ink'" in e.message
    e = _refused(lambda: daemon.submit("draw", {"prompt": "x"}, {"draw": {"adapters": {"style": "lots"}}}))
    assert e.status == 400 and "weight" in e.message
    e = _refused(lambda: daemon.submit("chat", {"prompt": PROMPT}, {"chat": {"adapters": {"a": 1}}}))
    assert e.status == 400 and "adapters" in e.message       # a vLLM request takes one adapter: `adapter`


# ------------------------------------------------------------------ diffusers


def test_diffusers_adapter_changes_the_image_as_diffusers_alone_does_and_never_leaks(daemon: RunningDaemon) -> None:
    prompts = ["a red fox", "a blue boat"]
    # base and styled jobs queued together: the batches group them by adapter set
    jobs = [(p, w, daemon.submit("draw", {"prompt": p}, {"draw": {"adapters": w}} if w else None))
            for w in (None, {"style": 0.8}) for p in prompts]
    jobs.append((prompts[0], None, daemon.submit("draw", {"prompt": prompts[0]})))     # after a styled one
    got = [(p, w, _pixels(daemon, job)) for p, w, job in jobs]
    for prompt, weights, pixels in got:
        want = _reference_image(weights, prompt)
        assert _close(pixels, want), (prompt, weights, int(np.abs(pixels - want).max()))
    base, styled = got[0][2], got[2][2]
    assert int(np.abs(base - styled).max()) > 10         # the adapter visibly changes the image
    assert _close(got[4][2], base)                       # the styled jobs' adapter did not stay on


# ------------------------------------------------------------------ at run time


def test_add_and_remove_an_adapter_while_jobs_run(daemon: RunningDaemon, reference_text: Any) -> None:
    long_params = {"chat": {"max_tokens": 400}}
    runner = daemon.submit("chat", {"prompt": "a long story"}, long_params)
    wait_for(lambda: daemon.client.job(runner)["state"] == "running", timeout=60, what="the long job runs")
    added = daemon.client.add_adapter("chat", "a2", str(LLM_LORAS / "a"))
    assert added["rank"] == 8 and "a2" in [x["name"] for x in added["lora"]["adapters"]]
    assert daemon.client.job(runner)["state"] == "running"       # nothing stopped for it
    assert _text(daemon, daemon.submit("chat", {"prompt": PROMPT}, {"chat": {"adapter": "a2"}})) \
        == reference_text("a")
    # removed while a job using it runs: that job finishes with it; new ones are refused
    using = daemon.submit("chat", {"prompt": "a long story"}, {"chat": {"adapter": "a2", "max_tokens": 400}})
    wait_for(lambda: daemon.client.job(using)["state"] == "running", timeout=60, what="the a2 job runs")
    daemon.client.remove_adapter("chat", "a2")
    e = _refused(lambda: daemon.submit("chat", {"prompt": PROMPT}, {"chat": {"adapter": "a2"}}))
    assert e.status == 400 and "'a2'" in e.message
    assert daemon.wait(using, timeout=180)["state"] == "succeeded", daemon.diagnose(using)
    assert daemon.wait(runner, timeout=180)["state"] == "succeeded", daemon.diagnose(runner)
    assert "a2" not in [x["name"] for x in daemon.client.adapters("chat")["lora"]["adapters"]]
    # and the base and the other adapters were not disturbed
    assert _text(daemon, daemon.submit("chat", {"prompt": PROMPT})) == reference_text(None)


def test_run_time_adds_are_checked(daemon: RunningDaemon, tmp_path: Path) -> None:
    e = _refused(lambda: daemon.client.add_adapter("chat", "x", str(tmp_path)))
    assert e.status == 400 and e.code == "invalid_adapter" and "no LoRA adapter" in e.message
    e = _refused(lambda: daemon.client.add_adapter("chat", "x", str(SD_LORAS / "style")))
    assert e.status == 400 and "another base model" in e.message
    e = _refused(lambda: daemon.client.add_adapter("chat", "a", str(LLM_LORAS / "b")))
    assert e.status == 409 and e.code == "adapter_exists"
    e = _refused(lambda: daemon.client.remove_adapter("chat", "nope"))
    assert e.status == 404 and e.code == "unknown_adapter"
    e = _refused(lambda: daemon.client.add_adapter("draw", "bad name!", str(SD_LORAS / "style")))
    assert e.status == 400


def test_omnictl_adapter_commands_and_pipelines(daemon: RunningDaemon) -> None:
    out = omnictl(daemon, "adapter", "add", "draw", "style2", str(SD_LORAS / "style"))
    assert out.returncode == 0, out.stderr
    listed = omnictl(daemon, "adapter", "list", "draw")
    assert listed.returncode == 0 and "style2" in listed.stdout and str(MODELS / "sd") in listed.stdout
    styled = daemon.submit("draw", {"prompt": "a red fox"}, {"draw": {"adapter": "style2"}})
    assert _close(_pixels(daemon, styled), _reference_image({"style": 1.0}, "a red fox"))
    pipelines = omnictl(daemon, "pipelines")
    assert pipelines.returncode == 0
    assert "chat: a, b" in pipelines.stdout and "draw: style, style2" in pipelines.stdout
    assert f"base {MODELS / 'llm'}" in pipelines.stdout
    described = json.loads(omnictl(daemon, "--json", "pipelines", "draw").stdout)
    assert [a["name"] for a in described["adapters"]["draw"]["adapters"]] == ["style", "style2"]
    assert described["params"]["draw"]["params"]["adapter"]["enum"] == ["style", "style2"]
    doc = daemon.client.openapi()
    assert "/v1/stages/{name}/adapters" in doc["paths"] and "/v1/stages/{name}/adapters/{adapter}" in doc["paths"]
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in body:                              # (the request models' schemas are components)
        body = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert "chat:a" in body["properties"]["model"]["enum"], body["properties"]["model"]
    out = omnictl(daemon, "adapter", "rm", "draw", "style2")
    assert out.returncode == 0, out.stderr
    assert "style2" not in omnictl(daemon, "adapter", "list", "draw").stdout


def test_over_tcp_only_an_admins_key_changes_adapters(daemon: RunningDaemon) -> None:
    user = daemon.client.add_key("lora-user", uid=54321)["key"]
    admin = daemon.client.add_key("lora-admin", uid=54321, admin=True)["key"]
    root = daemon.client.add_key("lora-root", uid=0)["key"]          # uid 0, but not made with --admin
    body = {"name": "t", "path": str(LLM_LORAS / "b")}
    for key in (user, root):            # over TCP only an --admin key may (whatever its uid)
        status, answer = _tcp(daemon, "POST", "/v1/stages/chat/adapters", key, body)
        assert status == 403 and answer["error"]["code"] == "not_admin"
    status, answer = _tcp(daemon, "GET", "/v1/stages/chat/adapters", user)
    assert status == 200 and [a["name"] for a in answer["lora"]["adapters"]] == ["a", "b"]
    status, answer = _tcp(daemon, "POST", "/v1/stages/chat/adapters", admin, body)
    assert status == 201 and answer["added"] == "t"
    assert _tcp(daemon, "DELETE", "/v1/stages/chat/adapters/t", user)[0] == 403
    assert _tcp(daemon, "DELETE", "/v1/stages/chat/adapters/t", root)[0] == 403
    status, answer = _tcp(daemon, "DELETE", "/v1/stages/chat/adapters/t", admin)
    assert status == 200 and answer["removed"] == "t"
