"""How a text answer ends, on every path that gives one: the OpenAI chat (plain and streamed),
`/v1/completions`, Realtime (`/v1/realtime`) and `omnictl talk --text`.

One daemon for the module, on the tiny Llama (a context window of WINDOW tokens, greedy, its end
token ignored, so an answer runs until a limit stops it) and a python stage that returns its text
at the end instead of streaming it (teststages.reply):
- a python stage's text returned at the end is the answer on each path (Realtime lost it);
- an answer cut by the context window says `finish_reason: "length"` (Realtime: `incomplete`,
  `max_output_tokens`), as one cut by `max_tokens` does, and as vLLM says;
- a `max_tokens` beyond the context window is a 400 that names the limit, in `vllm serve`'s words.
The OpenAI package is the client of the OpenAI paths; Realtime is a raw WebSocket (aiohttp).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    ROOT,
    RunningDaemon,
    build_tiny_models,
    demo_stage,
    module_daemon,
    omnictl,
    openai_on_socket,
    py_stage,
    short_tmpdir,
    tiny_llm,
)

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

WINDOW = 128                    # the llm stage's max_model_len
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
TOO_MANY = f"cannot be greater than max_model_len={WINDOW}. Please request fewer output tokens."


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm")
    stages = {"llm": tiny_llm({"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}, max_model_len=WINDOW),
              "say": py_stage("reply"), "voice": demo_stage("vocoder", defaults={"seconds_per_word": 0.02})}
    pipelines = {"chat": {"stages": ["llm"]}, "say": {"stages": ["say"]}, "speak": {"stages": ["voice"]}}
    with module_daemon(short_tmpdir(), stages, pipelines,
                       {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[Any]:
    with openai_on_socket(daemon, 120) as c:
        yield c


# ------------------------------------------------------------------ Realtime, raw


async def _realtime(d: RunningDaemon, model: str, text: str, response: dict[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
    """One user turn and one response over /v1/realtime; every event received until response.done
    (or the first error)."""
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(d.socket))) as http:
        async with http.ws_connect(f"http://omnid/v1/realtime?model={model}", max_msg_size=0) as ws:
            await ws.send_str(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                                "output_modalities": ["text"]}}))
            await ws.send_str(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
            await ws.send_str(json.dumps({"type": "response.create", **({"response": response} if response else {})}))
            events: list[dict[str, Any]] = []
            deadline = time.monotonic() + 120
            while True:
                msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                assert msg.type == aiohttp.WSMsgType.TEXT, (msg, events)
                events.append(json.loads(msg.data))
                if events[-1]["type"] in ("response.done", "error"):
                    return events


def realtime(d: RunningDaemon, model: str, text: str, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return asyncio.run(_realtime(d, model, text, response))


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def streamed(client: Any, path: str, **body: Any) -> tuple[str, str | None, dict[str, Any] | None]:
    """A streamed answer: its text, the last chunk's finish_reason, its usage."""
    text, finish, usage = "", None, None
    chunks = (client.chat.completions if path == "chat" else client.completions).create(
        stream=True, stream_options={"include_usage": True}, **body)
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += (choice.delta.content or "") if path == "chat" else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


# ------------------------------------------------------------------ a python stage's text at the end


def test_a_python_stages_text_returned_at_the_end_is_the_answer_on_every_path(daemon: RunningDaemon,
                                                                               client: Any) -> None:
    # Realtime: the text as a delta, in the item and the done events, counted
    events = realtime(daemon, "say", "hello there")
    done = events[-1]
    assert done["type"] == "response.done", events
    assert deltas(events) == "you said: hello there", [e["type"] for e in events]
    assert done["response"]["status"] == "completed", done
    assert done["response"]["output"][0]["content"][0]["text"] == "you said: hello there", done
    assert done["response"]["usage"]["output_tokens"] == 1, done
    [text_done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert text_done["text"] == "you said: hello there"
    # omnictl talk --text, as a user types it
    r = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "talk", "say", "--text"],
                       input="hi omnid\n", capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "you said: hi omnid" in r.stdout, r.stdout
    # the OpenAI paths: the same text, counted as one piece
    plain = client.chat.completions.create(model="say", messages=CHAT)
    assert plain.choices[0].message.content == "you said: Tell me about the sea."
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    assert streamed(client, "chat", model="say", messages=CHAT)[:2] == ("you said: Tell me about the sea.", "stop")
    assert client.completions.create(model="say", prompt="waves").choices[0].text == "you said: waves"
    assert streamed(client, "completions", model="say", prompt="waves")[:2] == ("you said: waves", "stop")


def test_a_streamed_answer_says_its_finish_reason_with_its_last_token(daemon: RunningDaemon, client: Any) -> None:
    """As `vllm serve` ends a stream: the last token's chunk carries `finish_reason` (no empty chunk
    after it, one more gap for a client that times them); the usage chunk and `[DONE]` follow."""
    for path, body in (("chat", {"model": "chat", "messages": CHAT}), ("completions", {"model": "chat", "prompt": "The sea is"})):
        chunks = list((client.chat.completions if path == "chat" else client.completions).create(
            stream=True, stream_options={"include_usage": True}, max_tokens=8, **body))
        with_choices = [c for c in chunks if c.choices]
        last = with_choices[-1].choices[0]
        assert last.finish_reason == "length", (path, with_choices[-1])
        assert ((last.delta.content if path == "chat" else last.text) or ""), (path, "an empty last chunk", chunks[-3:])
        assert all(c.choices[0].finish_reason is None for c in with_choices[:-1]), path
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8, (path, chunks[-1])


