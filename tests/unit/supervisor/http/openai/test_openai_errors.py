"""The OpenAI paths' error shape, in process (`omnid.supervisor.http.openai.common`): the `type` a
status gets, the answer's body and retry headers, and an error said inside a stream."""

from __future__ import annotations

import json

from omnid.supervisor.http.openai.common import OPENAI_PATHS, OpenAiError, bad, error_event


def test_the_type_follows_the_status() -> None:
    assert [OpenAiError(s, "m").type for s in (400, 401, 403, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error", "invalid_request_error",
        "invalid_request_error", "rate_limit_error", "server_error", "server_error"]
    assert OpenAiError(400, "m", type_="server_error").type == "server_error"     # given, kept


def test_the_answer_is_openais_shape_with_its_retry_headers() -> None:
    resp = OpenAiError(503, "busy", "model", "draining", retry=False).response()
    assert resp.status == 503
    assert json.loads(resp.body) == {"error": {"message": "busy", "type": "server_error", "param": "model",
                                               "code": "draining"}}
    assert resp.headers["x-should-retry"] == "false" and "Retry-After" in resp.headers
    assert "x-should-retry" not in OpenAiError(400, "no").response().headers


def test_bad_is_a_400_naming_its_field_and_a_stream_error_names_none() -> None:
    e = bad("messages[0].role", "wrong role", "invalid_value")
    assert (e.status, e.param, e.code, e.type, e.message) == (400, "messages[0].role", "invalid_value",
                                                              "invalid_request_error", "wrong role")
    assert error_event(e) == {"error": {"message": "wrong role", "type": "invalid_request_error", "param": None,
                                        "code": "invalid_value"}}
    assert "/v1/audio/speech".startswith(OPENAI_PATHS) and not "/v1/jobs".startswith(OPENAI_PATHS)
