"""OpenAI's Realtime API (`/v1/realtime`): how soon a session's answer speaks, how soon a cancel stops it.

One daemon of its own: the tiny Qwen2.5-Omni as bench_omni wires it (`omni`: thinker on vLLM, talker
and code2wav python stages, streaming edges). Each round opens a fresh realtime session over the
socket (aiohttp), adds the user's line, then times `response.create` -> the first
`response.output_audio.delta`; the anchor, in the same round and with the same prompt, is a
streamed audio chat (`POST /v1/chat/completions`, `modalities: ["text", "audio"]`, pcm16): POST ->
its first chunk with audio. Then a long answer is cancelled at its first audio delta:
`response.cancel` sent -> the last delta the client receives (0 when none follows the cancel).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import bench_tensors
from _harness import BENCH_DAEMON, Ctx, Row, at_most, kill_daemon, p50
from bench_omni import _config

TOKENS = 24
FIGURES = ["realtime: response.create -> 1st audio delta", "realtime: response.cancel -> last delta received"]


async def _session(socket: str, text: str, max_tokens: int, cancel: bool) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as http, \
            http.ws_connect("http://omnid/v1/realtime?model=omni", max_msg_size=0) as ws:
        async def until(kind: str) -> tuple[dict[str, Any], float]:
            while True:
                msg = await ws.receive(timeout=300)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"the session closed before {kind}: {ws.close_code}")
                ev = json.loads(msg.data)
                if ev["type"] == "error":
                    raise RuntimeError(f"error event: {ev['error']}")
                if ev["type"] == kind:
                    return ev, time.monotonic()

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
    finally:
        kill_daemon(d)
    r, a = p50(rt), p50(chat)
    return [
        Row(FIGURES[0], r, "s", "streamed audio chat: POST -> 1st audio chunk", a, "s", r / a, "realtime / chat",
            at_most(1.1, "<= 1.1x"), f"median of {rounds}; same prompt, {TOKENS} text tokens, a fresh session each"),
        Row(FIGURES[1], p50(cancels), "s", "response.cancel -> response.done", p50(dones), "s", None, "",
            at_most(0.1, "<= 100 ms", on="value"), f"median of {rounds}; cancelled at the first audio delta of a "
            f"200-token answer; max {max(cancels) * 1e3:.0f} ms"),
    ]