# ------------------------------------------------------------------ cut by the context window


def test_an_answer_cut_by_the_context_window_says_length(daemon: RunningDaemon, client: Any) -> None:
    """max_tokens = the whole window: the prompt leaves less room, so the context cuts the answer."""
    plain = client.chat.completions.create(model="chat", messages=CHAT, max_tokens=WINDOW)
    assert plain.usage.total_tokens == WINDOW and plain.usage.completion_tokens < WINDOW, plain.usage
    assert plain.choices[0].finish_reason == "length", plain
    text, finish, usage = streamed(client, "chat", model="chat", messages=CHAT, max_tokens=WINDOW)
    assert finish == "length" and usage is not None and usage["total_tokens"] == WINDOW, (finish, usage)
    done = client.completions.create(model="chat", prompt="The sea is", max_tokens=WINDOW)
    assert done.choices[0].finish_reason == "length" and done.usage.total_tokens == WINDOW, done
    text, finish, usage = streamed(client, "completions", model="chat", prompt="The sea is", max_tokens=WINDOW)
    assert finish == "length" and usage is not None and usage["total_tokens"] == WINDOW, (finish, usage)
    # cut by max_tokens: "length" too; the python stage's whole answer: "stop" (above)
    short = client.chat.completions.create(model="chat", messages=CHAT, max_tokens=3)
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 3), short
    # Realtime: a response cut short is `incomplete` for `max_output_tokens`, as OpenAI says it
    events = realtime(daemon, "chat", "Tell me about the sea.", {"max_output_tokens": WINDOW})
    response = events[-1]["response"]
    assert response["status"] == "incomplete", response
    assert response["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}, response
    assert response["usage"]["total_tokens"] == WINDOW, response["usage"]


def test_max_tokens_beyond_the_context_window_is_a_400_naming_the_limit(daemon: RunningDaemon,
                                                                          client: Any) -> None:
    before = len(daemon.client.jobs(limit=1000)["jobs"])
    for make in (lambda: client.chat.completions.create(model="chat", messages=CHAT, max_tokens=100000),
                 lambda: client.chat.completions.create(model="chat", messages=CHAT, max_tokens=100000,
                                                        stream=True),
                 lambda: client.completions.create(model="chat", prompt="The sea is", max_tokens=100000),
                 lambda: client.completions.create(model="chat", prompt="The sea is", max_tokens=100000,
                                                   stream=True)):
        with pytest.raises(openai.BadRequestError) as refused:
            make()
        assert refused.value.status_code == 400
        assert refused.value.body["message"] == f"max_tokens=100000 {TOO_MANY}", refused.value.body
        assert refused.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="chat", messages=CHAT, max_completion_tokens=WINDOW + 1)
    assert refused.value.body["message"] == f"max_completion_tokens={WINDOW + 1} {TOO_MANY}"
    # the window itself is allowed (the prompt's room is less: cut, "length", above)
    # omnid's own API and Realtime say the same
    r = omnictl(daemon, "submit", "chat", "--prompt", "The sea is", "-p", "llm.max_tokens=100000")
    assert r.returncode == 4 and f"max_tokens=100000 {TOO_MANY}" in r.stderr, r.stderr
    events = realtime(daemon, "chat", "Tell me about the sea.", {"max_output_tokens": 4000})
    assert events[-1]["type"] == "error" and f"max_tokens=4000 {TOO_MANY}" in events[-1]["error"]["message"], events
    assert len(daemon.client.jobs(limit=1000)["jobs"]) == before, "a refused request makes no job"


# ------------------------------------------------------------------ what a pipeline produces


def test_what_a_pipeline_produces_is_known_before_any_job_and_refused_at_the_door(daemon: RunningDaemon,
                                                                                   client: Any) -> None:
    """`speak` ends in the demo's vocoder (`vocoder.produces = ("audio", "text")`), and has run no job:
    /v1/models lists its outputs, and /v1/images/generations on it is a 400 before any job is made."""
    assert not daemon.client.jobs(pipeline="speak", limit=10)["jobs"]
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert models["speak"]["omnid"]["outputs"] == ["audio", "text"], models["speak"]
    assert models["speak"]["omnid"]["endpoints"] == ["/v1/audio/speech", "/v1/chat/completions", "/v1/completions"]
    assert models["chat"]["omnid"]["outputs"] == ["text"] and models["chat"]["omnid"]["media"] == []
    assert models["say"]["omnid"]["outputs"] is None             # (its function declares nothing)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="speak", prompt="a red fox")
    assert refused.value.body["code"] == "model_not_supported", refused.value.body
    assert "produces audio, text, not image" in refused.value.body["message"], refused.value.body
    assert not daemon.client.jobs(pipeline="speak", limit=10)["jobs"], "refused at the door: no job"

