"""API keys for the TCP listener: who a request is when it carries no socket credentials.

A key stands for an owner uid (the socket knows a caller by SO_PEERCRED; TCP has no uid). Keys live
in `<state_dir>/api_keys.json`, mode 0600, written atomically (temporary file, fsync, rename). The
file holds each key's SHA-256, never the key: a key is 32 random bytes, so a plain hash is as
strong as a slow one would be, and the file leaks nothing a guess could use. A presented key is
hashed and compared with every stored hash in constant time (`hmac.compare_digest`, no early exit).

Standard library only. Used by the supervisor (its event-loop thread: a lookup is one `stat` of the
file, re-read when it changed, and a hash) and by the config check (`omnid --check`: are there
keys at all). Writing blocks on one small file's fsync.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from typing_extensions import TypedDict

from omnid import paths

KEYS_FILE = "api_keys.json"
KEY_PREFIX = "omk_"                 # so a leaked key is recognisable (secret scanners, logs)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"


class KeyFileError(Exception):
    """The key file cannot be read or written; the message names it."""


def key_path(state_dir: Path) -> Path:
    return state_dir / KEYS_FILE


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()  # pragma: no mutate (equivalent: "UTF-8" is the same codec)


class ApiKeyDoc(TypedDict):
    """An API key as `GET /v1/keys` shows it: everything but its hash."""

    name: str
    uid: int
    """the user the key acts as"""
    created: float
    hint: str
    """the key's first characters, to tell keys apart"""
    max_jobs: int | None
    """its jobs live at once (past it: 429)"""
    rps: float | None
    """requests a second (a token bucket of max(1, rps); past it: 429)"""
    admin: bool
    """it may do the admin actions over TCP (restart, sleep, wake, reload, others' jobs)"""


@dataclass(frozen=True)
class ApiKey:
    """One key as stored: its name, its owner uid, its hash and its optional limits."""

    name: str
    uid: int
    sha256: str
    created: float
    hint: str                       # the key's first characters, to tell keys apart in `key list`
    max_jobs: int | None = None     # jobs of this key live at once (past it: 429)
    rps: float | None = None        # requests per second (a token bucket of `max(1, rps)`; past it: 429)
    admin: bool = False             # may do the admin actions over TCP (restart, sleep, wake, reload, others' jobs)

    def to_doc(self) -> ApiKeyDoc:
        """What `GET /v1/keys` shows: everything but the hash."""
        return {"name": self.name, "uid": self.uid, "created": self.created, "hint": self.hint,
                "max_jobs": self.max_jobs, "rps": self.rps, "admin": self.admin}


def _from_doc(doc: Any) -> ApiKey:
    if not isinstance(doc, dict):
        raise ValueError("a key entry is not an object")
    return ApiKey(name=str(doc["name"]), uid=int(doc["uid"]), sha256=str(doc["sha256"]),
                  created=float(doc.get("created", 0.0)), hint=str(doc.get("hint", "")),
                  max_jobs=None if doc.get("max_jobs") is None else int(doc["max_jobs"]),
                  rps=None if doc.get("rps") is None else float(doc["rps"]), admin=doc.get("admin") is True)


def read_keys(path: Path) -> list[ApiKey]:
    """The keys in the file (none when there is no file); KeyFileError when it cannot be read."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise KeyFileError(f"cannot read the API keys in {path}: {e.strerror or e}") from None
    try:
        return [_from_doc(d) for d in json.loads(raw).get("keys", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise KeyFileError(f"{path} is not a valid key file ({e}); fix or remove it") from None


class KeyStore:
    """The daemon's keys: looked up on every TCP request, changed by `omnictl key add/rm`.

    The file is the truth: it is re-read when its mtime, size or inode changed, so a key removed
    by hand (or by a second tool) is gone for the next request too.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # (refresh, just below, sets both: any start values are equivalent)
        self._keys: list[ApiKey] = []                           # pragma: no mutate
        self._seen: tuple[int, int, int] | None = None          # pragma: no mutate
        self.refresh()

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
            seen: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None         # pragma: no mutate (equivalent: any constant; with no file there is nothing to read)
        except OSError as e:
            raise KeyFileError(f"cannot read the API keys in {self.path}: {e.strerror or e}") from None
        if seen != self._seen or seen is None:
            self._keys = read_keys(self.path)
            self._seen = seen

    def all(self) -> list[ApiKey]:
        self.refresh()
        return list(self._keys)

    def match(self, secret: str) -> ApiKey | None:
        """The key whose hash is the secret's, compared with every key in constant time."""
        self.refresh()
        wanted = digest(secret)
        found: ApiKey | None = None
        for key in self._keys:
            if hmac.compare_digest(key.sha256, wanted):
                found = key
        return found

    def add(self, name: str, uid: int, max_jobs: int | None = None, rps: float | None = None,
            admin: bool = False) -> tuple[ApiKey, str]:
        """A new key: returns it and its secret, which is never stored nor shown again.
        ValueError when the name is taken or not valid."""
        if not _NAME.match(name):
            raise ValueError(f"a key name is {NAME_RULE}, not {name!r}")
        keys = self.all()
        if any(k.name == name for k in keys):
            raise ValueError(f"there is a key {name!r} already; remove it first (omnictl key rm {name})")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(name=name, uid=uid, sha256=digest(secret), created=round(time.time(), 3),
                     hint=secret[:len(KEY_PREFIX) + 4], max_jobs=max_jobs, rps=rps, admin=admin)
        self._write([*keys, key])
        return key, secret

    def remove(self, name: str) -> ApiKey | None:
        """Remove the key named `name`; None when there is none."""
        keys = self.all()
        gone = next((k for k in keys if k.name == name), None)
        if gone is not None:
            self._write([k for k in keys if k.name != name])
        return gone

    def _write(self, keys: list[ApiKey]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=paths.PRIVATE_DIR)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        data = json.dumps({"keys": [asdict(k) for k in keys]}, indent=1).encode()
        try:
            # (the fchmod below sets the mode whatever os.open made)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, paths.PRIVATE_FILE)  # pragma: no mutate
            os.fchmod(fd, paths.PRIVATE_FILE)        # (an old temporary file keeps its mode otherwise)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise KeyFileError(f"cannot write the API keys to {self.path}: {e.strerror or e}") from None
        self._keys = keys
        st = os.stat(self.path)
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)
