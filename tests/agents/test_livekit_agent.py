"""livekit-agents' OpenAI RealtimeModel (livekit-plugins-openai 1.8.9) against omnid, on its defaults:
only the base URL, the key and the model (omnid's pipeline) are changed. Its default session asks
for semantic_vad, gpt-4o-mini-transcribe input transcription and near-field noise reduction:
omnid takes the update (semantic_vad as server VAD with the eagerness's silence; transcription
by the pipeline the daemon names for it; noise reduction left off) and no `error` event ends the
session. `make test-agents` runs it in a venv of its own
(.venv-agents-livekit, layered on .venv); elsewhere it is skipped.

The model's realtime session is driven as an AgentSession drives it: audio frames pushed as a
microphone's, `generate_reply` for the greeting, each generation's message streams (text and
audio frames) read to the end. Two spoken turns, then a barge-in by voice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("livekit.agents")
pytest.importorskip("livekit.plugins.openai")
speech = pytest.importorskip("speech")

from conftest import RunningDaemon, wait_for  # noqa: E402
from voicetest import VOICE_STAGES, tracked, voice_daemon  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.vllm]


@pytest.fixture(scope="module")
def voice() -> Iterator[tuple[RunningDaemon, str, str]]:
    yield from voice_daemon()


def test_a_livekit_realtime_model_greets_takes_two_spoken_turns_and_is_interrupted_by_voice(
        voice: tuple[RunningDaemon, str, str]) -> None:
    from livekit import rtc
    from livekit.plugins.openai.realtime import RealtimeModel

    d, base, key = voice
    errors: list[Any] = []
    speech_started: list[float] = []
    answers: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []            # the session as omnid said it took effect
    transcripts: list[Any] = []

    async def read(ev: Any) -> None:
        """One generation, read as AgentSession reads it: each message's text and audio streams."""
        got: dict[str, Any] = {"text": "", "audio": 0}
        answers.append(got)
        async for msg in ev.message_stream:
            async def text() -> None:
                async for t in msg.text_stream:
                    got["text"] += str(t)

            async def audio() -> None:
                async for frame in msg.audio_stream:
                    got["audio"] += len(frame.data) * 2
            await asyncio.gather(text(), audio())
        got["done"] = True

    async def wait(cond: Any, what: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert not errors, errors
            assert time.monotonic() < end, f"waited {timeout} s for {what}"
            await asyncio.sleep(0.05)

    async def agent() -> None:
        model = RealtimeModel(base_url=f"{base}/v1", api_key=key, model="voice")
        session = model.session()
        tasks: list[asyncio.Task[None]] = []
        session.on("error", errors.append)
        session.on("input_speech_started", lambda _: speech_started.append(time.monotonic()))
        session.on("generation_created", lambda ev: tasks.append(asyncio.ensure_future(read(ev))))
        session.on("input_audio_transcription_completed", transcripts.append)
        session.on("openai_server_event_received",
                   lambda ev: sessions.append(ev["session"]) if ev.get("type") == "session.updated" else None)

        async def mic(name: str, paced: bool = True) -> None:
            """Speech as a microphone sends it (40 ms chunks at its pace; paced=False: at once, so that
            an interruption is heard while the answer is still being made)."""
            for chunk in speech.chunks(speech.silence(300) + speech.pcm24k(name)):
                session.push_audio(rtc.AudioFrame(chunk, 24000, 1, len(chunk) // 2))
                if paced:
                    await asyncio.sleep(speech.CHUNK_MS / 1000)

        try:
            await session.update_instructions("You are a friendly assistant. Greet the user.")
            await asyncio.wait_for(session.generate_reply(), 60)      # the agent speaks first
            await wait(lambda: len(answers) == 1 and answers[0].get("done"), "the greeting")
            for n, name in enumerate(("turn1", "turn2"), start=2):
                await mic(name)
                await wait(lambda: len(answers) == n and answers[-1].get("done"), f"the answer to {name}")
            await mic("turn1")
            await wait(lambda: len(answers) == 4 and answers[-1]["audio"] > 0, "the third answer's speech")
            heard = len(speech_started)
            await mic("barge_in", paced=False)
            await wait(lambda: len(speech_started) > heard and answers[3].get("done"), "the barge-in")
            await wait(lambda: len(answers) == 5 and answers[-1].get("done"), "the answer to the interruption")
        finally:
            await session.aclose()
            await model.aclose()
            for t in tasks:
                t.cancel()

    asyncio.run(asyncio.wait_for(agent(), 600))
    assert not errors, errors
    # livekit's default session: semantic_vad taken (its silence said), input transcription by the
    # daemon's `asr` pipeline, noise reduction left off
    audio_in = sessions[-1]["audio"]["input"]
    assert audio_in["turn_detection"]["type"] == "semantic_vad" and audio_in["turn_detection"]["silence_duration_ms"]
    assert audio_in["transcription"] is not None and audio_in["noise_reduction"] is None, audio_in
    assert len(transcripts) >= 3 and all(t.transcript for t in transcripts), transcripts     # each spoken turn
    assert all(a["audio"] > 24000 for a in answers[:3]), [a["audio"] for a in answers]
    assert all(a["text"] for a in answers[:3]), answers
    jobs = d.client.jobs(pipeline="voice", limit=20)["jobs"]
    states = sorted(j["state"] for j in jobs)
    assert states.count("cancelled") == 1 and states.count("succeeded") >= 4, states     # one cut by voice
    for stage in VOICE_STAGES:
        wait_for(lambda: tracked(d, stage) == 0, 60, f"{stage} to let the jobs go")
