"""The socket API's keys: `POST /v1/keys`, `GET /v1/keys`, `DELETE /v1/keys/{name}`, the API keys of
the TCP listener (omnid/keys.py holds them; access.py, the TCP door, checks them and mounts these).
Root or `daemon.admin_group`, on the socket only (a key cannot mint keys). Root must name the key's
`uid` (no key is root by default); only root may make a key that acts as root.

Runs in the supervisor's event-loop thread; nothing blocks but the key file's one small atomic write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import structlog
from aiohttp import web
from pydantic import ConfigDict, Field, ValidationError

from omnid.keys import NAME_PATTERN, NAME_RULE, KeyStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.http.admission import CheckedBody, Said, fixed, json_body
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.access")

MAX_UID = 2**32 - 2


class KeyRequest(CheckedBody):
    """`POST /v1/keys`: a new API key. root must give `uid` (no key is root by default)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    MESSAGES: ClassVar[Said] = {
        ("name",): (fixed(f"\"name\" must name the key: {NAME_RULE}"), None),
        ("uid",): (fixed(f"\"uid\" must be a user id from 0 to {MAX_UID}"), None),
        ("max_jobs",): (fixed("\"max_jobs\" must be an integer from 1 to 1000000"), None),
        ("rps",): (fixed("\"rps\" must be a number from 0.001 to 1000000"), None),
        ("admin",): (fixed("\"admin\" must be true or false"), None),
    }

    name: str = Field(pattern=NAME_PATTERN)
    uid: int | None = Field(None, ge=0, le=MAX_UID, description="the user the key acts as (null: the caller's; root "
                            "must give it)")
    max_jobs: int | None = Field(None, ge=1, le=1_000_000, description="its jobs live at once (past it: 429)")
    rps: float | None = Field(None, ge=0.001, le=1_000_000,
                              description="requests a second (a token bucket of max(1, rps); past it: 429)")
    admin: bool = Field(False, description="the key may do the admin actions over TCP")


class Keys:
    """The key commands' handlers; `forget` drops a removed key's use at the door."""

    def __init__(self, api: ApiCore, keys: KeyStore, forget: Callable[[str], None]) -> None:
        self.api, self.keys, self.forget = api, keys, forget

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/keys", self.list_keys),
                web.post("/v1/keys", self.add_key),
                web.delete("/v1/keys/{name}", self.remove_key)]

    def _key_admin(self, request: web.Request) -> int:
        if request.get("tcp"):                # (access.py's TCP mark)
            raise Refused(403, ErrorCode.SOCKET_ONLY, "API keys are managed over the Unix socket only "
                          "(omnictl key ...), not with a key")
        uid: int = request["uid"]
        self.api.check_admin(uid)
        return uid

    async def list_keys(self, request: web.Request) -> web.Response:
        """The keys (never their secrets nor hashes); root or the admin group."""
        self._key_admin(request)
        return web.json_response({"keys": [k.to_doc() for k in self.keys.all()],
                                  "file": str(self.keys.path)})

    async def add_key(self, request: web.Request) -> web.Response:
        """A new key (`KeyRequest`); 201 with the key, shown this once."""
        caller = self._key_admin(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
        try:
            asked = KeyRequest.model_validate(body)
        except ValidationError as e:
            said = KeyRequest.problems(e, body)
            raise Refused(400, ErrorCode.INVALID_REQUEST, "; ".join(dict.fromkeys(m for _, m in said))) from None
        if asked.uid is None and caller == 0:
            # A key is never root by default: root says whom it stands for.
            raise Refused(400, ErrorCode.INVALID_REQUEST, "root must say which user the key acts as: \"uid\" "
                          "(omnictl key add NAME --uid UID); admin actions over TCP need --admin, not uid 0")
        name, max_jobs, rps, admin = asked.name, asked.max_jobs, asked.rps, asked.admin
        uid = caller if asked.uid is None else asked.uid
        if uid == 0 and caller != 0:
            raise Refused(403, ErrorCode.NOT_ADMIN, "only root may make a key that acts as root (uid 0)")
        try:
            key, secret = self.keys.add(name, uid, max_jobs, rps, admin)
        except ValueError as e:
            if any(k.name == name for k in self.keys.all()):
                raise Refused(409, ErrorCode.KEY_EXISTS, str(e)) from None
            raise Refused(400, ErrorCode.INVALID_REQUEST, str(e)) from None
        log.info("audit", action="key_add", uid=caller, name=key.name, key_uid=key.uid, max_jobs=max_jobs, rps=rps,
                 admin=admin)
        return web.json_response({**key.to_doc(), "key": secret}, status=201)

    async def remove_key(self, request: web.Request) -> web.Response:
        caller = self._key_admin(request)
        name = request.match_info["name"]
        gone = self.keys.remove(name)
        if gone is None:
            raise Refused(404, ErrorCode.UNKNOWN_KEY, f"no key {name!r}; known: "
                          f"{', '.join(k.name for k in self.keys.all()) or 'none'}")
        self.forget(name)
        log.info("audit", action="key_rm", uid=caller, name=name, key_uid=gone.uid)
        return web.json_response({"removed": name})
