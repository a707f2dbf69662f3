"""OpenAI's Realtime API (`/v1/realtime`): how soon a session's answer speaks, how soon a cancel stops it.

One daemon of its own: the tiny Qwen2.5-Omni as bench_omni wires it (`omni`: thinker on vLLM, talker
and code2wav python stages, streaming edges). Each round opens a fresh realtime session over the
socket (aiohttp), adds the user's line, then times `response.create` -> the first
`response.output_audio.delta`; the anchor, in the same round and with the same prompt, is a
streamed audio chat (`POST /v1/chat/completions`, `modalities: ["text", "audio"]`, pcm16): POST ->
its first chunk with audio. Then a long answer is cancelled at its first audio delta:
`response.cancel` sent -> the last delta the client receives (0 when none follows the cancel).
Last, 8 sessions speak at once, and the time their listeners wait (bench_omni's listener's clock, per
second of audio) is held to 8 omni jobs' over the jobs API in the same run: the session adds no
lateness of its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import bench_tensors
from _harness import BENCH_DAEMON, Ctx, Row, at_most, in_threads, kill_daemon, p50, raise_first
from bench_omni import _config, _run, listen

TOKENS = 24
SESSIONS = 8
FIGURES = ["realtime: response.create -> 1st audio delta", "realtime: response.cancel -> last delta received",
           f"realtime: listener's wait per audio second, {SESSIONS} sessions speaking at once"]


async def _events(ws: Any, waiting_for: str) -> AsyncIterator[dict[str, Any]]:
    """A realtime session's server events, parsed, without end; a close or an `error` event raises."""
    import aiohttp

    while True:
        msg = await ws.receive(timeout=300)
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the session closed before {waiting_for}: {ws.close_code}")
        ev = json.loads(msg.data)
        if ev["type"] == "error":
            raise RuntimeError(f"error event: {ev['error']}")
        yield ev


async def _session(socket: str, text: str, max_tokens: int, cancel: bool) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as http, \
            http.ws_connect("http://omnid/v1/realtime?model=omni", max_msg_size=0) as ws:
        async def until(kind: str) -> tuple[dict[str, Any], float]:
            async for ev in _events(ws, kind):
                if ev["type"] == kind:
                    return ev, time.monotonic()
            raise AssertionError("unreachable: _events never ends")

        await until("session.created")
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
        await until("conversation.item.done")
        t0 = time.monotonic()
        await ws.send_str(json.dumps({"type": "response.create", "response": {"max_output_tokens": max_tokens}}))
        _, first = await until("response.output_audio.delta")
        out = {"first": first - t0}
        if cancel:
            t1 = time.monotonic()
            await ws.send_str(json.dumps({"type": "response.cancel"}))
            last = t1
            while True:
                msg = await ws.receive(timeout=60)
                ev = json.loads(msg.data)
                if ev["type"].endswith(".delta"):
                    last = time.monotonic()
                if ev["type"] == "response.done":
                    out["cancel_to_last"] = last - t1
                    out["cancel_to_done"] = time.monotonic() - t1
                    break
        else:
            await until("response.done")
        return out


async def _speak(socket: str, text: str, max_tokens: int) -> list[tuple[float, float]]:
    """One session's answer as the listener hears it: (arrival, audio seconds) per audio delta."""
    import aiohttp

    packets: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as http, \
            http.ws_connect("http://omnid/v1/realtime?model=omni", max_msg_size=0) as ws:
        rate = 24000
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
        await ws.send_str(json.dumps({"type": "response.create", "response": {"max_output_tokens": max_tokens}}))
        async for ev in _events(ws, "response.done"):
            if ev["type"] in ("session.created", "session.updated"):
                rate = int(((ev["session"].get("audio") or {}).get("output") or {}).get("format", {}).get("rate") or rate)
            elif ev["type"] == "response.output_audio.delta":
                packets.append((time.monotonic(), len(base64.b64decode(ev["delta"])) / 2 / rate))
            elif ev["type"] == "response.done":
                return packets
    raise AssertionError("unreachable: _events never ends")


async def _speak_at_once(socket: str, n: int) -> list[list[tuple[float, float]]]:
    return list(await asyncio.gather(*(_speak(socket, f"the prompt number {i}", TOKENS) for i in range(n))))


def _audio_chat(socket: str, text: str, max_tokens: int) -> float:
    import httpx

    body = {"model": "omni", "messages": [{"role": "user", "content": text}], "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "pcm16"}, "stream": True, "max_tokens": max_tokens}
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=300) as http:
        t0 = time.monotonic()
        first = None
        with http.stream("POST", "http://omnid/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: {") and '"data"' in line:
                    chunk = json.loads(line[6:])
                    delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                    if (delta.get("audio") or {}).get("data"):
                        first = time.monotonic() - t0
        if first is None:
            raise RuntimeError("the audio chat sent no audio")
        return first


