"""Voice agents on omnid: a realtime session on a pipeline that hears and speaks (the demo's `voice`:
the tiny Qwen2-Audio listens, the tiny codec LM speaks, code2wav sounds), turns taken by voice.

Real everything: a daemon (tests/voicetest.py), the WebSocket (aiohttp over the Unix socket; the
official `openai` package's realtime client over TCP with a key), the engines, and real speech
(tests/fixtures/speech, espeak-ng recordings with pauses and an interruption, streamed in 40 ms
chunks as a microphone sends them). Server VAD is the session's default: the test sends audio and
nothing else, and the session says speech_started / speech_stopped / committed and answers;
speech during an answer cancels it in every stage (barge-in by voice). `turn_detection: null`
keeps manual turns. Every server event is checked against OpenAI's published schema.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import RunningDaemon, wait_for

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("jsonschema")
pytest.importorskip("websockets")
pytest.importorskip("onnxruntime")
speech = pytest.importorskip("speech")

from test_realtime import Conn, check_event  # noqa: E402  (the schema checks: one copy)
from voicetest import KEY_UID, VOICE_STAGES, tracked, voice_daemon  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.vllm]


@pytest.fixture(scope="module")
def voice() -> Iterator[tuple[RunningDaemon, str, str]]:
    yield from voice_daemon()


async def _open(d: RunningDaemon) -> tuple[Any, Any]:
    http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(d.socket)))
    try:
        ws = await http.ws_connect("http://omnid/v1/realtime?model=voice", max_msg_size=0, autoping=True)
    except BaseException:
        await http.close()
        raise
    return http, ws


async def say(c: Conn, pcm: bytes) -> None:
    """Speech into the session, as a microphone sends it (40 ms chunks)."""
    for chunk in speech.chunks(pcm):
        await c.send("input_audio_buffer.append", audio=base64.b64encode(chunk).decode())


def since(events: list[dict[str, Any]], at: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in events[at:] if e["type"] == kind]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 500))


def test_two_spoken_turns_and_a_barge_in_by_voice(voice: tuple[RunningDaemon, str, str]) -> None:
    d = voice[0]

    async def go() -> dict[str, Any]:
        http, ws = await _open(d)
        c = Conn(ws)
        try:
            created = await c.until("session.created")
            turns = []
            for name in ("turn1", "turn2"):                    # two turns, spoken and nothing else
                at = len(c.events)
                await say(c, speech.silence(300) + speech.pcm24k(name))
                done = await c.until("response.done", timeout=300)
                turns.append({"events": c.events[at:], "done": done["response"]})
            # a third answer, interrupted by voice while it speaks
            at = len(c.events)
            await say(c, speech.silence(300) + speech.pcm24k("turn1"))
            third = (await c.until("response.created", timeout=300))["response"]
            await c.until("response.output_audio.delta", timeout=300)
            interrupt_at = len(c.events)
            await say(c, speech.pcm24k("barge_in"))
            started = await c.until("input_audio_buffer.speech_started")
            t_started = time.monotonic()
            cancelled = await c.until("response.done")
            t_done = time.monotonic()
            fourth = await c.until("response.done", timeout=300)
            return {"created": created["session"], "turns": turns, "third": third, "cancelled": cancelled["response"],
                    "started": started, "fourth": fourth["response"], "events": c.events, "at": at,
                    "interrupt_at": interrupt_at, "done_after_started_s": t_done - t_started}
        finally:
            await ws.close()
            await http.close()

    r = run(go())
    td = r["created"]["audio"]["input"]["turn_detection"]
    assert td == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                  "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}, td
    heard_ms = 0
    for n, (name, t) in enumerate(zip(("turn1", "turn2"), r["turns"])):
        kinds = [e["type"] for e in t["events"]]
        order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created", "response.output_audio.delta", "response.done"]
        assert [k for k in kinds if k in order and kinds.index(k) == kinds.index(k)] and \
            [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
        assert kinds.count("input_audio_buffer.speech_started") == 1, kinds     # its 250 ms pause kept it one turn
        started = next(e for e in t["events"] if e["type"] == "input_audio_buffer.speech_started")
        stopped = next(e for e in t["events"] if e["type"] == "input_audio_buffer.speech_stopped")
        committed = next(e for e in t["events"] if e["type"] == "input_audio_buffer.committed")
        assert started["item_id"] == stopped["item_id"] == committed["item_id"]
        # on the session's input timeline: the speech begins after the 300 ms of silence sent first
        assert abs(started["audio_start_ms"] - (heard_ms + 300)) <= 150, (started, heard_ms)
        assert stopped["audio_end_ms"] - started["audio_start_ms"] > 1000, (started, stopped)
        heard_ms += 300 + speech.ms(speech.pcm24k(name))
        done = t["done"]
        assert answered(done), done
        job = d.client.job(done["metadata"]["omnid_job"])
        assert job["state"] == "succeeded" and job["pipeline"] == "voice"
        (clip,) = job["inputs"]["audio"]             # the committed turn: from 300 ms before the speech to its end
        spoken = (stopped["audio_end_ms"] - started["audio_start_ms"] + 300) / 1000
        assert abs(clip["seconds"] - spoken) < 0.1, (clip, spoken)
        pcm = b"".join(base64.b64decode(e["delta"]) for e in t["events"] if e["type"] == "response.output_audio.delta")
        assert len(pcm) > 24000, len(pcm)               # it spoke (at least half a second at 24 kHz)
        if n == 1:
            messages = json.loads(job["inputs"]["messages"])
            assert [m["role"] for m in messages][-2:] == ["assistant", "user"], messages
    # barge-in by voice: the third answer is cancelled at the speech's start, nothing of it after
    ev = r["events"]
    assert r["cancelled"]["id"] == r["third"]["id"] and r["cancelled"]["status"] == "cancelled", r["cancelled"]
    assert r["cancelled"]["status_details"]["reason"] == "turn_detected"
    i_started = ev.index(r["started"])
    late = [e for e in ev[i_started:] if e["type"].startswith("response.output_audio")
            and e["type"].endswith(".delta") and e.get("response_id") == r["third"]["id"]]
    assert not late, late
    assert r["done_after_started_s"] < 1.0, r["done_after_started_s"]
    # the interrupted item keeps what was sent: its transcript is the text deltas sent, marked incomplete
    item = r["cancelled"]["output"][0]
    sent = "".join(e["delta"] for e in ev[r["at"]:] if e["type"] == "response.output_audio_transcript.delta"
                   and e["response_id"] == r["third"]["id"])
    assert item["status"] == "incomplete" and item["content"][0]["transcript"] == sent
    # the interruption is the next turn, answered
    assert answered(r["fourth"]), r["fourth"]
    job3 = r["third"]["metadata"]["omnid_job"]
    wait_for(lambda: d.client.job(job3)["state"] == "cancelled", 30, "the interrupted answer's job cancelled")
    for stage in VOICE_STAGES:                          # every stage let it go
        wait_for(lambda: tracked(d, stage) == 0, 60, f"{stage} to let the cancelled job go")


def test_turn_detection_null_keeps_manual_turns_and_bad_settings_get_error_events(
        voice: tuple[RunningDaemon, str, str]) -> None:
    d = voice[0]

    async def go() -> dict[str, Any]:
        http, ws = await _open(d)
        c = Conn(ws)
        try:
            await c.until("session.created")
            errors = []
            for td in ({"type": "server_vad", "threshold": 7}, {"type": "server_vad", "silence_duration_ms": -1}):
                await c.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": td}}})
                errors.append((await c.until("error"))["error"])
            await c.send("session.update", session={"type": "realtime", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 16000}}}})
            errors.append((await c.until("error"))["error"])
            await c.send("input_audio_buffer.append", audio="not base64!")
            errors.append((await c.until("error"))["error"])
            await c.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            updated = (await c.until("session.updated"))["session"]
            at = len(c.events)
            await say(c, speech.pcm24k("turn2"))
            await c.send("input_audio_buffer.commit")
            committed = await c.until("input_audio_buffer.committed")
            await c.send("response.create")
            done = await c.until("response.done", timeout=300)
            return {"errors": errors, "updated": updated, "committed": committed, "done": done["response"],
                    "kinds": [e["type"] for e in c.events[at:]]}
        finally:
            await ws.close()
            await http.close()

    r = run(go())
    assert [(e["code"], e["param"]) for e in r["errors"]] == [
        ("invalid_value", "session.audio.input.turn_detection.threshold"),
        ("invalid_value", "session.audio.input.turn_detection.silence_duration_ms"),
        ("invalid_value", "session.audio.input.format"), ("invalid_value", "audio")], r["errors"]
    assert r["updated"]["audio"]["input"]["turn_detection"] is None
    assert not [k for k in r["kinds"] if "speech_" in k], r["kinds"]        # no VAD: the client commits
    assert r["kinds"].index("input_audio_buffer.committed") < r["kinds"].index("response.created")
    assert answered(r["done"]), r["done"]
    (clip,) = d.client.job(r["done"]["metadata"]["omnid_job"])["inputs"]["audio"]
    assert abs(clip["seconds"] - speech.ms(speech.pcm24k("turn2")) / 1000) < 0.01       # all of it, as sent


def test_input_transcription_by_the_configured_pipeline(voice: tuple[RunningDaemon, str, str]) -> None:
    """`daemon.realtime_transcription` names `asr`: a client that asks for transcription gets each
    audio turn's transcript (delta, then completed, for the committed item), from a job of its own."""
    d = voice[0]

    async def go() -> dict[str, Any]:
        http, ws = await _open(d)
        c = Conn(ws)
        try:
            await c.until("session.created")
            await c.send("session.update", session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": "gpt-4o-mini-transcribe"}, "noise_reduction": {"type": "near_field"},
                "turn_detection": {"type": "server_vad", "create_response": False}}}})
            updated = (await c.until("session.updated"))["session"]
            await say(c, speech.silence(300) + speech.pcm24k("turn2"))
            committed = await c.until("input_audio_buffer.committed")
            completed = await c.until("conversation.item.input_audio_transcription.completed", timeout=300)
            return {"updated": updated, "committed": committed, "completed": completed,
                    "deltas": [e for e in c.events if e["type"] == "conversation.item.input_audio_transcription.delta"],
                    "kinds": [e["type"] for e in c.events]}
        finally:
            await ws.close()
            await http.close()

    r = run(go())
    audio_in = r["updated"]["audio"]["input"]
    assert audio_in["transcription"] == {"model": "gpt-4o-mini-transcribe"} and audio_in["noise_reduction"] is None
    assert r["completed"]["item_id"] == r["committed"]["item_id"] and r["completed"]["transcript"], r["completed"]
    assert r["deltas"] and all(e["item_id"] == r["committed"]["item_id"] for e in r["deltas"])
    assert "".join(e["delta"] for e in r["deltas"]).strip() == r["completed"]["transcript"]
    assert "response.created" not in r["kinds"]                   # create_response false: no answer
    jobs = d.client.jobs(pipeline="asr", limit=5)["jobs"]
    assert jobs and jobs[0]["state"] == "succeeded", jobs


