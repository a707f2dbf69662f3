"""The TCP listener and its API keys, with real daemons on real ports of 127.0.0.1.

One daemon for the module serves vLLM, diffusers and the demo's toy vocoder on the tiny models,
on its socket and on `daemon.listen`; its keys are made with the real `omnictl key add`. The
official `openai` package talks to it through a key, and its answers are validated against
OpenAI's own published schemas (tests/fixtures/openai_schemas.json, copied from
openai/openai-openapi). Ownership is checked across keys and, over the socket, as the key's uid
itself (a client process running as that uid). Small python-only daemons cover what happens at
start (a wide address without keys), the per-key limits, CORS and socket activation of a TCP socket.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FIXTURES,
    ROOT,
    RunningDaemon,
    build_tiny_models,
    chat_draw_speak,
    daemon_config,
    module_daemon,
    omnictl,
    py_stage,
    short_tmpdir,
    sleeper,
    wait_for,
)

from omnictl.client import Client
from omnid.keys import KeyStore, key_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

OTHER_UID = 54321           # the uid the first key acts as (no such user needs to exist)
THIRD_UID = 54322
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me about the sea."}]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nullable(node: Any) -> Any:
    """OpenAI's document (OpenAPI 3.1) still marks some fields with 3.0's `nullable: true`, which JSON
    Schema ignores; read it as OpenAPI tools do: that schema, or null."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


def openai_schema(name: str) -> Callable[[Any], None]:
    """A validator of one of OpenAI's published schemas (by its components.schemas name)."""
    doc = _nullable(json.loads((FIXTURES / "openai_schemas.json").read_text()))
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "components": doc["components"],
              "$ref": f"#/components/schemas/{name}"}
    validator = jsonschema.Draft202012Validator(schema)

    def check(instance: Any) -> None:
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
        assert not errors, f"not a valid {name}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5])
    return check


def add_key(d: RunningDaemon, name: str, *args: str) -> str:
    """`omnictl key add`, for real: the key is the last line it prints."""
    done = omnictl(d, "key", "add", name, *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("omk_"), done.stdout
    return lines[-1]


def tcp(base: str, key: str | None = None, header: str = "bearer") -> Any:
    headers = {}
    if key is not None:
        headers = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}
    return httpx.Client(base_url=base, headers=headers, timeout=120)


# ------------------------------------------------------------------------- the engines' daemon


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    build_tiny_models("llm", "sd")
    d = short_tmpdir()
    os.chmod(d, 0o755)              # the client running as OTHER_UID reaches the socket in it
    port = free_port()
    stages, pipelines = chat_draw_speak()
    stages["echo"] = py_stage("echo")
    pipelines["echo"] = {"stages": ["echo"]}
    # socket_mode 0666: the test's client running as OTHER_UID must reach the socket too
    with module_daemon(d, stages, pipelines, {"heartbeat_timeout_s": 60.0, "listen": [f"127.0.0.1:{port}"],
                                              "socket_mode": "0666"}) as rd:
        rd.base = f"http://127.0.0.1:{port}"          # type: ignore[attr-defined]
        yield rd


@pytest.fixture(scope="module")
def keys(daemon: RunningDaemon) -> dict[str, str]:
    return {"alice": add_key(daemon, "alice", "--uid", str(OTHER_UID)),
            "bob": add_key(daemon, "bob", "--uid", str(THIRD_UID))}


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon, keys: dict[str, str]) -> Iterator[Any]:
    # No retries: a retried request would be a second job.
    c = openai.OpenAI(base_url=f"{daemon.base}/v1", api_key=keys["alice"], max_retries=0,  # type: ignore[attr-defined]
                      timeout=120)
    yield c
    c.close()


