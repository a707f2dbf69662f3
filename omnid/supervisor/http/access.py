"""The TCP listener's door: API keys, per-key limits and CORS, in front of the socket's application.

Runs in the supervisor's event-loop thread, as the innermost middleware of the API's aiohttp
application (the daemon mounts it after the OpenAI paths: `Access(api, keys).mount(api.app)`), so
its 401 and 429 answers come in OpenAI's error shape on the OpenAI paths and in omnid's elsewhere.
Nothing here blocks but a key lookup (one `stat` of the key file, see omnid/keys.py) and, for
`POST /v1/keys` and `DELETE`, one small atomic write.

- On the Unix socket the caller is its peer's uid (the API's error middleware read SO_PEERCRED);
  nothing here applies.
- Over TCP a request carries `Authorization: Bearer KEY` or `x-api-key: KEY`. The key stands for
  its owner uid: the request then is that uid's, as on the socket. No key or a wrong one: 401.
  `daemon.metrics_without_key` lets `GET /metrics` in without one.
- A key may have limits: `rps` (a token bucket holding `max(1, rps)` requests) and `max_jobs` (its
  jobs live at once, counting the OpenAI requests in flight). Past either: 429 with Retry-After.
- CORS is off: no answer carries `Access-Control-*` unless `daemon.allow_origins` lists the
  caller's `Origin` (or `"*"`); then preflights are answered and answers carry the headers.
- The key's name is bound into the log context of the request (structlog contextvars), so every
  audit line it causes names the key. A key itself is never logged.
- `POST /v1/keys`, `GET /v1/keys`, `DELETE /v1/keys/{name}`: api/keys.py's, mounted here.
- Over TCP only a key made with `admin` may do the admin actions (restart, sleep, wake a stage,
  reload, logs, others' jobs), whatever its uid (api/core.py's `admin`); others get 403 `not_admin`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from omnid.keys import ApiKey, KeyFileError, KeyStore
from omnid.supervisor.errors import RETRY_AFTER_S
from omnid.supervisor.http.api.core import error
from omnid.supervisor.http.api.keys import Keys
from omnid.supervisor.http.openai.common import OPENAI_PATHS, OpenAiError
from omnid.supervisor.http.openai.realtime import events as realtime_events
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.access")

KEY_NAME = "api_key"            # request[KEY_NAME]: the name of the key a TCP request came with
KEY_ADMIN = "api_key_admin"     # request[KEY_ADMIN]: the key was made with --admin (api/core.py's `admin`)
TCP = "tcp"                     # request[TCP]: True for a request that came over TCP
_SUBMITS = {"/v1/jobs", "/v1/chat/completions", "/v1/completions", "/v1/images/generations", "/v1/audio/speech"}
_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)
CORS_MAX_AGE_S = 600
_CORS_METHODS = "GET, POST, DELETE, OPTIONS"
_CORS_HEADERS = "Authorization, Content-Type, X-Api-Key, OpenAI-Organization, OpenAI-Project"
_CORS_EXPOSE = "X-Omnid-Job, X-Omnid-Queue-Position, X-Omnid-Estimated-Start, Retry-After, Location"


@dataclass
class _Usage:
    """One key's use, in this daemon's memory: its token bucket and its live jobs."""

    tokens: float
    stamp: float
    inflight: int = 0                          # its submit requests being answered now
    jobs: set[str] = field(default_factory=set)  # jobs it created by POST /v1/jobs (they outlive the request)


class Access:
    """The door of the TCP listener."""

    def __init__(self, api: ApiCore, keys: KeyStore) -> None:
        self.api = api
        self.keys = keys
        self._usage: dict[str, _Usage] = {}

    def mount(self, app: web.Application) -> None:
        app.middlewares.append(self.middleware)
        app.on_response_prepare.append(self._cors_headers)
        app.add_routes(Keys(self.api, self.keys, self.forget).routes())     # the key commands (api/keys.py)

    def forget(self, name: str) -> None:
        """A removed key's use (its bucket, its live jobs) is forgotten."""
        self._usage.pop(name, None)

    # ------------------------------------------------------------------ the door

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if "uid" in request:                # the Unix socket: its peer's uid is known
            return await handler(request)
        request[TCP] = True
        cfg = self.api.config.daemon
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and self._origin_allowed(origin) \
                and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204)          # a preflight carries no key (headers: _cors_headers)
        if request.path == "/metrics" and cfg.metrics_without_key:
            return await handler(request)            # (it reads no uid)
        key = self._identify(request)
        if key is None and realtime_events.is_upgrade(request):      # a WebSocket: an error event and a close
            return await realtime_events.refuse(request, ErrorCode.INVALID_API_KEY, "no API key, or not one "
                                                "of this daemon's: send it as \"Authorization: Bearer KEY\"",
                                                realtime_events.CLOSE_POLICY, "invalid_request_error", 401)
        if key is None:
            return _refuse(request, 401, ErrorCode.INVALID_API_KEY, "no API key, or not one of this daemon's: "
                           "send it as \"Authorization: Bearer KEY\" (omnictl key add NAME makes one)",
                           {"WWW-Authenticate": 'Bearer realm="omnid"'})
        request["uid"] = key.uid
        request[KEY_NAME] = key.name
        request[KEY_ADMIN] = key.admin
        with structlog.contextvars.bound_contextvars(key=key.name):
            wait = self._over_rate(key)
            if wait is not None:
                log.info("refused", why="rate", rps=key.rps, method=request.method, path=request.path)
                if realtime_events.is_upgrade(request):
                    return await realtime_events.refuse(request, ErrorCode.RATE_LIMITED, f"key {key.name!r} "
                                                        f"may make {key.rps:g} request(s) per second",
                                                        realtime_events.CLOSE_TRY_LATER, "rate_limit_error", 429)
                return _refuse(request, 429, ErrorCode.RATE_LIMITED, f"key {key.name!r} may make {key.rps:g} "
                               "request(s) per second", {"Retry-After": str(wait)})
            if request.method != "POST" or request.path not in _SUBMITS:
                return await handler(request)
            usage = self._usage_of(key)
            live = self.api.scheduler.live_jobs
            usage.jobs = {j for j in usage.jobs if j in live}
            if key.max_jobs is not None and usage.inflight + len(usage.jobs) >= key.max_jobs:
                log.info("refused", why="max_jobs", max_jobs=key.max_jobs, method=request.method, path=request.path)
                return _refuse(request, 429, ErrorCode.RATE_LIMITED, f"key {key.name!r} has {key.max_jobs} job(s) "
                               "running or queued already, as many as it may", {"Retry-After": str(RETRY_AFTER_S)})
            usage.inflight += 1
            try:
                resp = await handler(request)
                location = resp.headers.get("Location", "") if request.path == "/v1/jobs" else ""
                if resp.status == 201 and location.startswith("/v1/jobs/"):
                    usage.jobs.add(location.rpartition("/")[2])
                return resp
            finally:
                usage.inflight -= 1

    def _identify(self, request: web.Request) -> ApiKey | None:
        auth = request.headers.get("Authorization")
        secret: str | None = None
        if auth is not None:
            m = _BEARER.match(auth)
            secret = m.group(1) if m else None
        if secret is None:
            secret = request.headers.get("x-api-key") or None
        try:
            key = self.keys.match(secret) if secret else None
        except KeyFileError as e:           # (a broken file lets nobody in, and says why)
            log.error("cannot read the API keys", error=str(e))
            key = None
        if key is None:
            log.info("audit", action="refused", why="wrong key" if secret else "no key", peer=request.remote,
                     method=request.method, path=request.path)
        return key

    def _usage_of(self, key: ApiKey) -> _Usage:
        usage = self._usage.get(key.name)
        if usage is None:
            usage = self._usage[key.name] = _Usage(tokens=max(1.0, key.rps or 1.0), stamp=time.monotonic())
        return usage

    def _over_rate(self, key: ApiKey) -> int | None:
        """Take one request from the key's bucket; the seconds to wait when it is empty."""
        if key.rps is None:
            return None
        usage = self._usage_of(key)
        now = time.monotonic()
        usage.tokens = min(max(1.0, key.rps), usage.tokens + (now - usage.stamp) * key.rps)
        usage.stamp = now
        if usage.tokens >= 1.0:
            usage.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - usage.tokens) / key.rps))

    # ------------------------------------------------------------------ CORS

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.api.config.daemon.allow_origins
        return "*" in allowed or origin in allowed

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not request.get(TCP) or not origin or not self._origin_allowed(origin):
            return
        h = response.headers
        h["Access-Control-Allow-Origin"] = "*" if "*" in self.api.config.daemon.allow_origins else origin
        h["Vary"] = "Origin"
        h["Access-Control-Expose-Headers"] = _CORS_EXPOSE
        if request.method == "OPTIONS":
            h["Access-Control-Allow-Methods"] = _CORS_METHODS
            h["Access-Control-Allow-Headers"] = _CORS_HEADERS
            h["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)

def _refuse(request: web.Request, status: int, code: ErrorCode, message: str, headers: dict[str, str]) -> web.Response:
    """A refusal at the door, in the error shape of the path asked for."""
    if request.path.startswith(OPENAI_PATHS):
        resp = OpenAiError(status, message, code=str(code)).response()
    else:
        resp = error(status, code, message)
    resp.headers.update(headers)
    return resp

