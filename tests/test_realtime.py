"""OpenAI's Realtime API (`GET /v1/realtime`, a WebSocket) with a real daemon on the tiny models.

One daemon for the module: the `omni` pipeline (the tiny Qwen2.5-Omni: thinker in vLLM, talker and
code2wav in python stages) and `alm` (the tiny Qwen2-Audio in vLLM, which takes audio), on its
socket and on a TCP port whose keys are made with the real `omnictl key add`. The official `openai`
package's realtime client holds a two-turn conversation over TCP; raw WebSockets (aiohttp, over
the Unix socket and TCP) cover barge-in, audio in, refusals and a socket dropped mid-answer.
Every server event a test receives is validated against OpenAI's published schema
(tests/fixtures/openai_realtime_schemas.json, copied from openai/openai-openapi).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import FIXTURES, MODELS, TINY_LLM_ARGS, RunningDaemon, module_daemon, short_tmpdir, tiny_llm, wait_for

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("websockets")           # the openai package's realtime client runs on it

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

KEY_UID = 54331
IDLE_S = 15.0
RATE = 24000
STAGES: dict[str, Any] = {
    "thinker": {"engine": "vllm", "model": str(MODELS / "omni" / "thinker"), "devices": [], "max_inflight": 8,
                "hidden_prompt": True, "args": {"max_model_len": 512, "dtype": "float32", "seed": 0, "enforce_eager": True},
                "defaults": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}},
    "talker": {"engine": "python", "sessions": "omnid.omni.stages:Talker", "model": str(MODELS / "omni"),
               "max_inflight": 8, "defaults": {"codes_per_token": 4}},
    "code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": str(MODELS / "omni"),
                 "max_inflight": 8, "defaults": {"num_steps": 2}},
    "listen": tiny_llm({"max_tokens": 8, "temperature": 0.0, "seed": 7}, model=MODELS / "alm",
                       media={"audio": 1, "max_audio_s": 5}),
}
PIPELINES: dict[str, Any] = {
    "omni": {"stages": ["thinker", "talker", "code2wav"],
             "edges": [{"from": "thinker", "to": "talker", "window": 1,
                        "map": {"prompt_ids": "prompt_token_ids", "ids": "token_ids", "states": "hidden_states"}},
                       {"from": "talker", "to": "code2wav", "window": [4, 8, 16, 25], "map": {"codes": "codes"}}],
             "outputs": {"thinker": ["text"]}, "timeout_s": 240},
    "alm": {"stages": ["listen"]},
}
assert TINY_LLM_ARGS                            # (the alm stage's vLLM arguments are the suite's own)


# ------------------------------------------------------------------ OpenAI's schema


def _nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


_DOC = _nullable(json.loads((FIXTURES / "openai_realtime_schemas.json").read_text()))
# The session's input transcription and noise reduction, off: null, as OpenAI's own server sends them
# and its clients' models take them (Optional); the published schema calls them "nullable" in
# words only ("can be set to `null` to turn off").
for _session in ("RealtimeSessionCreateResponseGA", "RealtimeSessionCreateRequestGA"):
    _input = _DOC["components"]["schemas"][_session]["properties"]["audio"]["properties"]["input"]["properties"]
    for _field in ("transcription", "noise_reduction"):
        _input[_field] = {"anyOf": [_input[_field], {"type": "null"}]}


def _validator(name: str) -> Any:
    return jsonschema.Draft202012Validator({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                            "components": _DOC["components"],
                                            "$ref": f"#/components/schemas/{name}"})


_ROOT = _validator("RealtimeServerEvent")
_BY_TYPE = {}
for _ref in _DOC["components"]["schemas"]["RealtimeServerEvent"]["anyOf"]:
    _name = _ref["$ref"].rsplit("/", 1)[1]
    _BY_TYPE[_DOC["components"]["schemas"][_name]["properties"]["type"]["enum"][0]] = _validator(_name)
CHECKED: list[str] = []                 # every server event type validated in this run


def check_event(ev: dict[str, Any]) -> dict[str, Any]:
    """A server event against OpenAI's schema: the component its type names, and the union."""
    validator = _BY_TYPE.get(ev.get("type"))
    assert validator is not None, f"not one of OpenAI's server event types: {ev.get('type')!r}"
    for v in (validator, _ROOT):
        errors = sorted(v.iter_errors(ev), key=lambda e: list(e.path))
        assert not errors, f"not a valid {ev['type']} event: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message[:300]}" for e in errors[:3])
    CHECKED.append(ev["type"])
    return ev