@pytest.mark.vllm
def test_keys_are_stored_hashed_in_a_private_file(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    path = key_path(daemon.state_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert keys["alice"] not in text and keys["bob"] not in text         # hashes only
    listed = omnictl(daemon, "key", "list")
    assert listed.returncode == 0 and "alice" in listed.stdout and str(OTHER_UID) in listed.stdout
    assert keys["alice"] not in listed.stdout and keys["alice"][:8] in listed.stdout   # its first characters
    doc = json.loads(omnictl(daemon, "--json", "key", "list").stdout)
    assert {k["name"]: k["uid"] for k in doc["keys"]} == {"alice": OTHER_UID, "bob": THIRD_UID}
    assert all("sha256" not in k for k in doc["keys"])
    again = omnictl(daemon, "key", "add", "alice", "--uid", str(OTHER_UID))
    assert again.returncode == 4 and "already" in again.stderr
    bad = omnictl(daemon, "key", "add", "no/slashes", "--uid", "0")
    assert bad.returncode == 4


# (body, the field its 400 must name) for POST /v1/keys, as root on the socket
BAD_KEY_BODIES = [
    ({"uid": 5}, "\"name\""), ({"name": "no/slashes", "uid": 5}, "\"name\""), ({"name": 7, "uid": 5}, "\"name\""),
    ({"name": "k1", "uid": -1}, "\"uid\""), ({"name": "k1", "uid": "5"}, "\"uid\""), ({"name": "k1", "uid": True}, "\"uid\""),
    ({"name": "k1", "uid": 5, "max_jobs": 0}, "\"max_jobs\""), ({"name": "k1", "uid": 5, "max_jobs": 2.5}, "\"max_jobs\""),
    ({"name": "k1", "uid": 5, "rps": 0}, "\"rps\""), ({"name": "k1", "uid": 5, "rps": "fast"}, "\"rps\""),
    ({"name": "k1", "uid": 5, "admin": "yes"}, "\"admin\""), ({"name": "k1", "uid": 5, "colour": "red"}, "colour"),
    ({"name": "k1"}, "\"uid\""), ({"name": "k1", "uid": None}, "\"uid\""),      # root must say whom it stands for
]
BAD_ADAPTER_BODIES = [({"path": "/x"}, "\"name\" is required"), ({"name": "a b", "path": "/x"}, "adapter's name"),
                      ({"name": "ok", "path": ""}, "\"path\""), ({"name": "ok", "path": 3}, "\"path\""),
                      ({"name": "ok", "path": "/x", "rank": 8}, "rank")]


@pytest.mark.vllm
def test_key_and_adapter_bodies_are_refused_naming_the_field(daemon: RunningDaemon) -> None:
    """The socket API's bodies (typed models, KeyRequest and AdapterRequest): each wrong one a 400
    invalid_request whose message names its field in plain words, never pydantic's; no key is made."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://omnid") as h:
        before = {k["name"] for k in h.get("/v1/keys").json()["keys"]}
        for path, cases in (("/v1/keys", BAD_KEY_BODIES), ("/v1/stages/expand/adapters", BAD_ADAPTER_BODIES)):
            for body, field in cases:
                r = h.post(path, json=body)
                error = r.json()["error"]
                assert (r.status_code, error["code"]) == (400, "invalid_request"), (path, body, r.text)
                assert field in error["message"], (body, error["message"])
                assert not any(w in error["message"] for w in ("Input should", "type=", "pydantic")), error["message"]
        assert {k["name"] for k in h.get("/v1/keys").json()["keys"]} == before
        made = h.post("/v1/keys", json={"name": "typed", "uid": THIRD_UID, "rps": 5, "max_jobs": None})
        assert made.status_code == 201 and made.json()["rps"] == 5.0 and made.json()["uid"] == THIRD_UID
        assert h.delete("/v1/keys/typed").status_code == 200


@pytest.mark.vllm
def test_the_openai_package_through_a_key(client: Any, daemon: RunningDaemon) -> None:
    models = {m.id for m in client.models.list()}
    assert models == {"chat", "t2i", "speak", "echo"}
    check = openai_schema("ListModelsResponse")
    check(client.models.with_raw_response.list().http_response.json())

    raw = client.chat.completions.with_raw_response.create(model="chat", messages=CHAT, temperature=0, max_tokens=6)
    openai_schema("CreateChatCompletionResponse")(raw.http_response.json())
    plain = raw.parse()
    assert plain.choices[0].message.content and plain.choices[0].message.refusal is None
    assert plain.usage.completion_tokens == 6

    chunk_ok = openai_schema("CreateChatCompletionStreamResponse")
    chunks = []
    with client.chat.completions.with_streaming_response.create(
            model="chat", messages=CHAT, temperature=0, max_tokens=6, stream=True,
            stream_options={"include_usage": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    for c in chunks:
        chunk_ok(c)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) \
        == plain.choices[0].message.content
    assert chunks[-1]["usage"]["completion_tokens"] == 6

    done = client.completions.with_raw_response.create(model="chat", prompt="The morning was", max_tokens=4,
                                                       temperature=0)
    openai_schema("CreateCompletionResponse")(done.http_response.json())

    image = client.images.with_raw_response.generate(model="t2i", prompt="a red fox", size="64x64")
    openai_schema("ImagesResponse")(image.http_response.json())
    assert base64.b64decode(image.parse().data[0].b64_json).startswith(PNG_MAGIC)

    with client.audio.speech.with_streaming_response.create(model="speak", input="the sea at night",
                                                            voice="alloy", response_format="wav") as resp:
        assert resp.headers["content-type"] == "audio/wav"
        audio = b"".join(resp.iter_bytes())
    assert audio[:4] == b"RIFF" and audio[8:12] == b"WAVE"

    # each of them is an ordinary job of the key's uid
    owned = {j["pipeline"] for j in daemon.client.jobs(limit=1000)["jobs"] if j["owner_uid"] == OTHER_UID}
    assert {"chat", "t2i", "speak"} <= owned


@pytest.mark.vllm
def test_no_key_a_wrong_key_and_a_removed_key_get_401(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    base = daemon.base            # type: ignore[attr-defined]
    error_ok = openai_schema("ErrorResponse")
    for key in (None, "omk_not-a-key", keys["alice"] + "x"):
        with tcp(base, key) as h:
            r = h.get("/v1/models")
            assert r.status_code == 401, r.text
            error_ok(r.json())                                           # OpenAI's shape on its paths
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"].startswith("Bearer")
            r = h.get("/v1/jobs")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert set(r.json()["error"]) == {"code", "message"}         # omnid's shape elsewhere
            assert h.get("/v1/nowhere").status_code == 401               # nothing to learn without a key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="omk_wrong", max_retries=0).models.list()
    with tcp(base, keys["alice"], header="x-api-key") as h:              # the header some clients send
        assert h.get("/v1/models").status_code == 200

    temp = add_key(daemon, "temporary", "--uid", "0")
    with tcp(base, temp) as h:
        assert h.get("/v1/jobs").status_code == 200
        gone = omnictl(daemon, "key", "rm", "temporary")
        assert gone.returncode == 0, gone.stderr
        assert h.get("/v1/jobs").status_code == 401                      # at once, same connection
    assert omnictl(daemon, "key", "rm", "temporary").returncode == 4
    with tcp(base, keys["alice"]) as h:                                  # a key cannot manage keys
        r = h.post("/v1/keys", json={"name": "mine"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "socket_only"


@pytest.mark.vllm
def test_a_keys_jobs_are_its_uids(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    base = daemon.base            # type: ignore[attr-defined]
    with tcp(base, keys["alice"]) as alice, tcp(base, keys["bob"]) as bob:
        r = alice.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"prompt": "mine"}})
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["owner_uid"] == OTHER_UID
        assert alice.get(f"/v1/jobs/{job['id']}").status_code == 200
        assert job["id"] in {j["id"] for j in alice.get("/v1/jobs").json()["jobs"]}
        assert bob.get(f"/v1/jobs/{job['id']}").status_code == 403
        assert bob.post(f"/v1/jobs/{job['id']}/cancel").status_code == 403
        assert job["id"] not in {j["id"] for j in bob.get("/v1/jobs").json()["jobs"]}
    # over the socket, as that uid itself (SO_PEERCRED): the owner sees it, another uid does not
    assert job["id"] in _jobs_seen_as(OTHER_UID, daemon)
    assert job["id"] not in _jobs_seen_as(THIRD_UID, daemon)


def _jobs_seen_as(uid: int, daemon: RunningDaemon) -> list[str]:
    """The job ids a client running as `uid` lists on the socket (`GET /v1/jobs`)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); from omnictl.client import Client; "
            "print(json.dumps([j['id'] for j in Client(sys.argv[1]).jobs(limit=1000)['jobs']]))")
    seen = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                           code, str(daemon.socket), str(ROOT)], capture_output=True, text=True, timeout=30, cwd="/")
    assert seen.returncode == 0, seen.stderr
    ids: list[str] = json.loads(seen.stdout)
    return ids


