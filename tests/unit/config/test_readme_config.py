"""The README's tables of config keys against the config's parser: every key the parser takes is in
its table and no other, and writing a key's documented default changes nothing.

In-process: omnid.config's parse on TOML text; no daemon.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from omnid import config as C

README = Path(__file__).resolve().parents[3] / "README.md"
ROW = re.compile(r"^\| `([a-z_]+)` \| (.+?) \| .+ \|$")


def table(header: str) -> dict[str, str]:
    """The rows of the README's table whose first header cell is `header`: key -> default cell."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows: dict[str, str] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        m = ROW.match(line)
        assert m, f"a row the test cannot read: {line}"
        assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
        rows[m.group(1)] = m.group(2)
    return rows


def documented(rows: dict[str, str]) -> dict[str, Any]:
    """The keys whose default is a TOML value in backticks, with that value."""
    out = {}
    for key, cell in rows.items():
        if cell == "—":
            continue
        m = re.fullmatch(r"`(.+)`", cell)
        assert m, f"{key}: the default must be — or a TOML value in backticks, not {cell!r}"
        out[key] = tomllib.loads(f"v = {m.group(1)}")["v"]
    return out


def parse(tmp: Path, daemon: dict[str, Any] | None = None, stage: dict[str, Any] | None = None,
          engine: str = "python", pipeline: dict[str, Any] | None = None) -> C.Config:
    base: dict[str, Any] = {"python": {"engine": "python", "function": "json:dumps"},
                            "vllm": {"engine": "vllm", "model": str(tmp / "llm")},
                            "diffusers": {"engine": "diffusers", "model": str(tmp / "sd")}}[engine]
    data = {"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state"), **(daemon or {})},
            "stages": {"s": {**base, **(stage or {})}},
            "pipelines": {"p": {"stages": ["s"], **(pipeline or {})}}}
    return C.parse(data, base=tmp)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text("{}")
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    return tmp_path


def test_the_daemon_table_lists_every_key_with_its_default(tmp: Path) -> None:
    rows = table("`[daemon]` key")
    assert set(rows) == set(C.DaemonConfig.__dataclass_fields__)
    plain = parse(tmp).daemon
    for key, value in documented(rows).items():
        assert parse(tmp, daemon={key: value}).daemon == plain, f"[daemon] {key} = {value!r} is not the default"


VLLM_ONLY = {"media", "engine_core", "outputs", "hidden_layers", "hidden_prompt", "prompt_embeds"}


def test_the_stage_table_lists_every_key_with_its_default(tmp: Path) -> None:
    rows = table("`[stages.NAME]` key")
    assert set(rows) == set(C._STAGE_KEYS)
    for key, value in documented(rows).items():
        engine = "vllm" if key in VLLM_ONLY else "diffusers" if key in ("cache", "batching") else "python"
        assert parse(tmp, stage={key: value}, engine=engine).stages["s"] == \
            parse(tmp, engine=engine).stages["s"], f"[stages.NAME] {key} = {value!r} is not the default"


def test_the_pipeline_table_lists_every_key_with_its_default(tmp: Path) -> None:
    rows = table("`[pipelines.NAME]` key")
    with pytest.raises(C.ConfigError) as e:
        parse(tmp, pipeline={"colour": 1})
    known = re.search(r"known: ([a-z_, ]+)\)", str(e.value))
    assert known and set(rows) == set(known.group(1).split(", "))
    for key, value in documented(rows).items():
        assert parse(tmp, pipeline={key: value}).pipelines["p"] == parse(tmp).pipelines["p"], key