# ------------------------------------------------------------------ the daemon


def free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    from omnidtest import build_tiny_models
    build_tiny_models("omni", "alm")
    port = free_port()
    with module_daemon(short_tmpdir(), STAGES, PIPELINES,
                       {"cancel_grace_s": 60.0, "heartbeat_timeout_s": 60.0, "listen": [f"127.0.0.1:{port}"],
                        "max_realtime_sessions": 6, "max_realtime_sessions_per_key": 3,
                        "realtime_idle_timeout_s": IDLE_S}) as rd:
        rd.base = f"http://127.0.0.1:{port}"          # type: ignore[attr-defined]
        yield rd


@pytest.fixture(scope="module")
def key(daemon: RunningDaemon) -> str:
    from test_tcp import add_key
    return add_key(daemon, "talker", "--uid", str(KEY_UID))


class Conn:
    """A raw realtime WebSocket (aiohttp), every event received checked against the schema."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send_str(json.dumps({"type": kind, **fields}))

    async def recv(self, timeout: float = 120) -> dict[str, Any] | None:
        msg = await self.ws.receive(timeout=timeout)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return None
        ev = check_event(json.loads(msg.data))
        self.events.append(ev)
        return ev

    async def until(self, kind: str, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.recv(max(0.1, deadline - time.monotonic()))
            assert ev is not None, f"the socket closed before {kind} ({self.ws.close_code}): {self.types()}"
            if ev["type"] == kind:
                return ev
            assert ev["type"] != "response.done", f"the response ended before {kind}: {ev}"

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


async def _open(d: RunningDaemon, model: str, key: str | None = None, tcp: bool = False) -> tuple[Any, Any]:
    """A session over the socket (the caller's uid), or over TCP with `key`; (http session, ws)."""
    if tcp:
        http = aiohttp.ClientSession()
        url = f"{d.base}/v1/realtime?model={model}"          # type: ignore[attr-defined]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
    else:
        http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(d.socket)))
        url, headers = f"http://omnid/v1/realtime?model={model}", {}
    try:
        ws = await http.ws_connect(url, headers=headers, max_msg_size=0, autoping=True)
    except BaseException:
        await http.close()
        raise
    return http, ws


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 400))


def pcm_rms(pcm: bytes) -> float:
    n = len(pcm) // 2
    samples = struct.unpack(f"<{n}h", pcm[:2 * n])
    return math.sqrt(sum(s * s for s in samples) / max(1, n)) / 32767


def _busy(d: RunningDaemon, stage: str) -> int:
    return int(d.stages()[stage].get("tracked_jobs", 0))


# ------------------------------------------------------------------ the official client


