"""A caller that hangs up cancels its job, however fast the job's events flow.

Each request goes over a raw Unix socket, so the test decides the moment of the hang-up: once
the job is running and streaming (a vLLM stage that writes a token at a time, and a python
stage that yields a segment every 50 ms), the socket is closed. The job must be cancelled
within DISCONNECT_POLL_S (plus the slack of a loaded machine), non-streamed and streamed, and
its stage must be free again. Each figure is printed (`pytest -s`).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import MODELS, RunningDaemon, module_daemon, python_stage, short_tmpdir, tiny_llm, wait_for

from omnid.supervisor.http.openai.routes import DISCONNECT_POLL_S

pytestmark = pytest.mark.vllm

SLACK_S = 1.0          # a shared, loaded machine: scheduling, the cancel's own round trip


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    from omnid.tinymodels import is_built
    if not is_built(MODELS / "llm", "llm"):
        pytest.skip("the tiny models are not built (make models)")
    stages = {
        "llm": tiny_llm({"max_tokens": 480, "ignore_eos": True, "temperature": 0.9, "seed": 7}),
        "drip": python_stage("resourcestages", "drip", defaults={"n": 400, "every_s": 0.05}),
    }
    with module_daemon(short_tmpdir(), stages, {"llm": {"stages": ["llm"]}, "drip": {"stages": ["drip"]}},
                       {"heartbeat_timeout_s": 60.0}) as rd:
        yield rd


def _send(d: RunningDaemon, path: str, body: dict[str, Any]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(d.socket))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: omnid\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _running_job(d: RunningDaemon, pipeline: str, seen: set[str]) -> dict[str, Any]:
    """The new job of `pipeline`, once it is running and has streamed a few segments."""
    def found() -> Any:
        for job in d.client.jobs(pipeline=pipeline, limit=5)["jobs"]:
            if job["id"] not in seen and job["state"] == "running" and job["stages"][pipeline]["segments"] >= 3:
                return job
        return None
    return wait_for(found, 120, f"a running {pipeline} job that streams", every=0.05)  # type: ignore[no-any-return]


def _hang_up_and_time(d: RunningDaemon, pipeline: str, path: str, body: dict[str, Any], seen: set[str]) -> float:
    sock = _send(d, path, body)
    job = _running_job(d, pipeline, seen)
    seen.add(job["id"])
    sock.close()
    t0 = time.monotonic()
    doc = wait_for(lambda: (j := d.client.job(job["id"]))["state"] != "running" and j, DISCONNECT_POLL_S + 10,
                   f"job {job['id']} to end after its caller hung up", every=0.01)
    took = time.monotonic() - t0
    assert doc["state"] == "cancelled", doc
    assert doc["stages"][pipeline]["segments"] < 400, doc       # it did not run to its end (480 tokens, 400 drips)
    wait_for(lambda: not d.stages()[pipeline]["running"], 30, f"stage {pipeline} to be free again")
    return took


CASES = [
    ("drip", "/v1/completions", {"model": "drip", "prompt": "go"}),
    ("drip", "/v1/completions", {"model": "drip", "prompt": "go", "stream": True}),
    ("drip", "/v1/chat/completions", {"model": "drip", "messages": [{"role": "user", "content": "go"}]}),
    ("llm", "/v1/completions", {"model": "llm", "prompt": "Once upon a time"}),
    ("llm", "/v1/completions", {"model": "llm", "prompt": "Once upon a time", "stream": True}),
    ("llm", "/v1/chat/completions", {"model": "llm", "messages": [{"role": "user", "content": "Tell a story"}]}),
]


@pytest.mark.parametrize(("pipeline", "path", "body"), CASES,
                         ids=[f"{p}{path}{'-stream' if b.get('stream') else ''}" for p, path, b in CASES])
def test_a_hang_up_cancels_the_job_while_its_events_flow(daemon: RunningDaemon, pipeline: str, path: str,
                                                         body: dict[str, Any]) -> None:
    seen = {j["id"] for j in daemon.client.jobs(pipeline=pipeline, limit=1000)["jobs"]}
    took = _hang_up_and_time(daemon, pipeline, path, body, seen)
    print(f"{pipeline} {path} {'streamed' if body.get('stream') else 'non-streamed'}: "
          f"cancelled {took:.3f} s after the hang-up")
    assert took <= DISCONNECT_POLL_S + SLACK_S, f"the hang-up was noticed only after {took:.3f} s"
