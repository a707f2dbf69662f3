"""How every tiny model is built (omnid/tinymodels/build.py), in-process, without building one: a
folder is built whole or not at all, its marker written last, and `is_built` trusts only a current
marker of its own kind. No torch: the fill functions here write plain files."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from omnid.tinymodels import build as B


def test_a_build_moves_a_whole_folder_into_place_with_its_marker(tmp_path: Path) -> None:
    target = tmp_path / "models" / "llm"
    assert not B.is_built(target, "llm")

    done = B.build_atomically(target, "llm", lambda out: (out / "weights").write_text("w"))

    assert done == target.absolute()
    assert (target / "weights").read_text() == "w"
    assert json.loads((target / B.MARKER_NAME).read_text()) == {"kind": "llm", "format": B.FORMAT_VERSION}
    assert B.is_built(target, "llm")
    assert not B.is_built(target, "sd")                          # a marker of another kind
    assert [p.name for p in target.parent.iterdir()] == ["llm"]  # no temporary folder left
    assert stat.S_IMODE(target.stat().st_mode) & 0o055           # not mkdtemp's 0700


def test_a_failed_build_leaves_nothing_and_keeps_the_folder_there(tmp_path: Path) -> None:
    target = tmp_path / "sd"
    B.build_atomically(target, "sd", lambda out: (out / "old").write_text("old"))

    def broken(out: Path) -> None:
        (out / "half").write_text("half")
        raise RuntimeError("no room")

    with pytest.raises(RuntimeError):
        B.build_atomically(target, "sd", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd"]
    assert (target / "old").read_text() == "old" and not (target / "half").exists()
    assert B.is_built(target, "sd")


def test_an_old_or_unreadable_marker_is_not_built(tmp_path: Path) -> None:
    (tmp_path / B.MARKER_NAME).write_text(json.dumps({"kind": "llm", "format": B.FORMAT_VERSION - 1}))
    assert not B.is_built(tmp_path, "llm")
    (tmp_path / B.MARKER_NAME).write_text("not json")
    assert not B.is_built(tmp_path, "llm")
    assert not B.is_built(tmp_path / "missing", "llm")
