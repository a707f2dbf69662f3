"""Discovery and the OpenAPI document, against a real daemon: `GET /v1/pipelines/{name}`,
`GET /v1/openapi.json` with every registered route in it, and REAL responses checked against the
document's schemas (jsonschema, draft 2020-12, as OpenAPI 3.1 uses); also the 201's `Location`
header and the 404 message for a job id prefix under 4 characters.

One daemon for the module (python stages of tests/fixtures/teststages.py, about a second to
start). Requests go over `omnictl.client.UnixHTTPConnection`, so the status and headers can be
read. Every wait is bounded. About 3 s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from conftest import RunningDaemon, module_daemon, py_stage, short_tmpdir

from omnictl.client import UnixHTTPConnection
from omnid.vocabulary import ErrorCode, JobState

STAGES = {
    "words": py_stage("count", defaults={"n": 3, "delay": 0.01}),
    "tag": py_stage("echo", defaults={"tag": "b"}),
}
PIPELINES = {
    "stream": {"stages": ["words", "tag"], "edges": [{"from": "words", "to": "tag", "window": 2}]},
    "one": {"stages": ["tag"]},
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with module_daemon(short_tmpdir(), STAGES, PIPELINES, ready_timeout=60, forbid_in_log=("request failed",)) as rd:
        yield rd


def call(d: RunningDaemon, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    conn = UnixHTTPConnection(str(d.socket), timeout=10)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"} if payload else {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def openapi(daemon: RunningDaemon) -> dict[str, Any]:
    status, headers, raw = call(daemon, "GET", "/v1/openapi.json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    doc = json.loads(raw)
    assert doc["openapi"].startswith("3.1")
    return doc


def schema_of(doc: dict[str, Any], method: str, path: str, status: int, content: str = "application/json") -> Any:
    """The response schema the document gives, resolvable on its own (components beside it)."""
    responses = doc["paths"][path][method.lower()]["responses"]
    response = responses.get(str(status)) or responses["default"]
    if "$ref" in response:
        response = doc["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return {**response["content"][content]["schema"], "components": doc["components"]}


def check(doc: dict[str, Any], method: str, path: str, status: int, body: Any) -> None:
    jsonschema.Draft202012Validator(schema_of(doc, method, path, status)).validate(body)


def test_pipeline_discovery(daemon: RunningDaemon) -> None:
    status, _, raw = call(daemon, "GET", "/v1/pipelines/stream")
    assert status == 200
    doc = json.loads(raw)
    listed = next(p for p in daemon.client.pipelines()["pipelines"] if p["name"] == "stream")
    assert {k: doc[k] for k in listed} == listed                     # the listing's fields, unchanged
    assert doc["edges"] == [{"from": "words", "to": "tag", "window": 2, "map": None, "transform": None}]
    assert doc["inputs"]["words"]["known"] is False and "unknown" in doc["inputs"]["words"]["note"]
    assert doc["params"]["words"] == {"engine": "python", "accepts": "any (the function reads what it wants)",
                                      "params": {"n": {"default": 3}, "delay": {"default": 0.01}}}
    assert doc["params"]["tag"]["params"] == {"tag": {"default": "b"}}
    assert list(doc["outputs"]) == ["tag"] and doc["outputs"]["tag"]["known"] is False
    assert daemon.client.pipeline("stream") == doc

    status, _, raw = call(daemon, "GET", "/v1/pipelines/nope")
    assert status == 404
    assert json.loads(raw)["error"]["code"] == ErrorCode.UNKNOWN_PIPELINE
    assert "known: one, stream" in json.loads(raw)["error"]["message"]


def test_every_registered_route_is_documented(daemon: RunningDaemon, openapi: dict[str, Any]) -> None:
    # The app as the daemon builds it (its collaborators are not needed to register the routes).
    from omnid.config import load
    from omnid.keys import KeyStore
    from omnid.supervisor.http.access import Access
    from omnid.supervisor.http.api.app import Api, DaemonInfo
    from omnid.supervisor.http.openai.realtime.session import RealtimeApi
    from omnid.supervisor.http.openai.routes import OpenAiApi
    from omnid.supervisor.http.openapi import openapi_document
    from omnid.supervisor.live import Live
    api = Api(Live(load(daemon.config_path)), None, None, {}, None, DaemonInfo(os.getpid(), 0.0, "x"))  # type: ignore[arg-type]
    OpenAiApi(api).mount(api.app)
    RealtimeApi(api).mount(api.app)
    Access(api, KeyStore(daemon.dir / "no-keys.json")).mount(api.app)
    registered = {(r.method.lower(), r.resource.canonical) for r in api.app.router.routes()
                  if r.resource is not None and r.method != "HEAD"}
    assert len(registered) >= 15
    for doc in (openapi, openapi_document(api.app, api.config, "x")):
        documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert registered <= documented, registered - documented
        assert documented <= registered, documented - registered
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and op["responses"], (method, path)
            for status in op["responses"]:
                for content in ("application/json", "application/x-ndjson"):
                    try:
                        schema = schema_of(openapi, method, path, int(status) if status.isdigit() else 599, content)
                    except KeyError:
                        continue
                    jsonschema.Draft202012Validator.check_schema(schema)


def test_real_responses_match_the_document(daemon: RunningDaemon, openapi: dict[str, Any]) -> None:
    request = {"pipeline": "stream", "inputs": {"prompt": "x"}, "params": {"words": {"n": 4}}, "timeout_s": 30}
    jsonschema.Draft202012Validator({"$ref": "#/components/schemas/JobRequest",
                                     "components": openapi["components"]}).validate(request)
    status, headers, raw = call(daemon, "POST", "/v1/jobs", request)
    assert status == 201, raw
    job = json.loads(raw)
    check(openapi, "POST", "/v1/jobs", 201, job)
    assert headers["location"] == f"/v1/jobs/{job['id']}"
    for event in daemon.events(job["id"], timeout=30):
        jsonschema.Draft202012Validator({**openapi["components"]["schemas"]["Event"],
                                         "components": openapi["components"]}).validate(event)
    final = daemon.client.job(job["id"])
    assert final["state"] == JobState.SUCCEEDED and final["outputs"]

    for path, route in ((f"/v1/jobs/{job['id']}", "/v1/jobs/{id}"), ("/v1/jobs", "/v1/jobs"),
                        ("/v1/pipelines", "/v1/pipelines"), ("/v1/pipelines/one", "/v1/pipelines/{name}"),
                        ("/v1/stages", "/v1/stages"), ("/v1/health", "/v1/health"), ("/v1/ready", "/v1/ready")):
        status, _, raw = call(daemon, "GET", path)
        assert status == 200, (path, raw)
        check(openapi, "GET", route, 200, json.loads(raw))

    # Errors: a 400 (a bad parameter value, refused at the door) and 404s.
    status, _, raw = call(daemon, "POST", "/v1/jobs", {"pipeline": "one", "params": {"nope": {}}})
    assert status == 400
    check(openapi, "POST", "/v1/jobs", 400, json.loads(raw))
    for path, route in (("/v1/jobs/ffffffffffff", "/v1/jobs/{id}"), ("/v1/pipelines/nope", "/v1/pipelines/{name}")):
        status, _, raw = call(daemon, "GET", path)
        assert status == 404
        check(openapi, "GET", route, 404, json.loads(raw))
    status, _, raw = call(daemon, "DELETE", f"/v1/jobs/{job['id']}")
    assert status == 200
    check(openapi, "DELETE", "/v1/jobs/{id}", 200, json.loads(raw))


def test_short_prefix_says_why(daemon: RunningDaemon) -> None:
    job = daemon.submit("one", {"text": "x"})
    daemon.wait(job, timeout=30)
    for ref in (job[:3], job[:1]):
        status, _, raw = call(daemon, "GET", f"/v1/jobs/{ref}")
        assert status == 404
        error = json.loads(raw)["error"]
        assert error["code"] == ErrorCode.UNKNOWN_JOB
        assert error["message"] == f"no job {ref!r}: job id prefixes need at least 4 characters"
    status, _, raw = call(daemon, "GET", f"/v1/jobs/{job[:4]}")
    assert status == 200 and json.loads(raw)["id"] == job
    status, _, raw = call(daemon, "GET", "/v1/jobs/zzzzzz")          # long enough, just unknown
    assert json.loads(raw)["error"]["message"] == "no job 'zzzzzz'"


def test_405_says_allow_and_openai_errors_are_documented(daemon: RunningDaemon, openapi: dict[str, Any]) -> None:
    for path in ("/v1/jobs", "/v1/chat/completions", "/v1/health"):
        status, headers, raw = call(daemon, "PUT", path)
        assert status == 405 and headers["allow"], (path, headers)      # RFC 9110
        allowed = {m.upper() for m in openapi["paths"][path]}
        assert set(headers["allow"].split(", ")) <= allowed | {"HEAD"}, (headers["allow"], allowed)
    status, _, raw = call(daemon, "GET", "/v1/models/nope")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    check(openapi, "GET", "/v1/models/{model}", 404, json.loads(raw))   # in the error-code enum
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/images/generations", "/v1/audio/speech"):
        assert openapi["paths"][path]["post"]["requestBody"]["required"] is True, path
        status, _, raw = call(daemon, "POST", path)                     # no body: refused, as documented
        assert status == 400
        check(openapi, "POST", path, 400, json.loads(raw))
    logs = openapi["paths"]["/v1/logs"]["get"]
    assert "x-omnid-stream" in logs["responses"]["200"]
    since = next(p for p in logs["parameters"] if p["name"] == "since")["schema"]
    assert since["pattern"]
    import re
    for good in ("", "10m", "1h30m", "1764474442.5", "2026-11-30T03:47:22Z"):
        assert re.match(since["pattern"], good), good
    for bad in ("soon", "2026-13-01", "-5"):
        assert not re.match(since["pattern"], bad), bad
        status, _, raw = call(daemon, "GET", f"/v1/logs?since={bad}")
        assert status == 400, (bad, raw)