@pytest.mark.vllm
def test_audit_lines_name_the_key_and_never_log_it(daemon: RunningDaemon, keys: dict[str, str]) -> None:
    with tcp(daemon.base, keys["bob"]) as h:       # type: ignore[attr-defined]
        r = h.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"prompt": "audited"}})
        assert r.status_code == 201
    job = r.json()["id"]
    wait_for(lambda: job in daemon.log(), 10, "the submit's audit line")
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{") and job in line]
    audit = [e for e in lines if e.get("event") == "audit" and e.get("action") == "submit"]
    assert audit and audit[0]["key"] == "bob" and audit[0]["uid"] == THIRD_UID, lines
    log = daemon.log()
    assert all(k not in log for k in keys.values())


@pytest.mark.vllm
def test_sampling_parameters_are_checked_at_the_door(daemon: RunningDaemon, client: Any) -> None:
    before = len(daemon.client.jobs(limit=1000)["jobs"])
    for field, value in (("temperature", 5), ("top_p", 0), ("presence_penalty", 3), ("stop", [""])):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="chat", messages=CHAT, **{field: value})
        assert e.value.status_code == 400 and e.value.param == field, e.value
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chat", messages=CHAT, max_tokens=2, extra_body={"min_tokens": 5})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chat", prompt="x", extra_body={"top_k": -2})
    for params in ({"temperature": 5}, {"min_tokens": 50}, {"stop": ""}):     # the job API too
        r = daemon.client._request("POST", "/v1/jobs", body={"pipeline": "chat", "inputs": {"prompt": "x"},
                                                               "params": {"expand": params}}, accept_statuses=(400,))
        assert r[0] == 400 and r[1]["error"]["code"] == "invalid_param", r
    assert len(daemon.client.jobs(limit=1000)["jobs"]) == before            # no job was made for any of them