def test_the_openai_realtime_client_holds_a_two_turn_conversation(daemon: RunningDaemon, key: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{daemon.base}/v1", api_key=key, max_retries=0)   # type: ignore[attr-defined]

    async def turn(conn: Any, text: str) -> dict[str, Any]:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": text}]})
        await conn.response.create()
        transcript, pcm, kinds = [], b"", []
        while True:
            raw = json.loads(await conn.recv_bytes())
            check_event(raw)
            event = conn.parse_event(json.dumps(raw))          # the client's own model of it
            kinds.append(event.type)
            if event.type == "response.output_audio_transcript.delta":
                transcript.append(event.delta)
            elif event.type == "response.output_audio.delta":
                pcm += base64.b64decode(event.delta)
            elif event.type == "error":
                raise AssertionError(f"error event: {raw}")
            elif event.type == "response.done":
                return {"transcript": "".join(transcript), "pcm": pcm, "kinds": kinds, "done": raw["response"]}

    async def talk() -> list[dict[str, Any]]:
        async with client.realtime.connect(model="omni") as conn:
            created = json.loads(await conn.recv_bytes())
            check_event(created)
            assert created["type"] == "session.created" and created["session"]["model"] == "omni"
            assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": RATE}
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "instructions": "You answer briefly.",
                                               "audio": {"output": {"voice": "Chelsie"}}})
            updated = json.loads(await conn.recv_bytes())
            check_event(updated)
            assert updated["type"] == "session.updated", updated
            assert updated["session"]["audio"]["output"]["voice"] == "Chelsie"
            first = await turn(conn, "Tell me about the sea.")
            second = await turn(conn, "And the mountains?")
            return [first, second]

    try:
        turns = asyncio.run(asyncio.wait_for(talk(), 400))
    finally:
        asyncio.run(client.close())
    for t in turns:
        done = t["done"]
        # the thinker ignores its end token: max_tokens ends each answer, which OpenAI calls incomplete
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens", done
        assert t["kinds"][0] in ("conversation.item.added", "conversation.item.done"), t["kinds"]
        assert "response.created" in t["kinds"] and t["kinds"].index("response.created") < \
            t["kinds"].index("response.output_audio.delta")
        assert t["kinds"].count("response.output_audio.delta") >= 2, t["kinds"]       # speech as it is made
        assert len(t["transcript"].split()) >= 5, t["transcript"]
        assert len(t["pcm"]) >= RATE * 2 * 0.5 and len(t["pcm"]) % 2 == 0
        assert 0.02 < pcm_rms(t["pcm"]) < 0.9                                          # audible
        assert done["output"][0]["content"][0] == {"type": "output_audio", "transcript": t["transcript"]}
        assert done["usage"]["output_tokens"] == 12 and done["usage"]["input_tokens"] > 0
        job = daemon.client.job(done["metadata"]["omnid_job"])
        assert job["state"] == "succeeded" and job["owner_uid"] == KEY_UID and job["pipeline"] == "omni"
    # The second response's prompt is the conversation: instructions, both user turns, the first answer.
    messages = json.loads(daemon.client.job(turns[1]["done"]["metadata"]["omnid_job"])["inputs"]["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"], messages
    assert messages[2]["content"] == turns[0]["transcript"]
    assert turns[1]["done"]["usage"]["input_tokens"] > turns[0]["done"]["usage"]["input_tokens"]


# ------------------------------------------------------------------ barge-in and cancel


def test_barge_in_and_response_cancel_stop_all_three_stages(daemon: RunningDaemon) -> None:
    async def go() -> dict[str, Any]:
        http, ws = await _open(daemon, "omni")
        c = Conn(ws)
        try:
            await c.until("session.created")
            await c.send("conversation.item.create", item={"type": "message", "role": "user",
                                                           "content": [{"type": "input_text", "text": "a long story"}]})
            await c.send("response.create", response={"max_output_tokens": 200})
            created = await c.until("response.created")
            await c.until("response.output_audio.delta")
            # barge-in: the user speaks again while the answer plays
            await c.send("conversation.item.create", item={"type": "message", "role": "user",
                                                           "content": [{"type": "input_text", "text": "stop"}]})
            done = await c.until("response.done")
            after_done = len(c.events)
            # the client played half of the interrupted answer's speech: the history keeps what was heard
            item = done["response"]["output"][0]
            played = sum(len(base64.b64decode(e["delta"])) for e in c.events
                         if e["type"] == "response.output_audio.delta" and e["item_id"] == item["id"])
            half_ms = played * 1000 // (2 * RATE) // 2
            await c.send("conversation.item.truncate", item_id=item["id"], content_index=0, audio_end_ms=half_ms)
            truncated = await c.until("conversation.item.truncated")
            # a second response, cancelled by the client
            await c.send("response.create", response={"max_output_tokens": 200})
            second = await c.until("response.created")
            await c.until("response.output_audio.delta")
            t0 = time.monotonic()
            await c.send("response.cancel")
            last_delta = t0
            while True:
                ev = await c.recv()
                assert ev is not None
                if ev["type"].endswith(".delta"):
                    last_delta = time.monotonic()
                if ev["type"] == "response.done":
                    break
            cancelled = ev
            # nothing more of either: no delta after its response.done
            await c.send("response.cancel")
            refused = await c.until("error")
            return {"first": created["response"], "done": done["response"], "after_done": after_done,
                    "truncated": truncated, "half_ms": half_ms,
                    "second": second["response"], "cancelled": cancelled["response"], "events": c.events,
                    "cancel_to_last_delta_s": last_delta - t0, "refused": refused}
        finally:
            await ws.close()
            await http.close()

    r = run(go())
    assert r["done"]["id"] == r["first"]["id"] and r["done"]["status"] == "cancelled", r["done"]
    assert r["done"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert r["cancelled"]["status"] == "cancelled" and r["cancelled"]["status_details"]["reason"] == "client_cancelled"
    assert r["cancel_to_last_delta_s"] < 5
    assert r["refused"]["error"]["code"] == "response_cancel_not_active"
    assert r["truncated"]["audio_end_ms"] == r["half_ms"] > 0
    spoken = r["done"]["output"][0]["content"][0]["transcript"]
    messages = json.loads(daemon.client.job(r["second"]["metadata"]["omnid_job"])["inputs"]["messages"])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"], messages
    heard = messages[1]["content"]
    assert spoken.startswith(heard) and abs(len(heard.split(" ")) - len(spoken.split(" ")) / 2) <= 1, (heard, spoken)
    for resp in (r["first"], r["second"]):
        deltas_after = [e for e in r["events"][r["events"].index(next(
            e for e in r["events"] if e["type"] == "response.done" and e["response"]["id"] == resp["id"])):]
            if e["type"].endswith(".delta") and e.get("response_id") == resp["id"]]
        assert not deltas_after, deltas_after
        job = resp["metadata"]["omnid_job"]
        assert wait_for(lambda: daemon.client.job(job)["state"] in ("cancelled",), 30, "the job cancelled")
    # every stage let the jobs go (the thinker had 200 tokens to write)
    for stage in ("thinker", "talker", "code2wav"):
        wait_for(lambda: _busy(daemon, stage) == 0, 60, f"{stage} to let the cancelled jobs go")
    # the barged-in answer is kept as far as it went, the new user turn after it
    items = [e["item"] for e in r["events"] if e["type"] == "conversation.item.done"]
    assert [i["role"] for i in items][:3] == ["user", "assistant", "user"], items
    assert items[1]["status"] == "incomplete"


# ------------------------------------------------------------------ audio in


def _tone(seconds: float, freq: float) -> bytes:
    n = int(RATE * seconds)
    return struct.pack(f"<{n}h", *(int(12000 * math.sin(2 * math.pi * freq * i / RATE)) for i in range(n)))


@pytest.mark.parametrize("turns", ["manual", "server_vad"])
def test_audio_in_on_an_audio_language_pipeline(daemon: RunningDaemon, turns: str) -> None:
    """The client's audio, as a turn: committed by the client (`turn_detection: null`), or by server
    VAD (the session's default on a pipeline that takes audio) at the end of real speech."""
    speech = pytest.importorskip("speech")
    if turns == "server_vad":
        pytest.importorskip("onnxruntime")

    async def go() -> dict[str, Any]:
        http, ws = await _open(daemon, "alm")
        c = Conn(ws)
        try:
            created = await c.until("session.created")
            assert created["session"]["output_modalities"] == ["text"]
            assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
            if turns == "server_vad":
                for chunk in speech.chunks(speech.pcm24k("turn2")):
                    await c.send("input_audio_buffer.append", audio=base64.b64encode(chunk).decode())
                started = await c.until("input_audio_buffer.speech_started")
                stopped = await c.until("input_audio_buffer.speech_stopped")
                committed = await c.until("input_audio_buffer.committed")
                item = (await c.until("conversation.item.done"))["item"]
                done = await c.until("response.done")
                return {"committed": committed, "item": item, "done": done["response"],
                        "seconds": (stopped["audio_end_ms"] - max(0, started["audio_start_ms"] - 300)) / 1000,
                        "text": "".join(e["delta"] for e in c.events if e["type"] == "response.output_text.delta")}
            await c.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            assert (await c.until("session.updated"))["session"]["audio"]["input"]["turn_detection"] is None
            await c.send("input_audio_buffer.commit")
            empty = await c.until("error")
            pcm = _tone(1.0, 440.0)
            for at in range(0, len(pcm), 9600):            # 0.2 s chunks, as a microphone sends them
                await c.send("input_audio_buffer.append", audio=base64.b64encode(pcm[at:at + 9600]).decode())
            await c.send("input_audio_buffer.commit")
            committed = await c.until("input_audio_buffer.committed")
            item = (await c.until("conversation.item.done"))["item"]
            await c.send("response.create")
            done = await c.until("response.done")
            return {"empty": empty, "committed": committed, "item": item, "done": done["response"], "seconds": 1.0,
                    "text": "".join(e["delta"] for e in c.events if e["type"] == "response.output_text.delta")}
        finally:
            await ws.close()
            await http.close()

    r = run(go())
    assert turns == "server_vad" or r["empty"]["error"]["code"] == "input_audio_buffer_commit_empty"
    assert r["item"]["id"] == r["committed"]["item_id"] and r["item"]["content"] == [{"type": "input_audio"}]
    cut = r["done"]["usage"]["output_tokens"] == STAGES["listen"]["defaults"]["max_tokens"]     # (or its end token)
    assert r["done"]["status"] == ("incomplete" if cut else "completed"), r["done"]
    assert r["text"] and r["done"]["output"][0]["content"][0] == {"type": "output_text", "text": r["text"]}
    job = daemon.client.job(r["done"]["metadata"]["omnid_job"])
    assert job["state"] == "succeeded"
    (clip,) = job["inputs"]["audio"]                        # the committed audio went in, as a WAV
    assert abs(clip["seconds"] - r["seconds"]) < 0.05 and clip["rate"] == RATE, (clip, r["seconds"])
    assert r["done"]["usage"]["input_tokens"] >= 25          # one second of audio is 25 tokens


def test_a_response_with_no_user_turn_answers_from_the_instructions(daemon: RunningDaemon) -> None:
    """The agent greets first: `response.create` before any user turn, as OpenAI takes it; with no
    instructions either, it still speaks first (from an empty system message)."""
    async def greet(instructions: str | None) -> dict[str, Any]:
        http, ws = await _open(daemon, "omni")
        c = Conn(ws)
        try:
            await c.until("session.created")
            if instructions is not None:
                await c.send("session.update", session={"type": "realtime", "instructions": instructions})
                await c.until("session.updated")
            await c.send("response.create")
            return (await c.until("response.done"))["response"]
        finally:
            await ws.close()
            await http.close()

    for instructions, system in (("Greet the caller.", "Greet the caller."), (None, "")):
        done = run(greet(instructions))
        assert (done["status"] == "completed" or done["status_details"]["reason"] == "max_output_tokens") \
            and done["output"][0]["content"][0]["transcript"], done
        job = daemon.client.job(done["metadata"]["omnid_job"])
        assert json.loads(job["inputs"]["messages"]) == [{"role": "system", "content": system}]


# ------------------------------------------------------------------ refusals


def test_bad_events_unknown_model_wrong_key_and_too_many_sessions_get_error_events(daemon: RunningDaemon,
                                                                                   key: str) -> None:
    async def error_and_close(model: str, key_: str | None, tcp: bool) -> tuple[dict[str, Any], int | None, str]:
        http, ws = await _open(daemon, model, key_, tcp)
        try:
            c = Conn(ws)
            ev = await c.recv(30)
            assert ev is not None and ev["type"] == "error", c.events
            end = await ws.receive(timeout=30)
            assert end.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), end
            return ev, ws.close_code, str(end.extra or "")
        finally:
            await http.close()

    async def bad_events() -> list[dict[str, Any]]:
        http, ws = await _open(daemon, "omni")
        c = Conn(ws)
        out = []
        try:
            await c.until("session.created")
            for raw in ["not json", json.dumps([1]), json.dumps({"type": "no.such.event", "event_id": "e1"}),
                        json.dumps({"type": "session.update", "session": {"output_modalities": ["video"]}}),
                        json.dumps({"type": "session.update", "session": {"audio": {"output": {
                            "format": {"type": "audio/pcmu"}}}}}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}),
                        json.dumps({"type": "session.update", "session": {"audio": {"input": {
                            "turn_detection": {"type": "server_vad", "threshold": 7}}}}}),
                        json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0,
                                    "audio_end_ms": 5})]:
                await ws.send_str(raw)
                out.append(await c.until("error"))
            # the session is still usable after all of them
            await c.send("session.update", session={"type": "realtime", "output_modalities": ["text"]})
            assert (await c.until("session.updated"))["session"]["output_modalities"] == ["text"]
        finally:
            await ws.close()
            await http.close()
        return out

    async def too_many() -> tuple[dict[str, Any], int | None, str]:
        held = [await _open(daemon, "omni", key, tcp=True) for _ in range(3)]      # the key's limit
        try:
            for _, ws in held:
                assert check_event(json.loads((await ws.receive(timeout=30)).data))["type"] == "session.created"
            return await error_and_close("omni", key, True)
        finally:
            for http, ws in held:
                await ws.close()
                await http.close()

    errors = run(bad_events())
    codes = [e["error"]["code"] for e in errors]
    assert codes == ["invalid_json", "invalid_event", "invalid_event_type", "invalid_value", "invalid_value",
                     "audio_not_accepted", "invalid_value", "item_not_found"], codes
    assert errors[6]["error"]["param"] == "session.audio.input.turn_detection.threshold"
    assert errors[2]["error"]["event_id"] == "e1" and errors[2]["error"]["param"] == "type"
    assert errors[3]["error"]["param"] == "session.output_modalities"

    unknown, code, why = run(error_and_close("nope", None, False))
    assert unknown["error"]["code"] == "model_not_found" and code == 1008 and "nope" in why
    for bad in (None, key + "x"):
        wrong, code, why = run(error_and_close("omni", bad, True))
        assert wrong["error"]["code"] == "invalid_api_key" and code == 1008 and why, (wrong, code, why)
    many, code, why = run(too_many())
    assert many["error"]["code"] == "too_many_sessions" and code == 1013 and "max_realtime_sessions" in why