def bench_realtime(ctx: Ctx) -> list[Row]:
    stages, pipelines = _config()
    stages = {k: v for k, v in stages.items() if k in ("thinker", "talker", "code2wav")}
    # A cancel takes effect at code2wav's next step: on a loaded 2-core machine one step (a DiT window)
    # can take longer than the bench daemons' 10 s grace, which would kill the worker, not time the cancel.
    saved = dict(BENCH_DAEMON)
    BENCH_DAEMON["cancel_grace_s"] = 60.0
    try:
        d = bench_tensors._launch(stages, {"omni": pipelines["omni"]})
    finally:
        BENCH_DAEMON.clear()
        BENCH_DAEMON.update(saved)
    socket = str(d.socket)
    try:
        ctx.log("warm-up")
        _audio_chat(socket, "warm up", TOKENS)                # first jobs load the python stages' model parts
        asyncio.run(_session(socket, "warm up", TOKENS, False))
        rounds = ctx.n(5, 1)
        rt, chat, cancels, dones = [], [], [], []
        for i in range(rounds):
            ctx.check(f"round {i}")
            ctx.log(f"round {i}")
            text = f"good morning {i}"
            chat.append(_audio_chat(socket, text, TOKENS))
            rt.append(asyncio.run(_session(socket, text, TOKENS, False))["first"])
            c = asyncio.run(_session(socket, f"a long story {i}", 200, True))
            cancels.append(c["cancel_to_last"])
            dones.append(c["cancel_to_done"])
        # the anchor in the same run: as many omni jobs at once over the jobs API, as bench_omni times them
        spoken: list[list[tuple[float, float]]] = []
        jobs: list[dict[str, Any]] = []
        waves = ctx.n(3, 1)
        for i in range(waves):                      # (each side first in turn)
            ctx.check(f"{SESSIONS} sessions, wave {i}")
            ctx.log(f"wave {i}: {SESSIONS} sessions speaking at once, and {SESSIONS} omni jobs")
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                if side == 0:
                    spoken += asyncio.run(_speak_at_once(socket, SESSIONS))
                else:
                    wave = in_threads(SESSIONS, lambda k: _run(d, "omni", f"the prompt number {k}"),
                                      timeout=max(60.0, ctx.left()))
                    raise_first(wave)
                    jobs += wave
    finally:
        kill_daemon(d)
    r, a = p50(rt), p50(chat)
    # Packets are counted differently on each side (a session coalesces what a slow reader has not
    # taken into one delta), so the figure is the time the listener waits, per second of audio heard.
    heard = [listen(p) for p in spoken]
    late_rt, sent_rt = sum(n for n, _ in heard), sum(len(p) for p in spoken)
    wait_rt = sum(w for _, w in heard) / sum(s for p in spoken for _, s in p)
    late_jobs, sent_jobs = sum(j["underruns"] for j in jobs), sum(j["packets"] for j in jobs)
    wait_jobs = sum(j["waited"] for j in jobs) / sum(j["audio_s"] for j in jobs)
    # (no wait on either side: as good as the anchor; a wait where the jobs had none: no bound)
    ratio = wait_rt / wait_jobs if wait_jobs else (1.0 if not wait_rt else float("inf"))
    return [
        Row(FIGURES[0], r, "s", "streamed audio chat: POST -> 1st audio chunk", a, "s", r / a, "realtime / chat",
            at_most(1.1, "<= 1.1x"), f"median of {rounds}; same prompt, {TOKENS} text tokens, a fresh session each"),
        Row(FIGURES[1], p50(cancels), "s", "response.cancel -> response.done", p50(dones), "s", None, "",
            at_most(0.1, "<= 100 ms", on="value"), f"median of {rounds}; cancelled at the first audio delta of a "
            f"200-token answer; max {max(cancels) * 1e3:.0f} ms"),
        Row(FIGURES[2], wait_rt, "s/s", f"{SESSIONS} omni jobs at once (jobs API)", wait_jobs, "s/s", ratio,
            "realtime / jobs", at_most(1.1, "<= 1.1x"),
            f"{late_rt} of {sent_rt} deltas late, jobs {late_jobs} of {sent_jobs} packets; played from each "
            f"stream's first on (bench_omni's clock); {waves} waves, {TOKENS} text tokens each"),
    ]
