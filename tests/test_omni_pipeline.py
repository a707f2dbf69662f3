"""The omni speech pipelines in a real daemon, on the tiny Qwen2.5-Omni and the tiny codec LM.

`omni`: thinker (vLLM, the thinker's text model, giving its prompt ids, token ids and hidden
states) → talker (python, transformers' talker, incremental) → code2wav (python, transformers'
token2wav, block-streamed), as etc/omnid-demo.toml wires it; `tts`: codec LM (vLLM, token ids) →
code2wav. Real workers, real sockets, real kills: 8 concurrent jobs each with their own audio, the
talker starting while the thinker still writes, a cancel stopping all three stages, a kill -9 of
the talker failing its job alone.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    MODELS,
    TINY_LLM_ARGS,
    RunningDaemon,
    module_daemon,
    openai_on_socket,
    short_tmpdir,
    wait_for,
    wait_started,
)

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

TERMINAL = ("succeeded", "failed", "cancelled", "timed_out")


def _models() -> None:
    if not all((MODELS / m / ".omnid-tiny-ok").exists() for m in ("omni", "tts")):
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)


STAGES: dict[str, Any] = {
    "thinker": {"engine": "vllm", "model": str(MODELS / "omni" / "thinker"), "devices": [], "max_inflight": 8,
                "hidden_prompt": True, "args": {"max_model_len": 512, "dtype": "float32", "seed": 0, "enforce_eager": True},
                "defaults": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}},
    "talker": {"engine": "python", "sessions": "omnid.omni.stages:Talker", "model": str(MODELS / "omni"),
               "max_inflight": 8, "defaults": {"codes_per_token": 4}, "env": {"OMP_NUM_THREADS": "1"}},
    "code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": str(MODELS / "omni"),
                 "max_inflight": 8, "defaults": {"num_steps": 2}, "env": {"OMP_NUM_THREADS": "1"}},
    "tts": {"engine": "vllm", "model": str(MODELS / "tts"), "devices": [], "max_inflight": 4,
            "args": {"max_model_len": 512, **TINY_LLM_ARGS},
            "defaults": {"max_tokens": 60, "temperature": 0.9, "seed": 7, "ignore_eos": True}},
    "tts_code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": str(MODELS / "omni"),
                     "max_inflight": 4, "defaults": {"num_steps": 2, "code_offset": 1000},
                     "env": {"OMP_NUM_THREADS": "1"}},
}
PIPELINES: dict[str, Any] = {
    "omni": {"stages": ["thinker", "talker", "code2wav"],
             "edges": [{"from": "thinker", "to": "talker", "window": 1,
                        "map": {"prompt_ids": "prompt_token_ids", "ids": "token_ids", "states": "hidden_states"}},
                       {"from": "talker", "to": "code2wav", "window": [4, 8, 16, 25], "map": {"codes": "codes"}}],
             "outputs": {"thinker": ["text"]}, "timeout_s": 240},
    "tts": {"stages": ["tts", "tts_code2wav"],
            "edges": [{"from": "tts", "to": "tts_code2wav", "window": [4, 8, 16, 25], "map": {"codes": "token_ids"}}],
            "timeout_s": 240},
}


@pytest.fixture(scope="module")
def omni() -> Iterator[RunningDaemon]:
    _models()
    with module_daemon(short_tmpdir(), STAGES, PIPELINES, {"cancel_grace_s": 10.0, "heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def _pcm(d: RunningDaemon, job: str, name: str) -> Any:
    import numpy as np

    data, ctype = d.client.output(job, name)
    assert ctype == "audio/wav", ctype
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        frames = w.readframes(10 ** 8)
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767


def _audible(pcm: Any, min_s: float) -> None:
    import numpy as np

    assert len(pcm) >= 24000 * min_s, len(pcm) / 24000
    rms = float(np.sqrt((pcm ** 2).mean()))
    assert 0.02 < rms < 0.9, rms


def test_the_talker_and_code2wav_load_their_weights_before_they_say_ready(omni: RunningDaemon) -> None:
    """Ready means loaded: the omni python stages read their weights as they start (their
    functions' `load` hooks), not on the first job, which so speaks as early as the next."""
    stages = {s["name"]: s for s in omni.client.stages()["stages"]}
    for name, part, loaded in (("talker", "talker", "Talker()"), ("code2wav", "token2wav", "Code2Wav()")):
        assert stages[name]["info"]["loaded"] == [f"omnid.omni.stages:{loaded}"], stages[name]["info"]
        records = [json.loads(line.split(" ", 1)[1]) for line in omni.client.logs(name)
                   if '"omni part loaded"' in line]
        assert [r["part"] for r in records] == [part], records
        assert records[0]["load_s"] > 0


def test_eight_concurrent_omni_jobs_each_speak_their_own_answer(omni: RunningDaemon) -> None:
    prompts = ["the cat sat on the mat", "a small boat moved slowly", "good morning", "the night was dark",
               "music filled the hall", "she wrote a letter", "the baker wakes early", "birds sang in the trees"]
    jobs = [omni.submit("omni", {"prompt": p}) for p in prompts]
    docs = [omni.wait(j, timeout=240) for j in jobs]
    for doc in docs:
        assert doc["state"] == "succeeded", omni.diagnose(doc["id"])
        names = {o["name"] for o in doc["outputs"]}
        assert names == {"thinker.text", "code2wav.audio"}, doc["outputs"]
    texts = [omni.client.output(j, "thinker.text")[0].decode() for j in jobs]
    waves = [_pcm(omni, j, "code2wav.audio") for j in jobs]
    for pcm in waves:
        _audible(pcm, 12 * 4 * 480 / 24000 * 0.9)          # ~12 text tokens x 4 codes x 480 samples
    assert len(set(texts)) > 1
    # Different prompts, different audio: no job got another's.
    n = min(len(w) for w in waves)
    for i in range(len(waves)):
        for k in range(i + 1, len(waves)):
            if texts[i] != texts[k]:
                assert float(abs(waves[i][:n] - waves[k][:n]).mean()) > 1e-3, (i, k)


def test_the_talker_starts_before_the_thinker_ends_and_the_first_audio_comes_early(omni: RunningDaemon) -> None:
    job = omni.submit("omni", {"prompt": "the engineer wrote a short program"}, params={"thinker": {"max_tokens": 40}})
    events = omni.events(job, timeout=240)
    assert omni.client.job(job)["state"] == "succeeded", omni.diagnose(job)
    t = {(e["type"], e.get("stage")): e["ts"] for e in reversed(events)}      # the first of each
    assert t[("stage_started", "talker")] < t[("stage_finished", "thinker")]
    audio = [e for e in events if e["type"] == "segment" and e.get("stage") == "code2wav"]
    assert len(audio) >= 3, audio                        # the audio came in chunks, not at the end
    talker_end = next(e["ts"] for e in events if e["type"] == "stage_finished" and e.get("stage") == "talker")
    assert audio[0]["ts"] < talker_end                   # the first chunk before the talker was done


def test_tts_speaks_the_codec_lms_codes(omni: RunningDaemon) -> None:
    jobs = [omni.submit("tts", {"prompt": p}) for p in ("hello world", "good night")]
    waves = []
    for job in jobs:
        doc = omni.wait(job, timeout=240)
        assert doc["state"] == "succeeded", omni.diagnose(job)
        waves.append(_pcm(omni, job, "audio"))
    for pcm in waves:
        _audible(pcm, 60 * 480 / 24000 * 0.9)
    assert float(abs(waves[0] - waves[1]).mean()) > 1e-3


def _stage_busy(d: RunningDaemon, stage: str) -> int:
    return int(d.stages()[stage].get("tracked_jobs", 0))


def test_cancel_mid_stream_stops_all_three_stages(omni: RunningDaemon) -> None:
    job = omni.submit("omni", {"prompt": "a long answer please"}, params={"thinker": {"max_tokens": 200}})
    wait_started(omni, job, "code2wav", timeout=120)
    t0 = time.monotonic()
    omni.client.cancel(job)
    doc = omni.wait(job, timeout=30)
    assert doc["state"] == "cancelled", doc
    for stage in ("thinker", "talker", "code2wav"):
        wait_for(lambda: _stage_busy(omni, stage) == 0, 10, f"{stage} to let the cancelled job go")
    assert time.monotonic() - t0 < 10
    assert not [o for o in doc["outputs"] if o["name"] == "code2wav.audio"]
    nxt = omni.submit("omni", {"prompt": "hi"})
    assert omni.wait(nxt, timeout=240)["state"] == "succeeded", omni.diagnose(nxt)


def test_kill9_of_the_talker_fails_its_job_naming_it_and_the_next_job_succeeds(omni: RunningDaemon) -> None:
    """kill -9 of the talker mid-batch fails exactly the jobs it held (two, stepped together), naming
    it; a job on other stages goes on; the next job runs on the restarted talker."""
    jobs = [omni.submit("omni", {"prompt": p}, params={"thinker": {"max_tokens": 200}})
            for p in ("tell me a story", "and another one")]
    for job in jobs:
        wait_started(omni, job, "code2wav", timeout=120)
    other = omni.submit("tts", {"prompt": "meanwhile"})
    old = omni.stage_pid("talker")
    os.kill(old, signal.SIGKILL)
    for job in jobs:
        doc = omni.wait(job, timeout=60)
        assert doc["state"] == "failed", doc
        assert doc["error"]["stage"] == "talker" and "SIGKILL" in doc["error"]["message"], doc["error"]
    assert omni.wait(other, timeout=120)["state"] == "succeeded", omni.diagnose(other)
    snap = omni.wait_stage_state("talker", ("ready",), timeout=60)
    assert snap["pid"] != old
    nxt = omni.submit("omni", {"prompt": "hi again"})
    assert omni.wait(nxt, timeout=240)["state"] == "succeeded", omni.diagnose(nxt)


# ------------------------------------------------------------------ OpenAI's audio chat


@pytest.fixture(scope="module")
def client(omni: RunningDaemon) -> Iterator[Any]:
    with openai_on_socket(omni, 240) as c:
        yield c


def _wav_pcm(data: bytes) -> Any:
    import numpy as np

    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767


def test_openai_audio_chat_answers_text_and_speech(omni: RunningDaemon, client: Any) -> None:
    import base64

    messages = [{"role": "user", "content": "say something"}]
    r = client.chat.completions.create(model="omni", messages=messages, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"})
    msg = r.choices[0].message
    assert msg.content is None and msg.audio is not None
    assert msg.audio.id.startswith("audio_") and msg.audio.expires_at > r.created
    assert len(msg.audio.transcript.split()) >= 5                 # the thinker's text
    pcm = _wav_pcm(base64.b64decode(msg.audio.data))               # a whole WAV, its sizes set
    _audible(pcm, 0.9)                                              # 12 tokens x 4 codes x 480 samples
    raw = client.chat.completions.create(model="omni", messages=messages, modalities=["text", "audio"],
                                         audio={"voice": "Chelsie", "format": "pcm16"})
    pcm16 = base64.b64decode(raw.choices[0].message.audio.data)
    assert pcm16[:4] != b"RIFF" and len(pcm16) == 2 * len(pcm)      # the same speech, headerless
    # A text-only chat on the same pipeline answers text.
    text = client.chat.completions.create(model="omni", messages=messages)
    assert text.choices[0].message.content and text.choices[0].message.audio is None


def test_openai_audio_chat_streams_the_transcript_and_the_speech_as_they_come(client: Any) -> None:
    import base64

    stream = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "hello"}],
                                            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"},
                                            stream=True)
    kinds, transcript, pcm = [], [], b""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        audio = (delta.model_extra or {}).get("audio") or getattr(delta, "audio", None)
        if audio is not None and not isinstance(audio, dict):
            audio = audio.model_dump()
        if isinstance(audio, dict):
            if audio.get("transcript"):
                kinds.append("t")
                transcript.append(audio["transcript"])
            if audio.get("data"):
                kinds.append("a")
                pcm += base64.b64decode(audio["data"])
    assert kinds.count("a") >= 2, kinds                          # the speech in pieces, as it was made
    assert len(pcm) >= 24000 * 2 * 0.5 and len(pcm) % 2 == 0
    assert len("".join(transcript).split()) >= 5


