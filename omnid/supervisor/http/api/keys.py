"""The socket API's keys: `POST /v1/keys`, `GET /v1/keys`, `DELETE /v1/keys/{name}`, the API keys of
the TCP listener (omnid/keys.py holds them; access.py, the TCP door, checks them and mounts these).
Root or `daemon.admin_group`, on the socket only (a key cannot mint keys). Root must name the key's
`uid` (no key is root by default); only root may make a key that acts as root.

Runs in the supervisor's event-loop thread; nothing blocks but the key file's one small atomic write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from omnid.keys import KeyStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.http.admission import json_body
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.access")

MAX_UID = 2**32 - 2


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
        """A new key: `{"name", "uid"?, "max_jobs"?, "rps"?}`; 201 with the key, shown this once."""
        caller = self._key_admin(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
        unknown = set(body) - {"name", "uid", "max_jobs", "rps", "admin"}
        if unknown:
            raise Refused(400, ErrorCode.INVALID_REQUEST, f"unknown field(s) {', '.join(sorted(unknown))}; "
                          "a key has name, uid, max_jobs, rps, admin")
        name = body.get("name")
        if not isinstance(name, str):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"name\" must name the key")
        if caller == 0 and "uid" not in body:
            # A key is never root by default: root says whom it stands for.
            raise Refused(400, ErrorCode.INVALID_REQUEST, "root must say which user the key acts as: \"uid\" "
                          "(omnictl key add NAME --uid UID); admin actions over TCP need --admin, not uid 0")
        admin = body.get("admin", False)
        if not isinstance(admin, bool):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"admin\" must be true or false")
        uid = body.get("uid", caller)
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid <= MAX_UID:
            raise Refused(400, ErrorCode.INVALID_REQUEST, f"\"uid\" must be a user id from 0 to {MAX_UID}")
        if uid == 0 and caller != 0:
            raise Refused(403, ErrorCode.NOT_ADMIN, "only root may make a key that acts as root (uid 0)")
        max_jobs = body.get("max_jobs")
        if max_jobs is not None and (isinstance(max_jobs, bool) or not isinstance(max_jobs, int)
                                     or not 1 <= max_jobs <= 1_000_000):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"max_jobs\" must be an integer from 1 to 1000000")
        rps = body.get("rps")
        if rps is not None and (isinstance(rps, bool) or not isinstance(rps, (int, float))
                                or not 0.001 <= rps <= 1_000_000):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"rps\" must be a number from 0.001 to 1000000")
        try:
            key, secret = self.keys.add(name, uid, max_jobs, None if rps is None else float(rps), admin)
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
