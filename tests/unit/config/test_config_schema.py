"""The config file's models (omnid/config/schema.py) and what is generated from them: the JSON
Schema `omnid config-schema` prints and the repo ships (etc/omnid.schema.json, for editors through
.taplo.toml and each config's `#:schema` line), and the reference's rows.

In-process but for one `omnid config-schema` subprocess; no daemon.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from conftest import demo_stage, python_stage, tiny_llm, tiny_sd
from pydantic import BaseModel

from omnid import config as C
from omnid.config import schema as S
from omnid.config.checker import PRODUCED_KINDS, Checker
from omnid.config_types import OVERLOAD_MODES
from omnid.media import NO_MEDIA

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "etc" / "omnid.schema.json"
CONFIGS = sorted((ROOT / "etc").rglob("*.toml"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SHIPPED.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def refusals(validator: jsonschema.Draft202012Validator, data: dict[str, Any]) -> list[tuple[str, str]]:
    return [(".".join(map(str, e.absolute_path)), e.message) for e in validator.iter_errors(data)]


# ------------------------------------------------------------------------- the shipped schema


def test_the_shipped_schema_is_the_generated_one() -> None:
    assert SHIPPED.read_text() == S.schema_text(), "run: omnid config-schema > etc/omnid.schema.json"


def test_omnid_config_schema_prints_it() -> None:
    r = subprocess.run([sys.executable, "-m", "omnid", "config-schema"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert (r.returncode, r.stderr) == (0, "")
    assert json.loads(r.stdout) == C.json_schema() and r.stdout == SHIPPED.read_text()


def test_the_schema_speaks_toml() -> None:
    """TOML has no null: a key that may be left out is of its own type, with no `null` default; a key
    the parser requires is required."""
    text = SHIPPED.read_text()
    assert '"null"' not in text and '"default": null' not in text
    schema = json.loads(text)
    assert schema["required"] == ["stages", "pipelines"]
    assert schema["$defs"]["StageTable"]["required"] == ["engine"]
    assert schema["$defs"]["EdgeTable"]["required"] == ["from", "to"]
    assert "default" not in schema["$defs"]["StageTable"]["properties"]["engine"]


def test_the_repos_configs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in CONFIGS}
    assert {"etc/omnid.toml", "etc/omnid-demo.toml", "etc/omnid-ray-demo.toml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_repos_configs_pass_the_schema(path: Path, validator: jsonschema.Draft202012Validator) -> None:
    assert refusals(validator, tomllib.loads(path.read_text())) == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_config_names_the_schema_for_editors(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    m = re.fullmatch(r"#:schema (\S+)", first)
    assert m and (path.parent / m.group(1)).resolve() == SHIPPED, first


def test_taplo_is_pointed_at_the_schema() -> None:
    taplo = tomllib.loads((ROOT / ".taplo.toml").read_text())
    [rule] = taplo["rule"]
    assert (ROOT / rule["schema"]["path"]).resolve() == SHIPPED
    assert "etc/**/*.toml" in rule["include"]


def test_a_config_the_parser_takes_passes_the_schema(validator: jsonschema.Draft202012Validator,
                                                     tmp_path: Path) -> None:
    data = {"daemon": {"socket": "s.sock", "socket_mode": "0600", "listen": ["127.0.0.1:8080"],
                       "owners": {"default": {"weight": 2}, "key:ci": {"max_queued": 3}},
                       "tracing": {"sample": 0.5}},
            "stages": {"a": {"engine": "python", "function": "json:dumps", "devices": [[0], [1]],
                             "placement": ["local", "local"], "ray": {"num_cpus": 2}},
                       "b": {"engine": "python", "function": "json:loads", "produces": ["text"]}},
            "pipelines": {"p": {"stages": ["a", "b"], "edges": [{"from": "a", "to": "b", "window": [2, 4],
                                                                  "map": {"prompt": "text"}}],
                                "timeout_s": 5, "realtime": {"warmup": False}}}}
    C.parse(data, base=tmp_path)
    assert refusals(validator, data) == []


def test_the_test_suites_stages_pass_the_schema(validator: jsonschema.Draft202012Validator) -> None:
    """The stages the integration tests write (tests/omnidtest.py) are what the schema describes."""
    data = {"daemon": {"socket": "/tmp/x.sock", "max_restarts": 0, "owners": {"1000": {"max_priority": -5}}},
            "stages": {"llm": tiny_llm({"max_tokens": 8}, max_inflight=4, outputs=["hidden_states"],
                                       hidden_layers=[-1, 2], hidden_prompt=True),
                       "sd": tiny_sd({"num_inference_steps": 2}, max_inflight=2, batching="call",
                                     cache={"kind": "first_block", "threshold": 0.2}, lora={"max_loras": 2}),
                       "echo": python_stage("teststages", "echo", sessions=None, idle_unload_s=5, lazy=True),
                       "frame": demo_stage("frame", replicas=2, env={"A": "b"})},
            "pipelines": {"t2i": {"stages": ["llm", "sd"], "edges": [{"from": "llm", "to": "sd", "window": 4}]}}}
    del data["stages"]["echo"]["sessions"]
    assert refusals(validator, data) == []


@pytest.mark.parametrize("data, where, fragment", [
    ({"stagse": {}}, "", "'stagse' was unexpected"),
    ({"daemon": {"max_queued_jobs": 0}}, "daemon.max_queued_jobs", "minimum"),
    ({"daemon": {"log_level": "loud"}}, "daemon.log_level", "is not one of"),
    ({"daemon": {"tracing": {"sample": 2}}}, "daemon.tracing.sample", "maximum"),
    ({"daemon": {"owners": {"bob": {}}}}, "daemon.owners", "does not match"),
    ({"stages": {"a": {"function": "json:dumps"}}}, "stages.a", "'engine' is a required property"),
    ({"stages": {"a": {"engine": "tensorflow"}}}, "stages.a.engine", "is not one of"),
    ({"stages": {"a": {"engine": "python", "max_inflight": "2"}}}, "stages.a.max_inflight", "is not of type"),
    ({"stages": {"a": {"engine": "python", "replicas": 65}}}, "stages.a.replicas", "maximum"),
    ({"stages": {"a": {"engine": "diffusers", "cache": {"kind": "first_block", "speed": 2}}}}, "stages.a.cache",
     "is not valid under any of the given schemas"),
    ({"stages": {"a": {"engine": "vllm", "lora": {"max_loras": 0}}}}, "stages.a.lora.max_loras", "minimum"),
    ({"stages": {"a": {"engine": "vllm", "defaults": {"max_tokens": 0}}}}, "stages.a.defaults.max_tokens", "minimum"),
    ({"stages": {"a": {"engine": "diffusers", "defaults": {"max_tokens": 8}}}}, "stages.a.defaults",
     "'max_tokens' was unexpected"),
    ({"pipelines": {"p": {"stages": ["a"], "edges": [{"from": "a"}]}}}, "pipelines.p.edges.0",
     "'to' is a required property"),
    # a window is -1 or a count > 0, a schedule at least one count > 0 (as the parser says)
    ({"pipelines": {"p": {"stages": ["a"], "edges": [{"from": "a", "to": "a", "window": []}]}}},
     "pipelines.p.edges.0.window", "is not valid under any of the given schemas"),
    ({"pipelines": {"p": {"stages": ["a"], "edges": [{"from": "a", "to": "a", "window": 0}]}}},
     "pipelines.p.edges.0.window", "is not valid under any of the given schemas"),
    ({"pipelines": {"p": {"stages": ["a"], "edges": [{"from": "a", "to": "a", "window": [4, 0]}]}}},
     "pipelines.p.edges.0.window", "is not valid under any of the given schemas"),
    ({"pipelines": {"p": {"stages": ["a"], "realtime": {"overload": "drop"}}}}, "pipelines.p.realtime.overload",
     "is not one of"),
])
def test_the_schema_refuses_a_wrong_config(validator: jsonschema.Draft202012Validator, data: dict[str, Any],
                                          where: str, fragment: str) -> None:
    base: dict[str, Any] = {"stages": {"a": {"engine": "python", "function": "json:dumps"}},
                            "pipelines": {"p": {"stages": ["a"]}}}
    found = refusals(validator, {**base, **data})
    assert any(w == where and fragment in m for w, m in found), found


# ------------------------------------------------------------------------- the models and their users


def defaults(model: type[BaseModel]) -> dict[str, Any]:
    return {name: f.default for name, f in model.model_fields.items()}


def test_the_media_tables_defaults_are_no_medias() -> None:
    media = defaults(S.MediaTable)
    for key in ("max_bytes", "max_pixels", "max_audio_s", "max_video_frames"):
        assert media[key] == getattr(NO_MEDIA, key), key


def test_the_daemon_and_stage_keys_are_the_parsed_fields() -> None:
    assert set(S.DaemonTable.model_fields) == {f.name for f in dataclasses.fields(C.DaemonConfig)}
    assert set(C.STAGE_KEYS) == set(S.StageTable.model_fields)


def test_a_keys_choices_are_what_its_users_know() -> None:
    assert get_args(S.Engine) == C.ENGINES
    assert get_args(S.OutputKind) == PRODUCED_KINDS
    assert get_args(S.Overload) == OVERLOAD_MODES
    assert S.PLACEMENTS == ("local", "ray") and S.ENGINE_CORES == ("inline", "process")
    assert S.BATCHINGS == ("step", "call")


# Values of every kind TOML has, wrong for most keys.
WRONG = ["x", True, 1.5, -1, 0, [], [1, "a"], {}, {"k": 1}]


@pytest.mark.parametrize("table", list(S.TABLES), ids=list(S.TABLES))
def test_no_wrong_value_of_any_key_is_said_in_pydantics_words(table: str) -> None:
    model = S.TABLES[table]
    for key in (f.alias or name for name, f in model.model_fields.items()):
        for value in WRONG:
            c = Checker()
            S.read(c, model, {key: value}, "t")
            for p in c.problems:
                assert p.path == f"t.{key}" or p.path.startswith((f"t.{key}.", f"t.{key}[")), (key, value, p)
                for word in ("Input should", "type=", "pydantic", "is not valid", "Value error"):
                    assert word not in p.message, (key, value, str(p))


def test_a_refused_value_gives_way_to_its_default_and_the_rest_stands() -> None:
    c = Checker()
    d = S.read(c, S.DaemonTable, {"max_queued_jobs": 0, "keep_jobs": 7, "colour": 1,
                                  "owners": {"bob": {}, "default": {"weight": -1, "max_queued": 2}}}, "daemon")
    assert d is not None and (d.max_queued_jobs, d.keep_jobs) == (256, 7)
    assert d.owners == {"default": S.OwnerTable(max_queued=2)}
    assert [p.path for p in c.problems] == ["daemon.colour", "daemon.max_queued_jobs", "daemon.owners.bob",
                                            "daemon.owners.default.weight"]
    assert S.read(c, S.DaemonTable, [1], "daemon") is None
    assert str(c.problems[-1]) == "daemon: must be a table, not an array"


# ------------------------------------------------------------------------- the reference


def test_the_reference_has_every_key_of_every_table_with_its_meaning() -> None:
    rows = C.reference()
    for table, model in S.TABLES.items():
        keys = [key for t, key, *_ in rows if t == table]
        assert keys == [f.alias or n for n, f in model.model_fields.items()], table
    for table, key, kind, default, meaning in rows:
        assert kind and meaning, (table, key)
        if default:
            tomllib.loads(f"v = {default}")     # a TOML value, as a user would write it
    found = {(t, k): (kind, default) for t, k, kind, default, _ in rows}
    assert found[("[daemon]", "max_queued_jobs")] == ("integer", "256")
    assert found[("[daemon]", "log_level")] == ('"debug" | "info" | "warning" | "error"', '"info"')
    assert found[("[stages.NAME]", "hidden_layers")] == ("array of integer", "[-1]")
    assert found[("[stages.NAME]", "engine")] == ('"vllm" | "diffusers" | "python"', "")
    assert found[("[[pipelines.NAME.edges]]", "from")] == ("string", "")


VLLM_ONLY = {"media", "engine_core", "outputs", "hidden_layers", "hidden_prompt", "prompt_embeds"}


@pytest.mark.parametrize("table", ["[daemon]", "[stages.NAME]", "[pipelines.NAME]"])
def test_writing_a_documented_default_changes_nothing(table: str, tmp_path: Path) -> None:
    """Each key set to the reference's default parses to the config of the key left out."""
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text("{}")
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    stages = {"python": {"engine": "python", "function": "json:dumps"}, "vllm": {"engine": "vllm", "model": "llm"},
              "diffusers": {"engine": "diffusers", "model": "sd"}}

    def parse(section: str = "", key: str = "", value: Any = None, engine: str = "python") -> Any:
        data: dict[str, Any] = {"daemon": {"socket": "s.sock", "state_dir": "state"}, "stages": {"s": stages[engine]},
                                "pipelines": {"p": {"stages": ["s"]}}}
        if key:
            data = {**data, section: {**data[section], key: value}} if section == "daemon" else data
            if section == "stages":
                data["stages"] = {"s": {**stages[engine], key: value}}
            if section == "pipelines":
                data["pipelines"] = {"p": {"stages": ["s"], key: value}}
        cfg = C.parse(data, base=tmp_path)
        return {"daemon": cfg.daemon, "stages": cfg.stages["s"], "pipelines": cfg.pipelines["p"]}[section]

    section = table.strip("[]").split(".")[0]
    tried = 0
    for t, key, _, default, _ in C.reference():
        if t != table or not default:
            continue
        engine = "vllm" if key in VLLM_ONLY else "diffusers" if key in ("cache", "batching") else "python"
        value = tomllib.loads(f"v = {default}")["v"]
        assert parse(section, key, value, engine) == parse(section, engine=engine), (table, key, default)
        tried += 1
    assert tried >= 2
