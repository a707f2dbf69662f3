"""pipecat-ai's OpenAI Realtime service against omnid, in a real pipecat pipeline, on its defaults:
only the base URL, the key and the model (omnid's pipeline) are changed. `make test-agents` runs it
in a venv of its own (.venv-agents-pipecat, layered on .venv), so that pipecat's pins never fight
omnid's; elsewhere it is skipped.

The pipeline is pipecat's usual voice agent: user context aggregator -> OpenAIRealtimeLLMService ->
(what a transport's output would play) -> assistant context aggregator. The bot greets first (a
context holding only a system prompt, run at once); then two spoken turns (real speech, streamed
as a microphone sends it) with the service's default server VAD, and a barge-in by voice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pipecat")
speech = pytest.importorskip("speech")

from conftest import TERMINAL, RunningDaemon, wait_for  # noqa: E402
from voicetest import VOICE_STAGES, tracked, voice_daemon  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.vllm]


@pytest.fixture(scope="module")
def voice() -> Iterator[tuple[RunningDaemon, str, str]]:
    yield from voice_daemon()


def test_a_pipecat_voice_agent_greets_takes_two_spoken_turns_and_is_interrupted_by_voice(
        voice: tuple[RunningDaemon, str, str]) -> None:
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        InputAudioRawFrame,
        LLMFullResponseEndFrame,
        LLMRunFrame,
        TTSAudioRawFrame,
        UserStartedSpeakingFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    d, base, key = voice

    class Speaker(FrameProcessor):
        """Where a transport would play the bot's speech: counts it, and notes each turn's end."""

        def __init__(self) -> None:
            super().__init__()
            self.audio: list[int] = [0]                 # bytes of speech per response
            self.ends = 0
            self.user_started = 0
            self.heard: list[tuple[float, int]] = []    # (when, bytes) of each speech frame
            self.ended_at: list[float] = []             # when each response's end came
            self.errors: list[str] = []

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                self.audio[-1] += len(frame.audio)
                self.heard.append((time.time(), len(frame.audio)))
            elif isinstance(frame, LLMFullResponseEndFrame):
                self.ends += 1
                self.ended_at.append(time.time())
                self.audio.append(0)
            elif isinstance(frame, UserStartedSpeakingFrame):
                self.user_started += 1
            elif isinstance(frame, ErrorFrame):
                self.errors.append(str(frame.error))
            await self.push_frame(frame, direction)

    async def wait(cond: Any, what: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert not speaker.errors, speaker.errors
            assert time.monotonic() < end, (f"waited {timeout} s for {what}: speech per response "
                                            f"{speaker.audio}, ends {speaker.ends}")
            await asyncio.sleep(0.05)

    llm = OpenAIRealtimeLLMService(api_key=key, base_url=f"{base.replace('http', 'ws')}/v1/realtime",
                                   settings=OpenAIRealtimeLLMService.Settings(model="voice"))
    context = LLMContext([{"role": "system", "content": "You are a friendly assistant. Greet the user."}])
    pair = LLMContextAggregatorPair(context)
    speaker = Speaker()
    task = PipelineTask(Pipeline([pair.user(), llm, speaker, pair.assistant()]),
                        params=PipelineParams(audio_in_sample_rate=24000, audio_out_sample_rate=24000))

    async def mic(name: str, paced: bool = True) -> None:
        """Speech as a microphone sends it (40 ms chunks at its pace; paced=False: as fast as it goes,
        so that an interruption is heard at once, while the answer is still being made)."""
        for chunk in speech.chunks(speech.silence(300) + speech.pcm24k(name)):
            await task.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=24000, num_channels=1))
            if paced:
                await asyncio.sleep(speech.CHUNK_MS / 1000)

    def answered(after: float) -> bool:
        """Speech that came after `after` (more than 0.25 s of it), then a response's end."""
        ends = [t for t in speaker.ended_at if t > after]
        return bool(ends) and sum(n for t, n in speaker.heard if after < t < ends[-1]) > 24000

    def voice_jobs() -> list[dict[str, Any]]:
        return list(d.client.jobs(pipeline="voice", limit=20)["jobs"])

    def ended(n: int) -> bool:
        jobs = voice_jobs()
        return len(jobs) >= n and all(j["state"] in TERMINAL for j in jobs)

    async def agent() -> dict[str, Any]:
        runner = PipelineRunner(handle_sigint=False)
        running = asyncio.ensure_future(runner.run(task))
        try:
            await task.queue_frames([LLMRunFrame()])          # the bot greets first
            await wait(lambda: speaker.ends >= 1, "the greeting")
            for n, name in enumerate(("turn1", "turn2"), start=2):
                await mic(name)
                await wait(lambda: speaker.ends >= n, f"the answer to {name}")
            await mic("turn1")
            await wait(lambda: speaker.audio[-1] > 0, "the third answer's speech")
            heard = speaker.user_started
            await mic("barge_in", paced=False)                              # interrupts it
            await wait(lambda: speaker.user_started > heard, "the barge-in")
            # pipecat may end an interrupted response twice (its own interruption, then the cancelled
            # response.done), so its ends are not counted here: the daemon's fifth job has ended, and
            # the speech heard after that job began was followed by a response's end
            await wait(lambda: ended(5), "the answer to the interruption's job")
            last = max(j["created_at"] for j in voice_jobs())              # (the fifth job's: it has ended)
            await wait(lambda: answered(after=last), "the answer to the interruption")
        except BaseException:
            await task.cancel()
            await asyncio.wait({running}, timeout=60)     # (what failed is the error said, not this)
            raise
        await task.cancel()
        await asyncio.wait_for(running, 60)
        return {"audio": list(speaker.audio), "ends": speaker.ends, "errors": list(speaker.errors)}

    r = asyncio.run(asyncio.wait_for(agent(), 600))
    assert not r["errors"], r["errors"]
    assert all(n > 24000 for n in r["audio"][:3]), r["audio"]           # the greeting and two answers spoke
    states = sorted(j["state"] for j in voice_jobs())
    assert states.count("cancelled") == 1 and states.count("succeeded") >= 4, states   # one cut by voice
    # the assistant's turns went into pipecat's own context, as it keeps them
    roles = [m["role"] for m in context.get_messages()]
    assert roles.count("assistant") >= 3, roles
    for stage in VOICE_STAGES:
        wait_for(lambda: tracked(d, stage) == 0, 60, f"{stage} to let the jobs go")