# ------------------------------------------------------------------------- start, limits, CORS


def echo_only() -> tuple[dict[str, Any], dict[str, Any]]:
    """One python stage `echo` and its pipeline `echo`: a daemon for what the door does."""
    return {"echo": py_stage("echo")}, {"echo": {"stages": ["echo"]}}


def _echo_daemon(start_daemon: Callable[..., RunningDaemon], **daemon_keys: Any) -> RunningDaemon:
    return start_daemon({"echo": py_stage("echo"), "nap": sleeper(2.0)},
                        {"echo": {"stages": ["echo"]}, "nap": {"stages": ["nap"]}}, daemon_keys)


def test_a_wide_address_without_keys_is_refused_at_start(tmp_path: Path) -> None:
    d = short_tmpdir()
    try:
        port = free_port()
        cfg = daemon_config(d, *echo_only(), {"listen": [f"0.0.0.0:{port}"]})
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        check = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(cfg)], capture_output=True,
                               text=True, env=env, timeout=60)
        assert check.returncode == 2, check.stdout + check.stderr
        assert "daemon.listen" in check.stderr and str(key_path(d / "state")) in check.stderr
        run = subprocess.run([sys.executable, "-m", "omnid", "-c", str(cfg)], capture_output=True, text=True,
                             env=env, timeout=60)
        assert run.returncode == 2 and str(key_path(d / "state")) in run.stderr
        with socket.socket() as s:                        # it never listened
            assert s.connect_ex(("127.0.0.1", port)) != 0
        KeyStore(key_path(d / "state")).add("first", os.getuid())
        assert subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(cfg)], capture_output=True,
                              env=env, timeout=60).returncode == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_ipv6_loopback_needs_no_key_to_start_but_every_request_needs_one(
        start_daemon: Callable[..., RunningDaemon]) -> None:
    port = free_port()
    d = _echo_daemon(start_daemon, listen=[f"[::1]:{port}", f"127.0.0.1:{port}"])
    for base in (f"http://[::1]:{port}", f"http://127.0.0.1:{port}"):
        with tcp(base) as h:
            assert h.get("/v1/health").status_code == 401
    key = add_key(d, "six", "--uid", "0")
    with tcp(f"http://[::1]:{port}", key) as h:
        assert h.get("/v1/health").json()["status"] == "ok"


