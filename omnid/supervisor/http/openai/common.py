"""The OpenAI paths' error shape: `{"error": {"message", "type", "param", "code"}}`, raised as an
`OpenAiError` and answered so by the `openai_errors` middleware, whatever failed under it.

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application (openai_api.py
mounts the middleware; realtime.py says an `OpenAiError` as an `error` event; the TCP door, access.py,
refuses in this shape on these paths). No I/O, no state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from omnid.supervisor.errors import Refused, retry_after

log = structlog.get_logger("omnid.openai")

OPENAI_PATHS = ("/v1/models", "/v1/chat/", "/v1/completions", "/v1/images/", "/v1/audio/", "/v1/realtime")


class OpenAiError(Exception):
    """A request refused or failed, answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry: bool | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _error_type(status)
        self.retry = retry
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        headers = retry_after(self.status, self.retry_after_s)
        if self.retry is not None:                  # the openai client library honours this header
            headers["x-should-retry"] = "true" if self.retry else "false"
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status, headers=headers)


def _error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def bad(param: str | None, message: str, code: str | None = None) -> OpenAiError:
    """A 400: the request's field `param` is wrong."""
    return OpenAiError(400, message, param, code)


def error_event(e: OpenAiError) -> dict[str, Any]:
    """A job that ended badly, said inside a stream already under way (as OpenAI's servers do)."""
    return {"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}}


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Errors on the OpenAI paths in OpenAI's shape (inside the API's own error middleware)."""
    if not request.path.startswith(OPENAI_PATHS):
        return await handler(request)
    try:
        return await handler(request)
    except OpenAiError as e:
        return e.response()
    except Refused as e:
        param = e.extra.get("input")
        return OpenAiError(e.status, e.message, param=param if isinstance(param, str) else None,
                           code=str(e.code), retry_after_s=e.extra.get("retry_after_s")).response()
    except web.HTTPRequestEntityTooLarge:
        return OpenAiError(413, "the request body is too large (daemon.max_request_bytes)", code="too_large").response()
    except web.HTTPNotFound:
        return OpenAiError(404, f"no such endpoint: {request.method} {request.path}", code="not_found").response()
    except web.HTTPMethodNotAllowed as e:
        resp = OpenAiError(405, f"{request.method} is not allowed on {request.path}; use "
                           f"{', '.join(sorted(e.allowed_methods))}", code="method_not_allowed").response()
        resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        return resp
    except web.HTTPException as e:
        return OpenAiError(e.status, e.reason, code="http_error").response()
    except ConnectionError as e:            # the caller hung up (its job is cancelled): nobody to answer
        log.debug("the caller went away", method=request.method, path=request.path, error=str(e))
        return web.Response(status=499)
    except Exception as e:
        log.exception("request failed", method=request.method, path=request.path)
        return OpenAiError(500, f"the daemon failed on this request: {type(e).__name__}: {e}",
                           code="internal_error").response()