def test_the_daemon_wide_session_limit_holds_across_owners(daemon: RunningDaemon, key: str) -> None:
    """`max_realtime_sessions` (6 here) counts every owner's sessions: with 3 of a key's and 3 of a
    uid's open, a session of another key (which holds none) is refused, and named the daemon's."""
    from test_tcp import add_key
    other = add_key(daemon, "listener", "--uid", str(KEY_UID + 1))

    async def go() -> tuple[dict[str, Any], int | None, str]:
        held = [await _open(daemon, "omni", key, tcp=True) for _ in range(3)]
        held += [await _open(daemon, "omni") for _ in range(3)]
        try:
            for _, ws in held:
                assert check_event(json.loads((await ws.receive(timeout=30)).data))["type"] == "session.created"
            http, ws = await _open(daemon, "omni", other, tcp=True)
            try:
                ev = check_event(json.loads((await ws.receive(timeout=30)).data))
                assert ev["type"] == "error", f"a 7th session was opened: {ev}"
                end = await ws.receive(timeout=30)
                assert end.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), end
                return ev, ws.close_code, str(end.extra or "")
            finally:
                await http.close()
        finally:
            for http, ws in held:
                await ws.close()
                await http.close()

    ev, code, why = run(go())
    assert ev["type"] == "error" and ev["error"]["code"] == "too_many_sessions" and code == 1013, (ev, code)
    assert "the daemon holds 6 realtime sessions" in ev["error"]["message"] and \
        "(daemon.max_realtime_sessions)" in why, (ev, why)


