"""`omnid.keys` (the TCP listener's API keys) and the `[daemon] listen` rules of the config."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from omnid.config import ConfigError, is_loopback, parse
from omnid.keys import KEY_PREFIX, KeyFileError, KeyStore, digest, key_path, read_keys


def test_a_key_is_shown_once_and_stored_as_its_hash(tmp_path: Path) -> None:
    store = KeyStore(key_path(tmp_path / "state"))
    key, secret = store.add("webui", 1000, max_jobs=4, rps=2.5)
    assert secret.startswith(KEY_PREFIX) and len(secret) > 40
    path = key_path(tmp_path / "state")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert secret not in text and digest(secret) in text
    assert store.match(secret) == key and key.uid == 1000 and key.max_jobs == 4 and key.rps == 2.5
    assert store.match(secret + "x") is None and store.match("") is None
    assert "sha256" not in key.to_doc() and key.to_doc()["hint"] == secret[:len(KEY_PREFIX) + 4]
    assert read_keys(path) == [key]                     # as a second reader sees it


def test_names_are_checked_and_unique(tmp_path: Path) -> None:
    store = KeyStore(key_path(tmp_path))
    store.add("a.b-c_1", 0)
    with pytest.raises(ValueError, match="already"):
        store.add("a.b-c_1", 0)
    for bad in ("", "-x", "a/b", "a b", "x" * 65):
        with pytest.raises(ValueError, match="key name"):
            store.add(bad, 0)


def test_removing_and_editing_the_file_take_effect_at_the_next_lookup(tmp_path: Path) -> None:
    path = key_path(tmp_path)
    store = KeyStore(path)
    _, one = store.add("one", 1)
    _, two = store.add("two", 2)
    assert store.remove("one") is not None and store.remove("one") is None
    assert store.match(one) is None and store.match(two) is not None
    other = KeyStore(path)                               # another writer (a second tool, or by hand)
    other.remove("two")
    assert store.match(two) is None
    path.write_text("{not json")
    with pytest.raises(KeyFileError, match=str(path)):
        store.match(two)


def test_a_keys_admin_flag_and_limits_are_what_the_file_says_after_a_restart(tmp_path: Path) -> None:
    """A daemon that starts again (or a second reader) knows its keys from the file alone: only a
    key written with `admin` true is admin; a hand-edited entry with any other value is not."""
    path = key_path(tmp_path)
    store = KeyStore(path)
    _, plain = store.add("plain", 1, max_jobs=2)
    _, boss = store.add("boss", 0, rps=1.5, admin=True)
    again = KeyStore(path)                               # the daemon restarted: nothing in memory
    assert again.match(plain).admin is False and again.match(boss).admin is True    # type: ignore[union-attr]
    assert again.match(plain).max_jobs == 2 and again.match(boss).rps == 1.5        # type: ignore[union-attr]
    doc = json.loads(path.read_text())
    doc["keys"][0]["admin"] = "yes"                      # by hand: not the JSON true
    del doc["keys"][1]["admin"]
    path.write_text(json.dumps(doc))
    assert [k.admin for k in read_keys(path)] == [False, False]


def test_no_file_is_no_keys_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    store = KeyStore(key_path(tmp_path / "missing"))
    assert store.all() == [] and store.match("omk_x") is None
    store.add("k", 0)
    assert sorted(os.listdir(tmp_path / "missing")) == ["api_keys.json"]
    assert json.loads(key_path(tmp_path / "missing").read_text())["keys"][0]["name"] == "k"


@pytest.mark.parametrize("host, loop", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True),
                                        ("localhost", True), ("0.0.0.0", False), ("::", False),
                                        ("10.0.0.5", False), ("example.com", False)])
def test_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def _config(tmp_path: Path, **daemon: object) -> dict[str, object]:
    return {"daemon": {"state_dir": str(tmp_path / "state"), **daemon},
            "stages": {"s": {"engine": "python", "function": "os:getcwd"}}, "pipelines": {"p": {"stages": ["s"]}}}


def test_listen_is_a_list_of_addresses_and_wide_ones_need_keys(tmp_path: Path) -> None:
    cfg = parse(_config(tmp_path, listen=["127.0.0.1:8080", "[::1]:8080"]), base=tmp_path)
    assert cfg.daemon.listen == (("127.0.0.1", 8080), ("::1", 8080)) and cfg.daemon.allow_origins == ()
    assert parse(_config(tmp_path), base=tmp_path).daemon.listen == ()             # off by default
    with pytest.raises(ConfigError) as e:
        parse(_config(tmp_path, listen=["0.0.0.0:8080"]), base=tmp_path)
    (problem,) = e.value.problems
    assert problem.path == "daemon.listen" and str(key_path(tmp_path / "state")) in problem.message
    KeyStore(key_path(tmp_path / "state")).add("first", 0)
    assert parse(_config(tmp_path, listen=["0.0.0.0:8080"]), base=tmp_path).daemon.listen == (("0.0.0.0", 8080),)
    with pytest.raises(ConfigError) as e:
        parse(_config(tmp_path, listen=["8080", 80, "127.0.0.1:1", "127.0.0.1:1"],
                      allow_origins=["https://a.example/path", "*", "https://b.example"]), base=tmp_path)
    paths = sorted(p.path for p in e.value.problems)
    assert paths == ["daemon.allow_origins[0]", "daemon.listen[0]", "daemon.listen[1]", "daemon.listen[3]"], paths


def test_what_a_key_shows_and_how_the_file_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import time

    monkeypatch.setattr(time, "time", lambda: 1234.56789)
    path = tmp_path / "a" / "b" / "keys.json"                    # its folders are made, private
    key, secret = KeyStore(path).add("ops", 7, max_jobs=2, rps=0.5, admin=True)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(secret) == len(KEY_PREFIX) + 43                    # 32 random bytes, base64url
    assert key.to_doc() == {"name": "ops", "uid": 7, "created": 1234.568, "hint": secret[:8], "max_jobs": 2,
                            "rps": 0.5, "admin": True}
    assert path.read_text().startswith('{\n "keys": [\n  {\n   "name": "ops",')      # one field a line
    assert digest("\udcff") == hashlib.sha256(b"\xff").hexdigest()    # a secret of undecodable bytes still matches
    # what the file may leave out
    path.write_text(json.dumps({"keys": [{"name": "old", "uid": 1, "sha256": "ab"}]}))
    assert [k.to_doc() for k in read_keys(path)] == [{"name": "old", "uid": 1, "created": 0.0, "hint": "",
                                                      "max_jobs": None, "rps": None, "admin": False}]
    path.write_text("{}")
    assert read_keys(path) == []
    path.write_text('{"keys": [3]}')
    with pytest.raises(KeyFileError) as e:
        read_keys(path)
    assert str(e.value) == f"{path} is not a valid key file (a key entry is not an object); fix or remove it"


def test_unreadable_and_unwritable_key_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(KeyFileError) as e:
        read_keys(tmp_path / "dir.json")
    assert str(e.value) == f"cannot read the API keys in {tmp_path / 'dir.json'}: Is a directory"
    (tmp_path / "file").write_text("")
    with pytest.raises(KeyFileError) as e:
        KeyStore(tmp_path / "file" / "keys.json")
    assert str(e.value) == f"cannot read the API keys in {tmp_path / 'file' / 'keys.json'}: Not a directory"
    # the temporary file cannot be made: nothing is written, the error says why
    store = KeyStore(tmp_path / "keys.json")
    tmp = tmp_path / f".keys.json.{os.getpid()}.tmp"
    tmp.mkdir()
    with pytest.raises(KeyFileError) as e:
        store.add("a", 1)
    assert str(e.value) == f"cannot write the API keys to {tmp_path / 'keys.json'}: Is a directory"
    tmp.rmdir()
    # the file cannot be replaced: the temporary one is removed
    (tmp_path / "keys.json").mkdir()
    (tmp_path / "keys.json" / "x").write_text("")
    with pytest.raises(KeyFileError):
        store.add("a", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "file", "keys.json"]


def test_an_unchanged_file_is_not_read_again(tmp_path: Path) -> None:
    """The file is re-read when its inode, mtime or size changed, not on every lookup."""
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    key, secret = store.add("a", 1)

    def garble() -> None:                   # the same size, inode and mtime: not a change to see
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(b"#" * st.st_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    garble()
    assert store.match(secret) == key and store.all() == [key]
    path.write_text(json.dumps({"keys": []}))
    assert store.all() == []
    store2 = KeyStore(path)
    store2.add("b", 2)
    garble()
    assert [k.name for k in store2.all()] == ["b"]
