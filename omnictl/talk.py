"""`omnictl talk PIPELINE`: a conversation over the daemon's realtime session (`/v1/realtime`).

Type a line; the answer's text is printed as it comes and its speech is played through the
default audio output if a player is there (`pw-play`, `paplay` or `aplay` on PATH), or written as
WAV files (`-o DIR`, one per answer). Ctrl-C during an answer interrupts it (a barge-in: the
daemon cancels its job in every stage); at the prompt it quits, as Ctrl-D does.

aiohttp (omnid's own dependency) speaks the WebSocket; it is imported when the command runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import signal
import subprocess
import sys
import threading
import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAYERS = (("pw-play", ["--format", "s16", "--rate", "{rate}", "--channels", "1", "-"]),
           ("paplay", ["--raw", "--format=s16le", "--rate={rate}", "--channels=1"]),
           ("aplay", ["-q", "-f", "S16_LE", "-r", "{rate}", "-c", "1", "-t", "raw"]))


class TalkError(Exception):
    """The session could not be had (refused, or the socket closed): the message says why."""


def player(rate: int) -> list[str] | None:
    """The command that plays raw PCM16 mono at `rate` on the default output, if one is installed."""
    for name, args in PLAYERS:
        path = shutil.which(name)
        if path is not None:
            return [path, *(a.format(rate=rate) for a in args)]
    return None


def _lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str | None]) -> None:
    """stdin's lines into `queue` (a daemon thread: a pending read never holds the exit)."""
    for line in sys.stdin:
        loop.call_soon_threadsafe(queue.put_nowait, line.rstrip("\n"))
    loop.call_soon_threadsafe(queue.put_nowait, None)


class Talk:
    def __init__(self, socket: str, pipeline: str, out_dir: Path | None, text_only: bool, voice: str | None,
                 play: bool, url: str | None = None, key: str | None = None) -> None:
        self.socket, self.pipeline, self.out_dir = socket, pipeline, out_dir
        self.text_only, self.voice, self.play = text_only, voice, play
        self.url, self.key = url, key
        self.rate = 24000
        self.answers = 0
        self.answering = False
        self.interrupted = False

    async def run(self) -> int:
        import aiohttp

        if self.url is not None:
            http = aiohttp.ClientSession()
            url = self.url.rstrip("/") + f"/v1/realtime?model={self.pipeline}"
        else:
            http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket))
            url = f"http://omnid/v1/realtime?model={self.pipeline}"
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        loop = asyncio.get_running_loop()
        try:
            async with http, http.ws_connect(url, headers=headers, max_msg_size=0) as ws:
                first = await self._event(ws)
                if first.get("type") != "session.created":
                    raise TalkError(self._why(first, ws))
                self.rate = int(first["session"]["audio"]["output"]["format"].get("rate") or self.rate)
                session: dict[str, Any] = {"type": "realtime"}
                if self.text_only or first["session"].get("output_modalities") == ["text"]:
                    session["output_modalities"] = ["text"]
                    self.text_only = True
                if self.voice:
                    session["audio"] = {"output": {"voice": self.voice}}
                await ws.send_str(json.dumps({"type": "session.update", "session": session}))
                updated = await self._event(ws)
                if updated.get("type") != "session.updated":
                    raise TalkError(self._why(updated, ws))
                lines: asyncio.Queue[str | None] = asyncio.Queue()
                threading.Thread(target=_lines, args=(loop, lines), daemon=True).start()
                loop.add_signal_handler(signal.SIGINT, self._sigint, ws, loop)
                try:
                    while True:
                        if sys.stdin.isatty():
                            print("> ", end="", flush=True)
                        line = await lines.get()
                        if line is None:
                            return 0
                        if not line.strip():
                            continue
                        await self._turn(ws, line)
                finally:
                    loop.remove_signal_handler(signal.SIGINT)
        except aiohttp.ClientError as e:
            raise TalkError(f"cannot reach the daemon's realtime session: {e}") from None

    def _sigint(self, ws: Any, loop: asyncio.AbstractEventLoop) -> None:
        if not self.answering:
            raise KeyboardInterrupt
        if not self.interrupted:
            self.interrupted = True
            loop.create_task(ws.send_str(json.dumps({"type": "response.cancel"})))

    @staticmethod
    async def _event(ws: Any) -> dict[str, Any]:
        import aiohttp

        msg = await ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            return {"type": "closed", "code": ws.close_code, "reason": str(msg.extra or "")}
        event: dict[str, Any] = json.loads(msg.data)
        return event

    @staticmethod
    def _why(event: Mapping[str, Any], ws: Any) -> str:
        if event.get("type") == "error":
            err = event["error"]
            return f"{err.get('message')} ({err.get('code')})"
        return f"the session closed ({event.get('code')}: {event.get('reason') or 'no reason'})"

    async def _turn(self, ws: Any, text: str) -> None:
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
        await ws.send_str(json.dumps({"type": "response.create"}))
        self.answering, self.interrupted = True, False
        pcm = bytearray()
        proc: subprocess.Popen[bytes] | None = None
        try:
            while True:
                ev = await self._event(ws)
                kind = ev.get("type")
                if kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                    print(ev["delta"], end="", flush=True)
                elif kind == "response.output_audio.delta":
                    data = base64.b64decode(ev["delta"])
                    pcm += data
                    if self.play and proc is None:
                        cmd = player(self.rate)
                        if cmd is not None:
                            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
                    if proc is not None and proc.stdin is not None:
                        try:
                            proc.stdin.write(data)
                            proc.stdin.flush()
                        except BrokenPipeError:
                            proc = None
                elif kind == "session.updated":
                    self.rate = int(ev["session"]["audio"]["output"]["format"].get("rate") or self.rate)
                elif kind == "error":
                    print(f"\nomnictl: {ev['error'].get('message')} ({ev['error'].get('code')})", file=sys.stderr)
                elif kind == "response.done":
                    status = ev["response"]["status"]
                    print(" [interrupted]" if status == "cancelled" else "" if status == "completed"
                          else f" [{status}]", flush=True)
                    break
                elif kind == "closed":
                    raise TalkError(self._why(ev, ws))
        finally:
            self.answering = False
            if proc is not None:
                if self.interrupted:
                    proc.kill()
                elif proc.stdin is not None:
                    proc.stdin.close()
        self.answers += 1
        if pcm and (proc is None or self.out_dir is not None):
            self._write(bytes(pcm))

    def _write(self, pcm: bytes) -> None:
        folder = self.out_dir or Path(".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"answer-{self.answers:03d}.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.rate)
            w.writeframes(pcm)
        print(f"({path}: {len(pcm) / 2 / self.rate:.2f} s)", file=sys.stderr, flush=True)