def test_the_openai_client_on_its_defaults_talks_by_voice(voice: tuple[RunningDaemon, str, str]) -> None:
    """The official client, only its base URL and key changed: a greeting (response.create with no
    user turn), two spoken turns with server VAD, and a barge-in by voice."""
    d, base, key = voice
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

    async def talk() -> list[Any]:
        log: list[Any] = []

        async def until(conn: Any, kind: str) -> Any:
            while True:
                raw = json.loads(await asyncio.wait_for(conn.recv_bytes(), 300))
                check_event(raw)
                event = conn.parse_event(json.dumps(raw))
                log.append(event)
                assert event.type != "error", raw
                if event.type == kind:
                    return event

        async def speak(conn: Any, name: str) -> None:
            for chunk in speech.chunks(speech.silence(300) + speech.pcm24k(name)):
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())

        async with client.realtime.connect(model="voice") as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "instructions": "Greet the caller warmly."})
            await until(conn, "session.updated")
            await conn.response.create()                 # the agent speaks first
            greeting = await until(conn, "response.done")
            turns = [greeting]
            for name in ("turn1", "turn2"):
                await speak(conn, name)
                turns.append(await until(conn, "response.done"))
            await speak(conn, "turn1")
            await until(conn, "response.output_audio.delta")
            await speak(conn, "barge_in")
            await until(conn, "input_audio_buffer.speech_started")
            turns.append(await until(conn, "response.done"))
            turns.append(await until(conn, "response.done"))
        return turns

    try:
        turns = asyncio.run(asyncio.wait_for(talk(), 500))
    finally:
        asyncio.run(client.close())
    statuses = [t.response.status for t in turns]
    # a tiny random model never says its end: an answer its max_tokens cut is "incomplete"
    # (max_output_tokens), as OpenAI says one; the barge-in's is "cancelled"
    assert [s if s == "cancelled" else "answered" for s in statuses] == ["answered"] * 3 + ["cancelled", "answered"]
    assert all(s in ("completed", "incomplete") for s in statuses if s != "cancelled"), statuses
    assert all(t.response.status_details is None or t.response.status_details.reason == "max_output_tokens"
               for t in turns if t.response.status == "incomplete"), [t.response.status_details for t in turns]
    assert turns[3].response.status_details.reason == "turn_detected"
    greeting = d.client.job(turns[0].response.metadata["omnid_job"])
    assert greeting["owner_uid"] == KEY_UID and json.loads(greeting["inputs"]["messages"]) == [
        {"role": "system", "content": "Greet the caller warmly."}]


def answered(response: dict) -> bool:  # type: ignore[type-arg]
    """A response that answered: completed, or cut by its max tokens ("incomplete", max_output_tokens:
    a tiny random model never says its end), as OpenAI says one."""
    return response["status"] == "completed" or (response["status"] == "incomplete" and
                                                 (response.get("status_details") or {}).get("reason") == "max_output_tokens")