def test_per_key_limits_answer_429_with_retry_after(start_daemon: Callable[..., RunningDaemon]) -> None:
    port = free_port()
    d = _echo_daemon(start_daemon, listen=[f"127.0.0.1:{port}"])
    slow = add_key(d, "slow", "--uid", "0", "--rps", "2")
    one = add_key(d, "one", "--uid", "0", "--max-jobs", "1")
    base = f"http://127.0.0.1:{port}"
    with tcp(base, slow) as h:
        codes = [h.get("/v1/health") for _ in range(6)]
    limited = [r for r in codes if r.status_code == 429]
    assert [r.status_code for r in codes[:2]] == [200, 200] and limited, [r.status_code for r in codes]
    assert int(limited[0].headers["Retry-After"]) >= 1 and limited[0].json()["error"]["code"] == "rate_limited"
    time.sleep(1.1)
    with tcp(base, slow) as h:
        assert h.get("/v1/health").status_code == 200          # the bucket refilled
    with tcp(base, one) as h:
        first = h.post("/v1/jobs", json={"pipeline": "nap"})
        assert first.status_code == 201
        second = h.post("/v1/jobs", json={"pipeline": "nap"})
        assert second.status_code == 429 and "Retry-After" in second.headers, second.text
        r = h.post("/v1/chat/completions", json={"model": "echo", "messages": CHAT})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert d.wait(first.json()["id"])["state"] == "succeeded"
        assert h.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"prompt": "again"}}).status_code == 201
    with tcp(base, slow) as h:                                # another key is not limited by this one
        assert h.post("/v1/jobs", json={"pipeline": "nap"}).status_code == 201


