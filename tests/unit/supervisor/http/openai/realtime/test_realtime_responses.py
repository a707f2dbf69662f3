"""A realtime response's end, in process (`omnid.supervisor.http.openai.realtime.responses`), its session a
fake that records what is sent: the last events in OpenAI's order with the usage, and a cancel that
stops the job and says `cancelled` (nothing said when the socket is gone)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omnid.config import Config, DaemonConfig, PipelineConfig, StageConfig
from omnid.supervisor.http.openai.common import Generation
from omnid.supervisor.http.openai.realtime.conversation import Conversation, Item
from omnid.supervisor.http.openai.realtime.responses import Response, Responses
from omnid.supervisor.http.openai.realtime.settings import SessionSettings

D = Path("/nonexistent")


class Request(dict[str, Any]):
    path = "/v1/realtime"


class Session:
    def __init__(self, cfg: Config) -> None:
        self.id = "sess_1"
        self.request: Any = Request(uid=1000)
        self.conversation = Conversation(cfg, cfg.pipelines["chat"], None)
        self.settings = SessionSettings("chat", speaks=True)
        self.sent: list[dict[str, Any]] = []
        self.closed = False

    async def send(self, ev: dict[str, Any]) -> None:
        self.sent.append(ev)


def runner() -> tuple[Responses, Session, list[str]]:
    cfg = Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D),
                 {"gen": StageConfig("gen", "vllm", model=D)}, {"chat": PipelineConfig("chat", ("gen",), ())})
    cancelled: list[str] = []
    scheduler = SimpleNamespace(live_jobs={"j1": object()}, cancel=cancelled.append)
    session = Session(cfg)
    jobs: Any = SimpleNamespace(api=SimpleNamespace(config=cfg, scheduler=scheduler))
    return Responses(session, jobs, cfg.pipelines["chat"], {}), session, cancelled   # type: ignore[arg-type]


def response(audio: bool) -> Response:
    gen = Generation("gen", "gen", prompt_tokens=5, tokens=3)
    item = Item("item_1", "assistant", "hi there", spoken=audio, status="in_progress")
    return Response("resp_1", item, SimpleNamespace(id="j1"), gen, audio, {"omnid_job": "j1"}, "ash")  # type: ignore[arg-type]


def test_the_last_events_of_a_response() -> None:
    rs, session, _ = runner()
    r = response(audio=True)
    r.pcm_bytes = 480
    rs.current = r
    asyncio.run(rs.finish(r, "completed", None, None))
    assert [ev["type"] for ev in session.sent] == [
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done"]
    assert rs.current is None and r.item.status == "completed"
    done = session.sent[-1]["response"]
    assert done["status"] == "completed" and done["status_details"] == {"type": "completed"}
    assert done["usage"]["input_tokens"] == 5 and done["usage"]["output_tokens"] == 3
    assert done["output"] == [r.item.doc()] and done["conversation_id"] == "sess_1"


def test_a_cancel_stops_the_job_and_says_so() -> None:
    rs, session, cancelled = runner()
    assert asyncio.run(rs.cancel("client_cancelled")) is False          # nothing under way
    r = response(audio=False)
    rs.current = r
    assert asyncio.run(rs.cancel("client_cancelled")) is True
    assert cancelled == ["j1"] and rs.current is None
    assert [ev["type"] for ev in session.sent] == [
        "conversation.item.added", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done"]
    assert session.sent[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert session.conversation.items == [r.item] and r.item.status == "incomplete"
    rs2, session2, cancelled2 = runner()
    rs2.current = response(audio=True)
    session2.closed = True                                              # the socket is gone: nothing said
    assert asyncio.run(rs2.cancel(None)) is True and cancelled2 == ["j1"] and session2.sent == []
