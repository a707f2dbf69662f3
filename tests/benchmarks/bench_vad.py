"""Server VAD on `/v1/realtime`: what turns taken by voice cost and how soon they are answered.

One daemon of its own: the voice pipeline as tests/voicetest.py wires it (the tiny Qwen2-Audio
listens, the tiny codec LM speaks, code2wav sounds). Speech is the committed fixtures
(tests/fixtures/speech), streamed in 40 ms chunks at the pace of a microphone.

- VAD's cost: 32 sessions stream speech and silence at once (server VAD on, `create_response`
  false: the model judges every frame, no job runs) for WINDOW_S. The supervisor's CPU time over
  that window, less an idle window's, per session, in % of one core; and `GET /v1/health` p50
  during it against the same daemon idle (ratio).
- End of speech -> first audio delta (server VAD, silence_duration_ms 500), against the manual turn:
  `input_audio_buffer.commit` + `response.create` -> first audio delta, same audio, same run.
  Goal: at most silence_duration_ms + 1.2x the manual time.
- Barge-in by voice: `speech_started` of the interruption -> the last audio delta of the answer it
  cut (0 when none follows), and whether all three stages let its job go.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bench_tensors
from _harness import BENCH_DAEMON, Ctx, Row, at_most, kill_daemon, p50

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import speech  # noqa: E402  (tests/speech.py)

SESSIONS = 32
WINDOW_S = 10.0
SILENCE_MS = 500
FIGURES = [f"server VAD: supervisor CPU per streaming session ({SESSIONS} at once)",
           f"server VAD: GET /v1/health p50, {SESSIONS} sessions streaming",
           "server VAD: end of speech -> 1st audio delta, p50",
           "server VAD: barge-in speech_started -> last audio delta of the cut answer"]


def _voice_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """The tests' voice pipeline; its codec LM speaks longer (400 codes, generated over several
    seconds here), so that the barge-in lands while the answer is still being made."""
    import voicetest
    stages = dict(voicetest.STAGES)
    stages["tts"] = {**stages["tts"], "defaults": {**stages["tts"]["defaults"], "max_tokens": 400}}
    return stages, {"voice": voicetest.PIPELINES["voice"]}


async def _events(ws: Any) -> Any:
    import aiohttp
    while True:
        msg = await ws.receive(timeout=300)
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the session closed: {ws.close_code}")
        ev = json.loads(msg.data)
        if ev["type"] == "error":
            raise RuntimeError(f"error event: {ev['error']}")
        yield ev


async def _until(ws: Any, kind: str) -> tuple[dict[str, Any], float]:
    async for ev in _events(ws):
        if ev["type"] == kind:
            return ev, time.monotonic()
    raise AssertionError("unreachable")


async def _paced(ws: Any, pcm: bytes, t0: float) -> None:
    """Speech at a microphone's pace from t0: chunk k goes at t0 + k * 40 ms."""
    for k, chunk in enumerate(speech.chunks(pcm)):
        wait = t0 + k * speech.CHUNK_MS / 1000 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))


async def _open(http: Any) -> Any:
    ws = await http.ws_connect("http://omnid/v1/realtime?model=voice", max_msg_size=0)
    await _until(ws, "session.created")
    return ws


async def _streamers(socket: str, n: int, seconds: float, stop: threading.Event) -> int:
    """n sessions, server VAD on and answering nothing, each streaming speech and silence in turn."""
    import aiohttp
    loop_pcm = speech.pcm24k("pauses") + speech.silence(500) + speech.pcm24k("turn1")
    turns = 0

    async def one(http: Any) -> int:
        ws = await _open(http)
        await ws.send_str(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False, "silence_duration_ms": SILENCE_MS}}}}}))
        await _until(ws, "session.updated")
        seen = 0

        async def count() -> None:
            nonlocal seen
            async for ev in _events(ws):
                seen += ev["type"] == "input_audio_buffer.committed"

        reader = asyncio.ensure_future(count())
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds and not stop.is_set():
                await _paced(ws, loop_pcm, time.monotonic())
        finally:
            reader.cancel()
            await ws.close()
        return seen

    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket, limit=0)) as http:
        for got in await asyncio.gather(*(one(http) for _ in range(n))):
            turns += got
    return turns


def _health_p50(socket: str, seconds: float) -> float:
    import httpx
    out = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=30) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            http.get("http://omnid/v1/health").raise_for_status()
            out.append(time.monotonic() - t)
            time.sleep(0.05)
    return p50(out)


