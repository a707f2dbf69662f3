"""The front end by endpoint (issue 44): an OpenAI request, from its arrival to the scheduler's
`submit`, runs code of at most four front-end files: its endpoint's (openai/chat.py, ...), what the
OpenAI paths share up to a job (openai/common.py), admission.py (its body and its checks), and
api/core.py (the error middleware every request passes, and `ApiCore.take`, which makes the job).
Found by profiling the calls of a real request in process (the daemon's `Api` with the OpenAI paths
mounted, on a Unix socket; tracing off, no TCP door: those add trace_context.py and access.py to
every path alike).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_refusal_snapshots import _config

import omnid
from omnid.store import JobStore
from omnid.supervisor.http.api.app import Api, DaemonInfo
from omnid.supervisor.http.openai.routes import OpenAiApi
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics

FRONT_END = str(Path(omnid.__file__).parent / "supervisor" / "http") + os.sep
HI = [{"role": "user", "content": "hi"}]
# (path, body, the endpoint's own file)
CASES = {
    "chat": ("/v1/chat/completions", {"model": "chat", "messages": HI}, "openai/chat.py"),
    "chat_streamed": ("/v1/chat/completions", {"model": "chat", "messages": HI, "stream": True}, "openai/chat.py"),
    "completion": ("/v1/completions", {"model": "chat", "prompt": "hi", "echo": True}, "openai/completions.py"),
    "image": ("/v1/images/generations", {"model": "t2i", "prompt": "a fox", "size": "64x64"}, "openai/images.py"),
    "speech": ("/v1/audio/speech", {"model": "speak", "input": "hello"}, "openai/speech.py"),
}


class _Made(Exception):
    """The scheduler was asked to make the job: the request's way up to its job is over."""


class _Recorder:
    """The scheduler, as far as a request reaches it; it records the front-end files that run until then."""

    tracing = None
    live_jobs: dict[str, Any] = {}

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.on = False
        self.made = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call" and frame.f_code.co_filename.startswith(FRONT_END):
            self.files.add(frame.f_code.co_filename[len(FRONT_END):].replace(os.sep, "/"))

    def submit(self, sub: Any) -> Any:
        self.on, self.made = False, True
        raise _Made


async def _entered(tmp: Path) -> dict[str, tuple[bool, set[str]]]:
    config = _config(tmp)
    store = JobStore(tmp / "state")
    recorder = _Recorder()
    api = Api(Live(config), store, recorder, {}, Metrics({}), DaemonInfo(os.getpid(), 0.0, "test"))  # type: ignore[arg-type]
    OpenAiApi(api).mount(api.app)
    runner = web.AppRunner(api.app)
    await runner.setup()
    sock = tmp / "api.sock"
    await web.UnixSite(runner, str(sock)).start()
    found: dict[str, tuple[bool, set[str]]] = {}
    sys.setprofile(recorder.profile)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session:
            for name, (path, body, _) in CASES.items():
                recorder.files, recorder.on, recorder.made = set(), True, False
                async with session.post(f"http://omnid{path}", json=body) as resp:
                    await resp.read()
                recorder.on = False
                found[name] = (recorder.made, recorder.files)
    finally:
        sys.setprofile(None)
        await runner.cleanup()
        store.close()
    return found


@pytest.fixture(scope="module")
def entered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bool, set[str]]]:
    return asyncio.run(_entered(tmp_path_factory.mktemp("rooms")))


@pytest.mark.parametrize("name", list(CASES))
def test_a_request_enters_four_front_end_files_before_its_job(entered: dict[str, tuple[bool, set[str]]],
                                                              name: str) -> None:
    made, files = entered[name]
    assert made, f"{name}: the request never reached the scheduler (refused on the way: {sorted(files)})"
    assert files == {CASES[name][2], "openai/common.py", "admission.py", "api/core.py"}, sorted(files)
