"""A daemon that hears and speaks, for the voice-agent tests (tests/test_voice.py, and the agent
frameworks' tests in tests/agents/, each in a venv of its own layered on .venv: `make test-agents`):
the demo's `voice` pipeline on the tiny models (the tiny Qwen2-Audio listens and answers in text,
the tiny codec LM speaks it, code2wav makes it sound), on its socket and on a TCP port with a key;
`asr` (the same listener alone) transcribes the sessions' audio turns when a client asks.
Runs in the test process; the daemon is a real one (conftest's module_daemon)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir, tiny_llm

KEY_UID = 54341
STAGES: dict[str, Any] = {
    "listen": tiny_llm({"max_tokens": 8, "temperature": 0.0, "seed": 7}, model=MODELS / "alm",
                       media={"audio": 1, "max_audio_s": 10}),
    # speaks long enough (240 codes, ~10 s of speech) that a barge-in lands while it is being made
    "tts": tiny_llm({"max_tokens": 240, "temperature": 0.9, "seed": 7, "ignore_eos": True}, model=MODELS / "tts",
                    max_inflight=4),
    "tts_code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": str(MODELS / "omni"),
                     "max_inflight": 4, "defaults": {"num_steps": 2, "code_offset": 1000},
                     "env": {"OMP_NUM_THREADS": "1"}},
}
PIPELINES: dict[str, Any] = {
    "voice": {"stages": ["listen", "tts", "tts_code2wav"],
              "edges": [{"from": "listen", "to": "tts", "window": -1, "map": {"prompt": "text"}},
                        {"from": "tts", "to": "tts_code2wav", "window": [4, 8, 16, 25], "map": {"codes": "token_ids"}}],
              "outputs": {"listen": ["text"]}, "timeout_s": 240},
    "asr": {"stages": ["listen"]},          # input transcription (daemon.realtime_transcription)
}
VOICE_STAGES = ("listen", "tts", "tts_code2wav")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def voice_daemon() -> Iterator[tuple[RunningDaemon, str, str]]:
    """The daemon, its TCP base URL (http://127.0.0.1:PORT) and a key of uid KEY_UID (made with the
    real `omnictl key add`)."""
    from omnidtest import build_tiny_models
    from test_tcp import add_key
    build_tiny_models("omni", "alm", "tts")
    port = free_port()
    with module_daemon(short_tmpdir(), STAGES, PIPELINES,
                       {"cancel_grace_s": 60.0, "heartbeat_timeout_s": 60.0, "listen": [f"127.0.0.1:{port}"],
                        "realtime_idle_timeout_s": 120.0, "realtime_transcription": "asr"}) as rd:
        yield rd, f"http://127.0.0.1:{port}", add_key(rd, "agent", "--uid", str(KEY_UID))


def tracked(d: RunningDaemon, stage: str) -> int:
    """The jobs a stage's worker holds now."""
    return int(d.stages()[stage].get("tracked_jobs", 0))
