"""`KeyStore.match` compares the presented key with every stored key, whichever matches: no early
exit, so how long a lookup takes says nothing about which key (if any) it found."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest

from omnid.keys import KeyStore, key_path


def test_every_key_is_compared_whichever_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = KeyStore(key_path(tmp_path))
    made = [store.add(f"k{i}", 1000 + i) for i in range(4)]
    compared: list[str] = []
    real = hmac.compare_digest

    def counting(a: str, b: str) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr("omnid.keys.hmac.compare_digest", counting)
    for key, secret in made:                      # the first, the middle ones and the last
        compared.clear()
        assert store.match(secret) == key
        assert compared == [k.sha256 for k, _ in made], f"{key.name}: compared {len(compared)} of 4 keys"
    compared.clear()
    assert store.match("omk_not-a-key") is None
    assert len(compared) == 4
