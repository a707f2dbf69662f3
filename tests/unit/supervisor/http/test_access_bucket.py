"""A key's `rps` token bucket (omnid/supervisor/http/access.py): a request takes a whole token; a
bucket holding part of one refuses, and says how long until the token is whole (in-process, the
clock is the test's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from omnid.keys import ApiKey, KeyStore, key_path
from omnid.supervisor.http.access import Access


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("omnid.supervisor.http.access.time.monotonic", c)
    return c


def door(tmp_path: Path) -> Access:
    return Access(cast(Any, None), KeyStore(key_path(tmp_path)))     # the bucket needs no API


def key(rps: float) -> ApiKey:
    return ApiKey(name="web", uid=1000, sha256="0" * 64, created=0.0, hint="omk_", rps=rps)


def test_a_part_of_a_token_is_no_request(tmp_path: Path, clock: Clock) -> None:
    a, k = door(tmp_path), key(1.0)
    assert a._over_rate(k) is None                 # the bucket starts full: one token
    assert a._over_rate(k) == 1                    # empty: wait a second
    clock.now += 0.5                               # half a token back
    assert a._over_rate(k) == 1, "a request went through on half a token"
    clock.now += 0.4                               # 0.9 of a token
    assert a._over_rate(k) == 1
    clock.now += 0.1                               # a whole token
    assert a._over_rate(k) is None
    assert a._over_rate(k) == 1


def test_a_slow_key_waits_for_its_whole_token(tmp_path: Path, clock: Clock) -> None:
    a, k = door(tmp_path), key(0.25)               # one request every 4 s; the bucket holds 1
    assert a._over_rate(k) is None
    for _ in range(3):
        clock.now += 1.0
        wait = a._over_rate(k)
        assert wait is not None and 1 <= wait <= 3, wait
    clock.now += 1.0                               # 4 s since the first: a whole token
    assert a._over_rate(k) is None


def test_a_burst_takes_as_many_requests_as_the_bucket_holds(tmp_path: Path, clock: Clock) -> None:
    a, k = door(tmp_path), key(3.0)
    assert [a._over_rate(k) for _ in range(4)] == [None, None, None, 1]
    clock.now += 0.2                               # 0.6 of a token
    assert a._over_rate(k) == 1
    clock.now += 0.2                               # 1.2 tokens: one request, 0.2 left
    assert a._over_rate(k) is None
    assert a._over_rate(k) == 1
