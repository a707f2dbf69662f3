"""The OpenAI-compatible endpoints, through the official `openai` package over the Unix socket.

One daemon for the module (vLLM and diffusers on the tiny models in .models/, the demo's toy
vocoder, and a slow python text stage to hang up on). Every request is an ordinary job: the tests
look it up in `GET /v1/jobs` as its owner sees it. Nothing is mocked.
"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    MODELS,
    RunningDaemon,
    build_tiny_models,
    chat_draw_speak,
    module_daemon,
    omnictl,
    openai_on_socket,
    py_stage,
    short_tmpdir,
    wait_for,
)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm", "sd")
    d = short_tmpdir()
    stages, pipelines = chat_draw_speak()
    # a python last stage that writes text slowly: 200 segments, 50 ms apart
    stages["slow"] = py_stage("count", defaults={"n": 200, "delay": 0.05})
    pipelines["slow"] = {"stages": ["slow"]}
    with module_daemon(d, stages, pipelines, {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[Any]:
    with openai_on_socket(daemon, 120) as c:
        yield c


def _job(daemon: RunningDaemon, job_id: str) -> dict[str, Any]:
    """The job as its owner lists it (`GET /v1/jobs`)."""
    jobs = {j["id"]: j for j in daemon.client.jobs(limit=1000)["jobs"]}
    assert job_id in jobs, f"job {job_id} is not in the caller's jobs"
    job = jobs[job_id]
    assert job["owner_uid"] == os.getuid()
    return job


def test_models_are_the_pipelines(client: Any) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"chat", "t2i", "speak", "slow"}
    chat = models["chat"]
    assert chat.object == "model" and chat.owned_by == "omnid"
    assert chat.model_extra["omnid"]["outputs"] == ["text"]
    assert chat.model_extra["omnid"]["stages"] == ["expand"]
    assert "/v1/chat/completions" in chat.model_extra["omnid"]["endpoints"]
    assert models["t2i"].model_extra["omnid"]["outputs"] == ["image"]
    assert client.models.retrieve("t2i").id == "t2i"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found"


def test_chat_plain_and_streamed_say_the_same(client: Any, daemon: RunningDaemon) -> None:
    plain = client.chat.completions.create(model="chat", messages=CHAT, temperature=0, max_tokens=8, seed=3)
    content = plain.choices[0].message.content
    assert plain.object == "chat.completion" and plain.model == "chat"
    assert plain.choices[0].message.role == "assistant"
    assert isinstance(content, str) and content.strip()
    # the random model never says EOS: it stops at max_tokens, each token counted
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 8
    assert plain.usage.prompt_tokens > 0                            # the vLLM stage's own count
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 8
    longer = client.chat.completions.create(model="chat", messages=CHAT + [
        {"role": "assistant", "content": "It is large."}, {"role": "user", "content": "And deep?"}],
        temperature=0, max_tokens=1)
    assert longer.usage.prompt_tokens > plain.usage.prompt_tokens

    stream = client.chat.completions.create(model="chat", messages=CHAT, temperature=0, max_tokens=8, seed=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == content
    assert len([d for d in deltas if d]) >= 2                      # it came in pieces
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"

    for answer_id in (plain.id, chunks[0].id):
        assert answer_id.startswith("chatcmpl-")
        job = _job(daemon, answer_id.removeprefix("chatcmpl-"))
        assert job["pipeline"] == "chat" and job["state"] == "succeeded"
        assert "messages" in job["inputs"] and "prompt" not in job["inputs"]
        assert job["params"] == {"expand": {"max_tokens": 8, "temperature": 0, "seed": 3, "include_prompt": False}}


def test_completion(client: Any, daemon: RunningDaemon) -> None:
    done = client.completions.create(model="chat", prompt="The morning was", max_tokens=5, temperature=0)
    text = done.choices[0].text
    assert done.object == "text_completion" and text.strip() and not text.startswith("The morning")
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    from tokenizers import Tokenizer  # the stage's tokenizer, read here: the count is the real one
    ids = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json")).encode("The morning was").ids
    assert done.usage.prompt_tokens == len(ids), (done.usage, ids)
    echoed = client.completions.create(model="chat", prompt="The morning was", max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The morning was" + text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="chat", prompt="The morning was", max_tokens=5, temperature=0, stream=True))
    assert streamed == text
    assert _job(daemon, done.id.removeprefix("cmpl-"))["state"] == "succeeded"


def test_image(client: Any, daemon: RunningDaemon) -> None:
    raw = client.images.with_raw_response.generate(model="t2i", prompt="a red fox", size="64x64")
    image = raw.parse()
    png = base64.b64decode(image.data[0].b64_json)
    assert png.startswith(PNG_MAGIC)
    assert struct.unpack(">II", png[16:24]) == (64, 64)           # IHDR: width, height
    assert image.data[0].revised_prompt.startswith("a red fox")   # what the LLM stage wrote
    job = _job(daemon, raw.headers["x-omnid-job"])
    assert job["pipeline"] == "t2i" and job["state"] == "succeeded"
    assert job["params"] == {"draw": {"width": 64, "height": 64}}
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(model="t2i", prompt="a red fox", response_format="url")
    assert e.value.param == "response_format"


def test_speech_streams_a_wav(client: Any, daemon: RunningDaemon) -> None:
    with client.audio.speech.with_streaming_response.create(model="speak", input="the sea at night",
                                                            voice="alloy", response_format="wav") as resp:
        assert resp.headers["content-type"] == "audio/wav"
        job_id = resp.headers["x-omnid-job"]
        chunks = list(resp.iter_bytes())
    audio = b"".join(chunks)
    assert audio[:4] == b"RIFF" and audio[8:12] == b"WAVE" and len(audio) > 1000
    job = _job(daemon, job_id)
    assert job["pipeline"] == "speak" and job["state"] == "succeeded"
    final, _ = daemon.client.output(job_id, "audio")
    assert audio == final


def test_a_streamed_chat_that_hangs_up_cancels_its_job(client: Any, daemon: RunningDaemon) -> None:
    stream = client.chat.completions.create(model="slow", messages=CHAT, stream=True)
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) == 2:
            break
    stream.close()
    assert pieces == ["0 ", "1 "]
    job_id = chunk.id.removeprefix("chatcmpl-")
    job = wait_for(lambda: (j := _job(daemon, job_id))["state"] != "running" and j, 30,
                   f"job {job_id} to end after its caller hung up")
    assert job["state"] == "cancelled", job


def test_a_streamed_chat_opens_with_its_first_token_not_before(client: Any, daemon: RunningDaemon) -> None:
    # The role chunk goes out with the first text (as `vllm serve` sends it), so a client that
    # times the first chunk times the first token. The `slow` stage sleeps 50 ms before its first
    # segment: a role chunk sent at the POST would come before the supervisor had that segment.
    import time
    stream = client.chat.completions.create(model="slow", messages=CHAT, stream=True)
    it = iter(stream)
    first = next(it)
    t_first = time.time()
    second = next(it)
    stream.close()
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert second.choices[0].delta.content == "0 "
    job_id = first.id.removeprefix("chatcmpl-")
    wait_for(lambda: _job(daemon, job_id)["state"] != "running", 30, f"job {job_id} to end")
    segment = next(e for e in daemon.events(job_id) if e["type"] == "segment")
    assert float(segment["ts"]) <= t_first, (segment["ts"], t_first)


def test_errors_are_openai_shaped(client: Any, daemon: RunningDaemon) -> None:
    before = len(daemon.client.jobs(limit=1000)["jobs"])
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="chat", messages=CHAT, n=2)
    assert bad.value.param == "n" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="chat", messages=CHAT, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="t2i", messages=CHAT)          # it ends in an image
    assert bad.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="chat", input="hello", voice="alloy")
    assert bad.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chat", messages=[{"role": "wizard", "content": "hi"}])
    assert len(daemon.client.jobs(limit=1000)["jobs"]) == before           # no job for a refusal
    # once the vocoder pipeline has run, the model list knows what it produces
    speak = client.models.retrieve("speak")
    assert speak.model_extra["omnid"]["outputs"] in (None, ["audio", "text"])
    # the omnid API itself is unchanged: a chat job is also an ordinary POST /v1/jobs
    job = daemon.client.submit("chat", {"messages": '[{"role": "user", "content": "hi"}]'},
                               {"expand": {"max_tokens": 3}})
    assert daemon.wait(job["id"], timeout=60)["state"] == "succeeded"


def test_input_the_model_cannot_take_is_a_400_at_the_door_or_from_the_model(client: Any,
                                                                             daemon: RunningDaemon) -> None:
    from tokenizers import Tokenizer

    from omnictl.client import ApiError

    before = len(daemon.client.jobs(limit=1000)["jobs"])
    long = " ".join(f"word{i}" for i in range(3000))
    # A chat over max_model_len (256 here): a 400 that names the input, before any job is made.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": long}])
    assert bad.value.code == "prompt_too_long" and bad.value.param == "messages", bad.value.body
    assert "at most 256 (max_model_len)" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="chat", prompt=long)
    assert bad.value.code == "prompt_too_long" and bad.value.param == "prompt"
    # POST /v1/jobs likewise: a 400, not a 201 and then a failed job; a 20 MB prompt is counted on
    # a prefix, and its answer is small.
    for prompt in (long, "x " * 10_000_000):
        with pytest.raises(ApiError) as e:
            daemon.client.submit("chat", {"prompt": prompt})
        assert e.value.status == 400 and e.value.code == "prompt_too_long", e.value
        assert len(e.value.message) < 500
    # A prompt of the wrong type is said to be that, and a misspelt one is named, through omnictl too.
    with pytest.raises(ApiError) as e:
        daemon.client.submit("chat", {"prompt": 42})
    assert e.value.code == "invalid_input" and "must be text, not a number" in e.value.message, e.value
    typo = omnictl(daemon, "submit", "chat", "--input", "promt=fox")
    assert typo.returncode == 4 and "missing_input" in typo.stderr, typo
    assert "(did you mean \"prompt\" for 'promt'?)" in typo.stderr, typo.stderr
    assert len(daemon.client.jobs(limit=1000)["jobs"]) == before
    # A prompt that fits is taken, whatever its length in characters.
    fits = daemon.client.submit("chat", {"prompt": " ".join(["sea"] * 120)}, {"expand": {"max_tokens": 2}})
    assert daemon.wait(fits["id"], timeout=60)["state"] == "succeeded"
    # One the door lets by, as its text alone fits, but the chat template's own tokens push over
    # the window: the model refuses it, and that is the request's fault, a 400 too.
    tok = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json"))
    ids = tok.encode(long, add_special_tokens=False).ids[:256]
    content = tok.decode(ids)
    assert len(tok.encode(content, add_special_tokens=False).ids) <= 256
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": content}])
    assert bad.value.code == "input_rejected", bad.value.body
    job = daemon.client.jobs(limit=1)["jobs"][0]
    assert job["state"] == "failed" and job["error"]["code"] == "input_rejected", job