def test_cors_is_off_unless_an_origin_is_allowed(start_daemon: Callable[..., RunningDaemon]) -> None:
    closed, opened = free_port(), free_port()
    shut = _echo_daemon(start_daemon, listen=[f"127.0.0.1:{closed}"])
    preflight = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with tcp(f"http://127.0.0.1:{closed}") as h:
        r = h.options("/v1/chat/completions", headers=preflight)
        assert "Access-Control-Allow-Origin" not in r.headers and r.status_code == 401
    key = add_key(shut, "k", "--uid", "0")
    with tcp(f"http://127.0.0.1:{closed}", key) as h:
        assert "Access-Control-Allow-Origin" not in h.get("/v1/models", headers={"Origin": "https://chat.example"}).headers
    d = start_daemon(*echo_only(),
                     {"listen": [f"127.0.0.1:{opened}"], "allow_origins": ["https://chat.example"]})
    key = add_key(d, "k", "--uid", "0")
    with tcp(f"http://127.0.0.1:{opened}") as h:
        r = h.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == "https://chat.example"
        assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
        r = h.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in r.headers
    with tcp(f"http://127.0.0.1:{opened}", key) as h:
        r = h.get("/v1/models", headers={"Origin": "https://chat.example"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://chat.example"


def test_metrics_without_key_is_an_explicit_exemption(start_daemon: Callable[..., RunningDaemon]) -> None:
    port, metrics_port = free_port(), free_port()
    start_daemon(*echo_only(),
                 {"listen": [f"127.0.0.1:{port}"], "metrics_without_key": True,
                  "metrics_listen": f"127.0.0.1:{metrics_port}"})
    with tcp(f"http://127.0.0.1:{port}") as h:
        assert h.get("/metrics").status_code == 200 and "omnid" in h.get("/metrics").text
        assert h.get("/v1/jobs").status_code == 401                  # only /metrics
    with tcp(f"http://127.0.0.1:{metrics_port}") as h:
        assert h.get("/metrics").status_code == 200                  # metrics_listen keeps working


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate is not installed")
def test_socket_activation_hands_over_a_tcp_socket(tmp_path: Path) -> None:
    d = short_tmpdir()
    port = free_port()
    try:
        cfg = daemon_config(d, *echo_only())
        key = KeyStore(key_path(d / "state")).add("activated", os.getuid())[1]
        unix = d / "activation.sock"
        log = d / "omnid.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["systemd-socket-activate", "-l", str(unix), "-l", f"127.0.0.1:{port}",
                                     "-E", "PYTHONUNBUFFERED=1", "-E", f"PYTHONPATH={ROOT}",
                                     sys.executable, "-m", "omnid", "-c", str(cfg)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=str(d))
        try:
            wait_for(unix.is_socket, 15, "the activation socket")
            # The first connection, on the TCP socket, makes systemd-socket-activate exec omnid (same pid)
            with tcp(f"http://127.0.0.1:{port}", key) as h:
                health = h.get("/v1/health").json()
                assert health["pid"] == proc.pid, health
                wait_for(lambda: h.get("/v1/ready").status_code == 200, 60, "/v1/ready over TCP")
                job = h.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"prompt": "activated"}}).json()
            assert Client(str(unix)).wait(job["id"])["state"] == "succeeded"
            with tcp(f"http://127.0.0.1:{port}") as h:
                assert h.get("/v1/health").status_code == 401
            assert "via" in log.read_text() and f"127.0.0.1:{port}" in log.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_sighup_opens_and_closes_listen_addresses(start_daemon: Callable[..., RunningDaemon]) -> None:
    first, second = free_port(), free_port()
    stages, pipelines = echo_only()
    d = start_daemon(stages, pipelines, {"listen": [f"127.0.0.1:{first}"]})
    key = add_key(d, "k", "--uid", "0")
    pid = d.stages()["echo"]["pid"]

    def answers(port: int) -> bool:
        try:
            with tcp(f"http://127.0.0.1:{port}", key) as h:
                return h.get("/v1/health").status_code == 200
        except httpx.TransportError:
            return False

    assert answers(first) and not answers(second)
    daemon_config(d.dir, stages, pipelines, {"listen": [f"127.0.0.1:{second}"]})
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: answers(second) and not answers(first), 30, "the reload to move the listener")
    assert d.stages()["echo"]["pid"] == pid                  # nothing else restarted
    daemon_config(d.dir, stages, pipelines, {"listen": [f"0.0.0.0:{first}"]})   # (keys exist: allowed)
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: answers(first) and not answers(second), 30, "the reload to listen on 0.0.0.0")