def test_openai_audio_chat_refuses_what_it_cannot_do(client: Any) -> None:
    openai = pytest.importorskip("openai")
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, param in [({"modalities": ["text", "audio"]}, "audio"),
                          ({"modalities": ["text", "audio"], "audio": {"voice": "x", "format": "mp3"}}, "audio.format"),
                          ({"modalities": ["video"]}, "modalities")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="omni", messages=messages, **kwargs)
        assert err.value.body["param"] == param, err.value.body


def test_speech_streams_as_sse_and_as_raw_pcm(omni: RunningDaemon) -> None:
    import base64
    import json

    httpx = pytest.importorskip("httpx")
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(omni.socket)), timeout=240) as http:
        events = []
        with http.stream("POST", "http://omnid/v1/audio/speech",
                         json={"model": "tts", "input": "hello there", "voice": "x", "stream_format": "sse",
                               "response_format": "pcm"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done", [e["type"] for e in events]
        pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
        assert pcm[:4] != b"RIFF" and len(pcm) >= 2 * 24000 and len(pcm) % 2 == 0
        raw = http.post("http://omnid/v1/audio/speech", json={"model": "tts", "input": "hello there", "voice": "x",
                                                              "response_format": "pcm"})
        assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
        assert len(raw.content) == len(pcm)                # the same speech (the same seed), headerless
        bad = http.post("http://omnid/v1/audio/speech", json={"model": "tts", "input": "x", "voice": "x",
                                                              "response_format": "mp3"})
        assert bad.status_code == 400 and "wav, pcm" in bad.json()["error"]["message"], bad.text


def test_audio_is_measured_first_packet_real_time_factor_underruns(omni: RunningDaemon) -> None:
    job = omni.submit("omni", {"prompt": "count the seconds"})
    events = omni.events(job, timeout=240)
    assert omni.client.job(job)["state"] == "succeeded", omni.diagnose(job)
    heard = sum(e.get("audio_s", 0.0) for e in events if e["type"] == "segment" and e.get("stage") == "code2wav")
    assert abs(heard - len(_pcm(omni, job, "code2wav.audio")) / 24000) < 1e-3, heard   # each packet's length, exactly
    assert not [e for e in events if e.get("audio_s") and e.get("stage") != "code2wav"]    # only the audio's
    text = omni.client.metrics()
    for name in ("omnid_time_to_first_audio_seconds_count", "omnid_audio_real_time_factor_count"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + '{pipeline="omni"}'))
        assert float(line.split()[-1]) >= 1, line
    assert "omnid_audio_underruns_total" in text
