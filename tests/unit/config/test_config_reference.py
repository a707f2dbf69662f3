"""The configuration reference's tables (docs/reference/config.md) against the config's parser: every key
the parser takes is in its table and no other, writing a key's documented default changes nothing, a
default is of its documented type, and each `[daemon]` key's type is its `DaemonConfig` field's.

In-process: omnid.config's parse on TOML text; no daemon.
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from omnid import config as C

PAGE = Path(__file__).resolve().parents[3] / "docs/reference/config.md"
ROW = re.compile(r"^\| `([a-z_]+)` \| ([a-z ()]+?) \| (.+?) \| .+ \|$")
# The TOML types the tables name, and the Python values tomllib gives for each.
TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "string (path)": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "table": (dict,), "list": (list,), "list of strings": (list,), "list of integers": (list,),
    "list of tables": (list,), "string or list": (str, list)}


def typed_table(header: str) -> dict[str, tuple[str, str]]:
    """The rows of the page's table whose first header cell is `header`: key -> (type cell, default cell)."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        m = ROW.match(line)
        assert m, f"a row the test cannot read: {line}"
        assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
        assert m.group(2) in TYPES, f"{m.group(1)}: unknown type {m.group(2)!r}"
        rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def table(header: str) -> dict[str, str]:
    """key -> default cell, and every documented default of its documented type."""
    rows = typed_table(header)
    for key, value in documented({k: d for k, (_, d) in rows.items()}).items():
        kind = rows[key][0]
        assert isinstance(value, TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool)), \
            f"{header} {key}: the default {value!r} is not a {kind}"
    return {k: d for k, (_, d) in rows.items()}


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


# How DaemonConfig's field types are written in TOML: the ones parsed from another form are named.
WRITTEN_AS = {"socket_mode": "string", "metrics_listen": "string", "listen": "list of strings",
              "allow_origins": "list of strings", "owners": "table", "tracing": "table"}
PLAIN = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "string (path)"}


def test_the_daemon_table_gives_each_key_its_fields_type() -> None:
    rows = typed_table("`[daemon]` key")
    hints = typing.get_type_hints(C.DaemonConfig)
    for key, (kind, _) in rows.items():
        if key in WRITTEN_AS:
            assert kind == WRITTEN_AS[key], key
            continue
        [field_type] = [a for a in typing.get_args(hints[key]) if a is not type(None)] or [hints[key]]
        assert kind == PLAIN[field_type], f"[daemon] {key} is a {field_type.__name__} in DaemonConfig, not a {kind}"


def test_the_daemon_table_lists_every_key_with_its_default(tmp: Path) -> None:
    rows = table("`[daemon]` key")
    assert set(rows) == set(C.DaemonConfig.__dataclass_fields__)
    plain = parse(tmp).daemon
    for key, value in documented(rows).items():
        assert parse(tmp, daemon={key: value}).daemon == plain, f"[daemon] {key} = {value!r} is not the default"


VLLM_ONLY = {"media", "engine_core", "outputs", "hidden_layers", "hidden_prompt", "prompt_embeds"}


def test_the_stage_table_lists_every_key_with_its_default(tmp: Path) -> None:
    rows = table("`[stages.NAME]` key")
    assert set(rows) == set(C.STAGE_KEYS)
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