def _cpu(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


async def _voice_turn(socket: str, manual: bool) -> float:
    """One spoken turn answered: end of speech -> 1st audio delta (server VAD), or commit +
    response.create -> 1st audio delta (manual, the same audio sent at once)."""
    import aiohttp
    pcm = speech.silence(300) + speech.pcm24k("turn2")
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as http:
        ws = await _open(http)
        try:
            if manual:
                await ws.send_str(json.dumps({"type": "session.update", "session": {
                    "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
                await _until(ws, "session.updated")
                await _paced(ws, pcm, time.monotonic() - 60)            # at once
                t0 = time.monotonic()
                await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
                await ws.send_str(json.dumps({"type": "response.create"}))
                _, first = await _until(ws, "response.output_audio.delta")
                await _until(ws, "response.done")
                return first - t0
            t0 = time.monotonic()
            sender = asyncio.ensure_future(_paced(ws, pcm, t0))
            stopped, _ = await _until(ws, "input_audio_buffer.speech_stopped")
            _, first = await _until(ws, "response.output_audio.delta")
            await _until(ws, "response.done")
            await sender
            return first - (t0 + stopped["audio_end_ms"] / 1000)      # the speech ended then, on the mic's clock
        finally:
            await ws.close()


async def _barge_in(socket: str) -> tuple[float | None, str]:
    """speech_started of an interruption -> the last audio delta of the answer it cut (None: the
    answer was made whole before the interruption was heard). The interruption is sent at once at
    the answer's first audio delta."""
    import aiohttp
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as http:
        ws = await _open(http)
        try:
            t0 = time.monotonic()
            await _paced(ws, speech.silence(300) + speech.pcm24k("turn1"), t0)
            created, _ = await _until(ws, "response.created")
            await _until(ws, "response.output_audio.delta")
            sender = asyncio.ensure_future(_paced(ws, speech.pcm24k("barge_in"), time.monotonic() - 60))
            rid = created["response"]["id"]
            started = last = None
            async for ev in _events(ws):
                if ev["type"] == "input_audio_buffer.speech_started":
                    started = last = time.monotonic()
                elif ev["type"] == "response.output_audio.delta" and ev["response_id"] == rid and started:
                    last = time.monotonic()
                elif ev["type"] == "response.done" and ev["response"]["id"] == rid:
                    break
            await sender
            job = str(created["response"]["metadata"]["omnid_job"])
            return (last - started if started is not None and last is not None else None), job
        finally:
            await ws.close()


def bench_vad(ctx: Ctx) -> list[Row]:
    stages, pipelines = _voice_config()
    saved = dict(BENCH_DAEMON)
    BENCH_DAEMON["cancel_grace_s"] = 60.0
    BENCH_DAEMON["max_realtime_sessions"] = SESSIONS + 4
    BENCH_DAEMON["max_realtime_sessions_per_key"] = SESSIONS + 4
    try:
        d = bench_tensors._launch(stages, pipelines)
    finally:
        BENCH_DAEMON.clear()
        BENCH_DAEMON.update(saved)
    socket = str(d.socket)
    try:
        ctx.log("warm-up")
        asyncio.run(_voice_turn(socket, True))
        # VAD's cost: an idle window, then SESSIONS streaming
        c0 = _cpu(d.proc.pid)
        idle_health = _health_p50(socket, WINDOW_S)
        idle_cpu = _cpu(d.proc.pid) - c0
        stop = threading.Event()
        box: dict[str, Any] = {}

        def stream() -> None:
            box["turns"] = asyncio.run(_streamers(socket, SESSIONS, WINDOW_S + 4, stop))

        ctx.log(f"{SESSIONS} sessions streaming")
        th = threading.Thread(target=stream, daemon=True)
        th.start()
        time.sleep(2.0)                                   # all open and streaming
        c1 = _cpu(d.proc.pid)
        busy_health = _health_p50(socket, WINDOW_S)
        busy_cpu = _cpu(d.proc.pid) - c1
        stop.set()
        th.join(60)
        per_session = (busy_cpu - idle_cpu) / WINDOW_S / SESSIONS
        rounds = ctx.n(5, 2)
        vad, manual = [], []
        for i in range(rounds):
            ctx.check(f"round {i}")
            ctx.log(f"round {i}")
            manual.append(asyncio.run(_voice_turn(socket, True)))
            vad.append(asyncio.run(_voice_turn(socket, False)))
        cuts, stopped = [], []
        for i in range(ctx.n(3, 1)):
            ctx.check(f"barge-in {i}")
            cut, job = asyncio.run(_barge_in(socket))
            if cut is None:
                continue                                  # the answer was whole before it was cut
            cuts.append(cut)
            end = time.monotonic() + 30
            while d.client.job(job)["state"] != "cancelled" and time.monotonic() < end:
                time.sleep(0.2)
            stopped.append(d.client.job(job)["state"] == "cancelled")
    finally:
        kill_daemon(d)
    m, v = p50(manual), p50(vad)
    return [
        Row(FIGURES[0], per_session * 100, "% of a core", "goal", 5.0, "%", None, "",
            at_most(5.0, "<= 5 % of a core", on="value"),
            f"{SESSIONS} sessions x {WINDOW_S:g} s of paced speech and silence; {box.get('turns', 0)} turns "
            f"detected; supervisor CPU {busy_cpu:.2f} s busy vs {idle_cpu:.2f} s idle (all of it: the sockets, JSON and "
            f"base64 too, not the model alone)"),
        Row(FIGURES[1], busy_health, "s", "idle daemon, same run", idle_health, "s", busy_health / idle_health,
            "streaming / idle", at_most(2.0, "<= 2x"), "p50 of GETs every 50 ms over the window"),
        Row(FIGURES[2], v, "s", f"{SILENCE_MS} ms + 1.2 x manual commit -> 1st audio delta", SILENCE_MS / 1000 + 1.2 * m,
            "s", v / (SILENCE_MS / 1000 + 1.2 * m), "vad / (silence + 1.2 x manual)", at_most(1.0, "<= 1x"),
            f"median of {rounds}; manual p50 {m:.2f} s; spread vad {statistics.pstdev(vad):.2f} s"),
        Row(FIGURES[3], p50(cuts) if cuts else None, "s", "goal", 0.1, "s", None, "",
            at_most(0.1, "<= 100 ms", on="value"),
            f"median of {len(cuts)}, max {max(cuts, default=0) * 1e3:.0f} ms; jobs cancelled: "
            f"{sum(stopped)} of {len(stopped)} (job state)", error=None if cuts else "every answer ended before its barge-in"),
    ]