# ------------------------------------------------------------------ a dropped socket


def test_a_socket_dropped_mid_answer_cancels_its_job(daemon: RunningDaemon) -> None:
    async def go() -> str:
        http, ws = await _open(daemon, "omni")
        c = Conn(ws)
        try:
            await c.until("session.created")
            await c.send("conversation.item.create", item={"type": "message", "role": "user",
                                                           "content": [{"type": "input_text", "text": "go on"}]})
            await c.send("response.create", response={"max_output_tokens": 200})
            created = await c.until("response.created")
            await c.until("response.output_audio.delta")
            ws._conn.transport.abort()          # gone: no close frame, a reset
            return str(created["response"]["metadata"]["omnid_job"])
        finally:
            await http.close()

    job = run(go())
    wait_for(lambda: daemon.client.job(job)["state"] == "cancelled", 30, "the dropped session's job cancelled")
    for stage in ("thinker", "talker", "code2wav"):
        wait_for(lambda: _busy(daemon, stage) == 0, 60, f"{stage} to let the job go")


def test_an_idle_session_is_closed_with_an_error_event_and_a_reason(daemon: RunningDaemon) -> None:
    async def go() -> tuple[dict[str, Any], float, int | None, str]:
        http, ws = await _open(daemon, "omni")
        c = Conn(ws)
        try:
            await c.until("session.created")
            t0 = time.monotonic()
            ev = await c.recv(IDLE_S * 4)
            assert ev is not None, c.events
            end = await ws.receive(timeout=30)
            return ev, time.monotonic() - t0, ws.close_code, str(end.extra or "")
        finally:
            await http.close()

    ev, waited, code, why = run(go())
    assert ev["type"] == "error" and ev["error"]["code"] == "idle_timeout", ev
    assert IDLE_S * 0.9 < waited < IDLE_S * 3 and code == 1000 and "idle" in why, (waited, code, why)


# ------------------------------------------------------------------ omnictl talk


def test_omnictl_talk_writes_the_answers_and_ctrl_c_interrupts_one(daemon: RunningDaemon, tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT, wait_started

    before = {j["id"] for j in daemon.client.jobs(pipeline="omni", limit=100)["jobs"]}
    out = tmp_path / "talk"
    proc = subprocess.Popen([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "talk", "omni",
                             "-o", str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("hello there\n")
        proc.stdin.flush()
        first = proc.stdout.readline()                          # the transcript, then its end
        assert len(first.split()) >= 5, first
        wav = out / "answer-001.wav"
        wait_for(wav.exists, 30, "the first answer's WAV file")
        proc.stdin.write("tell me a long story\n")
        proc.stdin.flush()
        job = wait_for(lambda: next((j["id"] for j in daemon.client.jobs(pipeline="omni", limit=100)["jobs"]
                                     if j["id"] not in before and j["state"] in ("queued", "running")), None),
                       60, "the second answer's job")
        wait_started(daemon, job, "code2wav", timeout=120)
        proc.send_signal(signal.SIGINT)                          # Ctrl-C mid-answer: a barge-in
        second = proc.stdout.readline()
        assert second.rstrip().endswith("[interrupted]"), second
        wait_for(lambda: daemon.client.job(job)["state"] == "cancelled", 30, "the interrupted answer's job cancelled")
        proc.stdin.close()                                       # Ctrl-D: the end
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    import wave
    with wave.open(str(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2) and w.getnframes() > RATE // 2


def test_every_event_type_seen_was_validated() -> None:
    """(The schema checks ran: the events the tests above received include each kind they rely on.)"""
    if not CHECKED:
        pytest.skip("no realtime test ran before this one")
    for kind in ("session.created", "session.updated", "response.created", "response.output_audio.delta",
                 "response.output_audio_transcript.delta", "response.done", "error"):
        assert kind in CHECKED, kind


