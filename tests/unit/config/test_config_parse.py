"""`omnid.config.parse` in-process: what the parser hands the daemon, and every problem it reports.

No TOML file, no subprocess: the parsed dict goes straight to `parse(data, base=...)`. Model
directories are fakes (only their marker file matters); python stages use tests/fixtures/teststages.py.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, edge

from omnid import config as C
from omnid import paths
from omnid.engines.capabilities import stage_accepts
from omnid.params import DIFFUSERS_PARAMS, VLLM_PARAMS


def py(function: str = "sleep", **extra: Any) -> dict[str, Any]:
    return {"engine": "python", "function": f"teststages:{function}", "python_path": [str(FIXTURES)], **extra}


def minimal(**pipeline: Any) -> dict[str, Any]:
    return {"stages": {"a": py(), "b": py(), "c": py()},
            "pipelines": {"p": {"stages": ["a", "b", "c"], **pipeline}}}


def parse(data: dict[str, Any], base: Path) -> C.Config:
    return C.parse(copy.deepcopy(data), base=base)


def problems(data: dict[str, Any], base: Path) -> dict[str, list[str]]:
    """Every reported problem's messages, by key path (the parse must fail)."""
    with pytest.raises(C.ConfigError) as err:
        parse(data, base)
    found: dict[str, list[str]] = {}
    for p in err.value.problems:
        found.setdefault(p.path, []).append(p.message)
    return found


def reported(data: dict[str, Any], base: Path, path: str, fragment: str) -> None:
    found = problems(data, base)
    assert any(fragment in m for m in found.get(path, [])), f"no {path!r} containing {fragment!r} in {found}"


# ------------------------------------------------------------------------- valid configs


def test_resource_keys(tmp_path: Path) -> None:
    data = minimal()
    data["daemon"] = {"min_free_mb": 0, "min_free_inodes": 10, "ballast_mb": 0}
    data["stages"]["a"]["max_rss_mb"] = 2048
    cfg = parse(data, tmp_path)
    assert (cfg.daemon.min_free_mb, cfg.daemon.min_free_inodes, cfg.daemon.ballast_mb) == (0, 10, 0)
    assert cfg.stages["a"].max_rss_mb == 2048 and cfg.stages["b"].max_rss_mb is None
    # a new max_rss_mb is no new worker (a reload keeps it warm)
    other = dataclasses.replace(cfg.stages["a"], max_rss_mb=None)
    assert cfg.stages["a"].same_worker(other, 0)
    data["stages"]["a"]["max_rss_mb"] = 0
    reported(data, tmp_path, "stages.a.max_rss_mb", "must be > 0")


def test_minimal_valid_config(tmp_path: Path) -> None:
    cfg = parse({"stages": {"a": py()}, "pipelines": {"p": {"stages": ["a"]}}}, tmp_path)
    assert cfg.source is None
    a = cfg.stages["a"]
    assert (a.name, a.engine, a.function, a.model) == ("a", "python", "teststages:sleep", None)
    assert a.python_path == (FIXTURES,)
    assert (a.devices, a.exclusive, a.max_inflight, a.queue_capacity) == ((), False, 1, 4)
    assert (dict(a.args), dict(a.defaults), dict(a.env)) == ({}, {}, {})
    p = cfg.pipelines["p"]
    assert (p.name, p.stages, p.edges, p.sources, p.sinks) == ("p", ("a",), (), ("a",), ("a",))
    assert (p.timeout_s, p.retries) == (None, 0)
    d = paths.defaults()
    assert (cfg.daemon.socket, cfg.daemon.state_dir, cfg.daemon.lock_dir) == (d.socket, d.state_dir, d.lock_dir)
    assert cfg.devices == ()
    assert pickle.loads(pickle.dumps(cfg)) == cfg           # handed to every worker at spawn


def test_daemon_defaults(tmp_path: Path) -> None:
    daemon = parse(minimal(), tmp_path).daemon
    expected = {
        "max_queued_jobs": 256, "default_timeout_s": 600.0, "socket_mode": 0o660, "socket_group": None,
        "max_request_bytes": 64 * 1024 * 1024, "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0,
        "startup_timeout_s": 900.0, "cancel_grace_s": 5.0, "stop_grace_s": 10.0, "restart_backoff_s": 1.0,
        "restart_backoff_max_s": 30.0, "max_restarts": 5, "restart_window_s": 300.0,
        "log_level": "info", "log_format": "auto", "min_free_mb": 512, "min_free_inodes": 1024, "ballast_mb": 32,
    }
    got = {k: getattr(daemon, k) for k in expected}
    assert got == expected
    assert daemon.socket_mode == 0o660, "the socket is group-accessible by default"
    # The dataclass's own defaults agree with the parser's.
    bare = C.DaemonConfig(socket=Path("/s"), state_dir=Path("/d"), lock_dir=Path("/l"))
    assert {k: getattr(bare, k) for k in expected} == expected


def test_daemon_values(tmp_path: Path) -> None:
    data = minimal()
    data["daemon"] = {"socket_mode": "0600", "socket_group": "omnid", "max_queued_jobs": 3,
                      "default_timeout_s": 30, "max_restarts": 0, "log_level": "debug", "log_format": "json"}
    d = parse(data, tmp_path).daemon
    assert (d.socket_mode, d.socket_group, d.max_queued_jobs, d.max_restarts) == (0o600, "omnid", 3, 0)
    assert d.default_timeout_s == 30.0 and type(d.default_timeout_s) is float
    assert (d.log_level, d.log_format) == ("debug", "json")
    data["daemon"] = {"socket_mode": 0o640}
    assert parse(data, tmp_path).daemon.socket_mode == 0o640


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("socket_mode", "rw-rw----", "octal string"),
    ("socket_mode", "0999", "octal string"),
    ("socket_mode", 0o1000, "between 0000 and 0777"),
    ("socket_mode", -1, "between 0000 and 0777"),
    ("max_queued_jobs", 0, "must be > 0, not 0"),
    ("max_queued_jobs", 1.5, "must be an integer, not a number"),
    ("max_queued_jobs", True, "not a boolean"),
    ("heartbeat_timeout_s", -1, "must be > 0"),
    ("max_restarts", -1, "must be >= 0"),
    ("log_level", "trace", "must be one of"),
    ("log_format", "xml", "must be \"console\" or \"json\""),
    ("socket", 3, "must be a string"),
    ("sockett", "/x", "unknown key"),
    ("min_free_mb", -1, "must be >= 0"),
    ("min_free_mb", 1.5, "must be an integer"),
    ("min_free_inodes", -5, "must be >= 0"),
    ("ballast_mb", "32M", "must be an integer"),
])
def test_daemon_problems(tmp_path: Path, key: str, value: Any, fragment: str) -> None:
    data = minimal()
    data["daemon"] = {key: value}
    reported(data, tmp_path, f"daemon.{key}", fragment)


def test_chain_gets_implicit_edges(tmp_path: Path) -> None:
    p = parse(minimal(), tmp_path).pipelines["p"]
    assert p.edges == (C.EdgeConfig("a", "b"), C.EdgeConfig("b", "c"))
    assert all((e.window, e.map, e.transform) == (C.FULL_WINDOW, None, None) for e in p.edges)
    assert (p.sources, p.sinks) == (("a",), ("c",))
    assert p.incoming("b") == (C.EdgeConfig("a", "b"),) and p.outgoing("b") == (C.EdgeConfig("b", "c"),)
    assert p.as_api()["edges"] == [{"from": "a", "to": "b", "window": -1, "map": None, "transform": None},
                                   {"from": "b", "to": "c", "window": -1, "map": None, "transform": None}]


def test_explicit_edges_replace_the_chain(tmp_path: Path) -> None:
    p = parse(minimal(edges=[edge("a", "c", map={"prompt": "text"}), edge("b", "c", window=-1)]),
              tmp_path).pipelines["p"]
    assert [(e.src, e.dst) for e in p.edges] == [("a", "c"), ("b", "c")]
    assert p.edges[0].map == {"prompt": "text"}
    assert (p.sources, p.sinks) == (("a", "b"), ("c",))


def test_an_empty_edge_list_is_not_a_chain(tmp_path: Path) -> None:
    found = problems(minimal(edges=[]), tmp_path)
    assert sorted(found["pipelines.p.edges"]) == [f"stage {s!r} is in the pipeline but on no edge" for s in "abc"]


def test_an_edge_to_a_missing_stage_is_said_once(tmp_path: Path) -> None:
    # a -> "d" (no such stage), b -> c: the edge's error, and no claim that a is on no edge
    found = problems(minimal(edges=[edge("a", "d"), edge("b", "c")]), tmp_path)
    assert found == {"pipelines.p.edges[0].to": ["unknown stage 'd'"]}, found


# ------------------------------------------------------------------------- graph problems


def test_cycle(tmp_path: Path) -> None:
    reported(minimal(edges=[edge("a", "b"), edge("b", "c"), edge("c", "a")]), tmp_path,
             "pipelines.p.edges", "the edges form a cycle: a -> b -> c -> a")


def test_self_edge(tmp_path: Path) -> None:
    reported(minimal(edges=[edge("a", "b"), edge("b", "b"), edge("b", "c")]), tmp_path,
             "pipelines.p.edges[1]", "an edge from 'b' to itself is a cycle")


def test_unknown_stages(tmp_path: Path) -> None:
    data = minimal(edges=[edge("a", "b"), edge("b", "ghost"), edge("spook", "c")])
    data["pipelines"]["q"] = {"stages": ["a", "phantom", "a"]}
    found = problems(data, tmp_path)
    assert found["pipelines.p.edges[1].to"] == ["unknown stage 'ghost'"]
    assert found["pipelines.p.edges[2].from"] == ["unknown stage 'spook'"]
    assert found["pipelines.q.stages[1]"] == ["unknown stage 'phantom'"]
    assert found["pipelines.q.stages[2]"] == ["stage 'a' is listed twice"]


def test_edge_to_a_stage_outside_the_pipeline(tmp_path: Path) -> None:
    data = minimal(edges=[edge("a", "b"), edge("b", "c")])
    data["stages"]["d"] = py()
    data["pipelines"]["p"]["edges"].append(edge("c", "d"))
    reported(data, tmp_path, "pipelines.p.edges[2].to", "stage 'd' is not in this pipeline's stages")


def test_duplicate_edges(tmp_path: Path) -> None:
    found = problems(minimal(edges=[edge("a", "b"), edge("b", "c"), edge("a", "b", window=-1)]), tmp_path)
    assert found == {"pipelines.p.edges[2]": ["duplicate edge a -> b"]}


@pytest.mark.parametrize(("window", "fragment"), [
    (0, "must be -1 (full trigger) or a segment count > 0, not 0"),
    (-2, "must be -1 (full trigger) or a segment count > 0, not -2"),
    (-100, "not -100"),
    (True, "must be an integer, not a boolean (or a list of integers: a schedule)"),
    ("full", "must be an integer, not a string"),
    ([], "a window schedule lists at least one size"),
])
def test_window_other_than_minus_one_is_refused(tmp_path: Path, window: Any, fragment: str) -> None:
    reported(minimal(edges=[edge("a", "b", window=window), edge("b", "c")]), tmp_path,
             "pipelines.p.edges[0].window", fragment)


def test_window_n_streams_into_python_stages(tmp_path: Path) -> None:
    p = parse(minimal(edges=[edge("a", "b", window=1), edge("b", "c", window=4)]), tmp_path).pipelines["p"]
    assert [e.window for e in p.edges] == [1, 4]


def test_window_schedule_is_parsed_and_described(tmp_path: Path) -> None:
    p = parse(minimal(edges=[edge("a", "b", window=[4, 8, 16, 25]), edge("b", "c", window=3)]), tmp_path).pipelines["p"]
    ramp, fixed = p.edges
    assert (ramp.window, ramp.schedule, ramp.sizes) == (4, (4, 8, 16, 25), (4, 8, 16, 25))
    assert (fixed.window, fixed.schedule, fixed.sizes) == (3, (), (3,))
    assert [e["window"] for e in p.as_api()["edges"]] == [[4, 8, 16, 25], 3]


@pytest.mark.parametrize(("window", "path", "fragment"), [
    ([4, 0], "window[1]", "a window size is a segment count > 0, not 0"),
    ([4, -1], "window[1]", "not -1"),
    ([2, True], "window[1]", "not True"),
    (["4"], "window[0]", "not '4'"),
])
def test_bad_window_schedule_is_refused(tmp_path: Path, window: Any, path: str, fragment: str) -> None:
    reported(minimal(edges=[edge("a", "b", window=window), edge("b", "c")]), tmp_path,
             f"pipelines.p.edges[0].{path}", fragment)


def test_window_schedule_into_a_vllm_stage_is_refused_like_n(tmp_path: Path, models: Path) -> None:
    data = minimal(edges=[edge("a", "llm", window=[2, 8])], stages=["a", "llm"])
    data["stages"]["llm"] = {"engine": "vllm", "model": str(models / "llm")}
    reported(data, tmp_path, "pipelines.p.edges[0].window", "cannot be fed by a window edge")


def test_tensor_outputs_are_asked_by_edges_and_outputs(tmp_path: Path, models: Path) -> None:
    llm = {"engine": "vllm", "model": str(models / "llm")}
    data = {"stages": {"quiet": dict(llm), "asked": dict(llm), "declared": {**llm, "outputs": ["text", "token_ids"]},
                       "fed": {**llm, "hidden_layers": [1, -1]}, "a": py()},
            "pipelines": {"q": {"stages": ["quiet", "a"]},
                          "h": {"stages": ["asked", "fed", "a"],
                                "edges": [edge("asked", "fed", map={"prompt_embeds": "hidden_states"}),
                                          edge("fed", "a", window=[2, 8], map={"t": "token_ids", "x": "text"})]},
                          "d": {"stages": ["declared"]}}}
    cfg = parse(data, tmp_path)
    st = cfg.stages
    assert st["quiet"].tensor_outputs == frozenset() and not st["quiet"].takes_embeds
    assert st["asked"].tensor_outputs == {"hidden_states"} and not st["asked"].takes_embeds
    assert st["fed"].tensor_outputs == {"token_ids"} and st["fed"].takes_embeds
    assert st["fed"].hidden_layers == (1, -1)
    assert st["declared"].tensor_outputs == {"token_ids"} and st["declared"].outputs == ("token_ids",)
    assert cfg.pipelines["h"].asks("fed") == {"token_ids", "text"}


def test_tensor_keys_are_checked(tmp_path: Path, models: Path) -> None:
    (models / "llm" / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 2}')
    llm = {"engine": "vllm", "model": str(models / "llm")}
    data = {"stages": {"v": {**llm, "outputs": ["logits"], "hidden_layers": [0, 5, "x", -1, -1],
                             "hidden_prompt": "yes"},
                       "pp": {**llm, "args": {"pipeline_parallel_size": 2}, "devices": [0, 1]},
                       "a": {**py(), "hidden_layers": [-1]}},
            "pipelines": {"p": {"stages": ["v", "pp", "a"],
                                "edges": [edge("v", "pp", map={"prompt_token_ids": "text"}),
                                          edge("pp", "a", map={"h": "hidden_states"})]}}}
    found = problems(data, tmp_path)
    assert "a vllm stage gives text, token_ids, hidden_states, prompt_token_ids, not 'logits'" in \
        found["stages.v.outputs[0]"]
    assert "0 would be the input embeddings" in found["stages.v.hidden_layers[0]"][0]
    assert "the model has 2 layers: 1..2 or -1..-2, not 5" in found["stages.v.hidden_layers[1]"]
    assert "must be a layer index (an integer), not a string" in found["stages.v.hidden_layers[2]"]
    assert "layer -1 is listed twice" in found["stages.v.hidden_layers[4]"]
    assert "must be a boolean, not a string" in found["stages.v.hidden_prompt"]
    assert "only vllm stages take hidden_layers, not 'python'" in found["stages.a.hidden_layers"]
    assert "prompt_token_ids are token ids: map them from \"token_ids\" (or \"prompt_token_ids\"), not 'text'" in \
        found["pipelines.p.edges[0].map.prompt_token_ids"]
    assert "pipeline parallelism cannot give them" in found["stages.pp.args.pipeline_parallel_size"][0]


def test_window_n_into_an_engine_that_needs_its_whole_input_is_refused(tmp_path: Path, models: Path) -> None:
    data = minimal(edges=[edge("a", "sd", window=2), edge("a", "llm", window=8)], stages=["a", "sd", "llm"])
    data["stages"].update({"sd": {"engine": "diffusers", "model": "sd"}, "llm": {"engine": "vllm", "model": "llm"}})
    found = problems(data, tmp_path)
    assert found["pipelines.p.edges[0].window"] == [
        "stage 'sd' (diffusers) cannot be fed by a window edge: it needs its whole prompt (a diffusion model "
        "conditions every step on all of it). Only python stages take streamed inputs; use window = -1"]
    assert "it needs its whole prompt before it can start generating" in found["pipelines.p.edges[1].window"][0]


def test_a_stage_fed_by_a_window_edge_takes_no_other_input(tmp_path: Path) -> None:
    found = problems(minimal(edges=[edge("a", "c", window=2), edge("b", "c")]), tmp_path)
    assert found["pipelines.p.edges"] == [
        "stage 'c' is fed by a window edge from 'a' and also by 'b': a stage fed by a window edge takes no "
        "other input (merge them upstream, or use window = -1)"]


def test_window_minus_one_is_the_full_trigger(tmp_path: Path) -> None:
    p = parse(minimal(edges=[edge("a", "b", window=-1), edge("b", "c")]), tmp_path).pipelines["p"]
    assert [e.window for e in p.edges] == [-1, -1] and C.FULL_WINDOW == -1


def test_pipeline_problems(tmp_path: Path) -> None:
    data = minimal(timeout_s=0, retries=-1, stage=["a"])
    data["pipelines"]["empty"] = {"stages": []}
    data["pipelines"]["nostages"] = {}
    data["pipelines"]["bad name!"] = {"stages": ["a"]}
    found = problems(data, tmp_path)
    assert found["pipelines.p.timeout_s"] == ["must be > 0, not 0"]
    assert found["pipelines.p.retries"] == ["must be >= 0, not -1"]
    assert any("unknown key" in m for m in found["pipelines.p.stage"])
    assert found["pipelines.empty.stages"] == ["must name at least one stage"]
    assert found["pipelines.nostages.stages"] == ["is required"]
    assert "pipelines.bad name!" in found


def test_nothing_defined(tmp_path: Path) -> None:
    found = problems({}, tmp_path)
    assert found == {"stages": ["no stages are defined"], "pipelines": ["no pipelines are defined"]}


# ------------------------------------------------------------------------- every problem at once


def test_every_problem_is_reported_at_once_with_its_key_path(tmp_path: Path, models: Path) -> None:
    data = {
        "extras": 1,
        "daemon": {"socket_mode": "x", "log_level": "loud"},
        "stages": {
            "gen": {"engine": "vllm", "model": "empty", "max_inflight": 0, "defaults": {"max_tokenz": 1}},
            "draw": {"engine": "diffusers", "model": "nowhere", "defaults": {"width": 100}},
            "post": py(devices=[0, 0], colour="red", queue_capacity="4"),
            "bad": {"engine": "onnx"},
            "fn": {**py(env={"A": 1}), "function": "teststages.sleep"},
        },
        "pipelines": {
            "loop": {"stages": ["post", "fn"], "edges": [edge("post", "fn"), edge("fn", "post")]},
            "p": {"stages": ["gen", "draw"], "edges": [edge("gen", "draw", window=4)]},
        },
    }
    expected = {
        "extras": "unknown key",
        "daemon.socket_mode": "octal string",
        "daemon.log_level": "must be one of",
        "stages.gen.model": "has no config.json",
        "stages.gen.max_inflight": "must be > 0",
        "stages.gen.defaults.max_tokenz": "unknown parameter for engine 'vllm'",
        "stages.draw.model": "does not exist",
        "stages.draw.defaults.width": "must be a multiple of 8, not 100",
        "stages.post.devices[1]": "device 0 is given twice",
        "stages.post.colour": "unknown key",
        "stages.post.queue_capacity": "must be an integer, not a string",
        "stages.bad.engine": "unknown engine 'onnx'",
        "stages.fn.function": "must be \"package.module:function\"",
        "stages.fn.env.A": "must be a string, not an integer",
        "pipelines.loop.edges": "cycle",
        "pipelines.p.edges[0].window": "cannot be fed by a window edge",
    }
    with pytest.raises(C.ConfigError) as err:
        C.parse(data, base=tmp_path, source="omnid.toml")
    found: dict[str, list[str]] = {}
    for p in err.value.problems:
        found.setdefault(p.path, []).append(p.message)
    for path, fragment in expected.items():
        assert any(fragment in m for m in found.get(path, [])), f"{path}: {fragment!r} not in {found}"
    text = str(err.value)
    assert text.startswith(f"omnid.toml: {len(err.value.problems)} problem(s)\n")
    assert "\n  stages.draw.defaults.width: must be a multiple of 8, not 100" in text
    assert err.value.source == "omnid.toml"
    assert str(C.Problem("a.b", "msg")) == "a.b: msg"


# ------------------------------------------------------------------------- stages


def test_accepted_params_by_engine(tmp_path: Path, models: Path) -> None:
    data = {"stages": {"gen": {"engine": "vllm", "model": "llm", "defaults": {"max_tokens": 8}},
                       "draw": {"engine": "diffusers", "model": "sd", "defaults": {"num_inference_steps": 2}},
                       "post": py(defaults={"seconds": 0.1})},
            "pipelines": {"p": {"stages": ["gen", "draw", "post"]}}}
    cfg = parse(data, tmp_path)
    accepted = {name: stage_accepts(s.engine, s.defaults) for name, s in cfg.stages.items()}
    assert accepted["gen"] == VLLM_PARAMS and accepted["draw"] == DIFFUSERS_PARAMS
    assert accepted["post"] is None                                  # any name
    assert dict(cfg.stages["post"].defaults) == {"seconds": 0.1}
    assert cfg.stages["gen"].model == tmp_path / "llm" and cfg.stages["draw"].model == tmp_path / "sd"


def test_model_dirs_are_checked(tmp_path: Path, models: Path) -> None:
    data = {"stages": {"gen": {"engine": "vllm", "model": "sd"},                     # a diffusers dir
                       "draw": {"engine": "diffusers", "model": "llm"},             # a vllm dir
                       "gen2": {"engine": "vllm", "model": str(tmp_path / "nope")},
                       "draw2": {"engine": "diffusers"},
                       "gen3": {"engine": "vllm", "model": "llm", "function": "teststages:sleep"}},
            "pipelines": {"p": {"stages": ["gen"]}}}
    found = problems(data, tmp_path)
    assert found["stages.gen.model"] == [f"{str(tmp_path / 'sd')!r} has no config.json; is it a vllm model?"]
    assert found["stages.draw.model"] == [f"{str(tmp_path / 'llm')!r} has no model_index.json; is it a diffusers model?"]
    assert found["stages.gen2.model"] == [f"directory {str(tmp_path / 'nope')!r} does not exist"]
    assert found["stages.draw2.model"] == ["is required for engine 'diffusers'"]
    assert found["stages.gen3.function"] == ["only python stages take a function, not 'vllm'"]


def test_python_stage_function(tmp_path: Path) -> None:
    saved = list(sys.path)
    data = {"stages": {"nofn": {"engine": "python"},
                       "form": py(function="sleep:too:many"),
                       "missing": {"engine": "python", "function": "no_such_module_omnid_u:run",
                                   "python_path": [str(FIXTURES)]},
                       "ok": py()},
            "pipelines": {"p": {"stages": ["ok"]}}}
    found = problems(data, tmp_path)
    assert found["stages.nofn.function"] == ["is required for engine 'python' (or a batch_function, or sessions)"]
    assert found["stages.form.function"] == ["must be \"package.module:function\", not 'teststages:sleep:too:many'"]
    assert found["stages.missing.function"] == \
        [f"module 'no_such_module_omnid_u' cannot be found in python_path ({FIXTURES}; relative folders are "
         "from the config file's folder) nor on sys.path"]
    assert "stages.ok.function" not in found
    assert sys.path == saved, "python_path must not stay on sys.path"


def test_python_path_is_where_the_module_is_found(tmp_path: Path) -> None:
    if importlib.util.find_spec("teststages") is not None:
        pytest.skip("teststages is importable from sys.path in this process")
    data = {"stages": {"a": {"engine": "python", "function": "teststages:sleep"}},
            "pipelines": {"p": {"stages": ["a"]}}}
    assert problems(data, tmp_path) == {"stages.a.function": [
        "module 'teststages' cannot be found on sys.path (python_path is empty; its folders are relative to "
        "the config file's folder)"]}
    data["stages"]["a"]["python_path"] = [str(FIXTURES)]
    assert parse(data, tmp_path).stages["a"].python_path == (FIXTURES,)


def test_a_module_not_found_names_the_folders_searched(tmp_path: Path) -> None:
    """python_path's relative folders are from the config's folder; the problem names each folder as
    resolved, and marks one that does not exist."""
    (tmp_path / "there").mkdir()
    data = {"stages": {"a": {"engine": "python", "function": "no_such_module_omnid_v:run",
                             "python_path": ["there", "etc/examples"]}},
            "pipelines": {"p": {"stages": ["a"]}}}
    assert problems(data, tmp_path) == {"stages.a.function": [
        f"module 'no_such_module_omnid_v' cannot be found in python_path ({tmp_path / 'there'}, "
        f"{tmp_path / 'etc/examples'} (no such folder); relative folders are from the config file's folder) "
        "nor on sys.path"]}


def test_what_a_python_stage_produces_is_known_from_its_config_or_its_source(tmp_path: Path) -> None:
    examples = str(Path(__file__).resolve().parents[3] / "etc/examples")
    data = {"stages": {"said": {"engine": "python", "function": "json:dumps", "produces": ["text", "audio"]},
                       "voc": {"engine": "python", "function": "demo_stages:vocoder", "python_path": [examples]},
                       "c2w": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav"},
                       "quiet": {"engine": "python", "function": "json:dumps"}},
            "pipelines": {"p": {"stages": ["said"]}}}
    stages = parse(data, tmp_path).stages
    assert stages["said"].produces == ("audio", "text")
    assert stages["voc"].produces == ("audio", "text")          # vocoder.produces = (...) in its file
    assert stages["c2w"].produces == ("audio",)                  # a class's own `produces`
    assert stages["quiet"].produces is None
    bad = {"stages": {"a": {"engine": "python", "function": "json:dumps", "produces": ["sound"]}},
           "pipelines": {"p": {"stages": ["a"]}}}
    assert list(problems(bad, tmp_path)) == ["stages.a.produces"]


def test_stage_fields(tmp_path: Path) -> None:
    data = minimal()
    data["stages"]["a"] = py(devices=[3, 1], exclusive=True, queue_capacity=2, env={"X": "1"},
                             args={"k": [1, 2]}, model="weights")
    data["stages"]["b"] = py(devices=[0])
    cfg = parse(data, tmp_path)
    a = cfg.stages["a"]
    assert (a.devices, a.exclusive, a.queue_capacity) == ((3, 1), True, 2)
    assert (dict(a.env), dict(a.args)) == ({"X": "1"}, {"k": [1, 2]})
    assert a.model == tmp_path / "weights"             # a python stage's model is not checked
    assert cfg.devices == (0, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.engine = "vllm"      # type: ignore[misc]


def test_stage_problems(tmp_path: Path, models: Path) -> None:
    data = minimal()
    data["stages"].update({
        "one": py(max_inflight=2),     # python generators are advanced in turn
        "sd": {"engine": "diffusers", "model": "sd", "max_inflight": 2},      # batched pipeline calls
        "sdbig": {"engine": "diffusers", "model": "sd", "max_inflight": 65},
        "many": {"engine": "vllm", "model": "llm", "max_inflight": 8},
        "ex": py(devices=[0, 1], exclusive=True),
        "shared": py(devices=[1, -1, True]),
        "bad-name!": py(),
        "notable": "python",
    })
    found = problems(data, tmp_path)
    assert "stages.one.max_inflight" not in found
    assert "stages.sd.max_inflight" not in found
    assert found["stages.sdbig.max_inflight"] == [
        "engine 'diffusers' batches at most 64 jobs in one pipeline call; must be from 1 to 64, not 65"]
    assert "stages.many.max_inflight" not in found
    assert found["stages.ex.devices"] == ["device 1 is also given to shared, but this stage is exclusive"]
    assert found["stages.shared.devices[1]"] == ["must be a GPU index >= 0, not -1"]
    assert found["stages.shared.devices[2]"] == ["must be a GPU index >= 0, not a boolean"]
    assert "stages.shared.devices" not in found                 # only the exclusive stage complains
    assert "stages.bad-name!" in found
    assert found["stages.notable"] == ["must be a table, not a string"]


# ------------------------------------------------------------------------- paths


def test_paths_resolve_relative_to_base(tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "etc"
    (base / "mods").mkdir(parents=True)
    (base / "mods" / "mystage_omnid_u.py").write_text("def run(inputs, params, ctx):\n    return {}\n")
    monkeypatch.setenv("OMNID_U_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir("/")                                  # the process's cwd must not matter
    data = {
        "daemon": {"socket": "run/omnid.sock", "state_dir": "~/state", "lock_dir": "$OMNID_U_DIR/lock"},
        "stages": {"gen": {"engine": "vllm", "model": "../llm"},
                   "draw": {"engine": "diffusers", "model": str(tmp_path / "sd")},
                   "post": {"engine": "python", "function": "mystage_omnid_u:run", "python_path": ["mods"]}},
        "pipelines": {"p": {"stages": ["gen", "draw", "post"]}},
    }
    cfg = parse(data, base)
    assert cfg.daemon.socket == base / "run" / "omnid.sock"
    assert cfg.daemon.state_dir == tmp_path / "home" / "state"
    assert cfg.daemon.lock_dir == tmp_path / "lock"
    assert cfg.stages["gen"].model == base / ".." / "llm"
    assert cfg.stages["draw"].model == tmp_path / "sd"       # absolute stays as it is
    assert cfg.stages["post"].python_path == (base / "mods",)
    # Relative to base only: the same data with another base finds no model.
    found = problems(data, tmp_path / "elsewhere")
    assert set(found) == {"stages.gen.model", "stages.post.function"}


# ------------------------------------------------------------------------- replicas and sleeping


def one_stage(**stage: Any) -> dict[str, Any]:
    return {"stages": {"a": py(**stage)}, "pipelines": {"p": {"stages": ["a"]}}}


def test_replicas_share_devices_or_get_one_set_each(tmp_path: Path) -> None:
    a = parse(one_stage(replicas=3), tmp_path).stages["a"]
    assert (a.replicas, a.devices, a.replica_devices) == (3, (), ())
    assert [a.for_replica(i).devices for i in range(3)] == [(), (), ()]
    cfg = parse(one_stage(devices=[[1], [0, 2]]), tmp_path)
    a = cfg.stages["a"]
    assert (a.replicas, a.devices, a.replica_devices) == (2, (0, 1, 2), ((1,), (0, 2)))
    assert a.for_replica(1).devices == (0, 2) and a.for_replica(1).replica_devices == ()
    assert cfg.devices == (0, 1, 2)
    shared = parse(one_stage(devices=[0], replicas=2), tmp_path).stages["a"]
    assert [shared.for_replica(i).devices for i in range(2)] == [(0,), (0,)]
    assert parse(one_stage(idle_unload_s=5), tmp_path).stages["a"].idle_unload_s == 5.0
    assert parse(one_stage(), tmp_path).stages["a"].idle_unload_s is None


@pytest.mark.parametrize("stage, path, fragment", [
    ({"replicas": 0}, "stages.a.replicas", "must be from 1 to 64, not 0"),
    ({"replicas": 65}, "stages.a.replicas", "from 1 to 64"),
    ({"replicas": "2"}, "stages.a.replicas", "must be an integer"),
    ({"devices": [[0], [1]], "replicas": 3}, "stages.a.devices", "gives 2 device sets (one per replica), but replicas = 3"),
    ({"devices": [[0], 1]}, "stages.a.devices", "not a mix"),
    ({"devices": [[0], []]}, "stages.a.devices[1]", "a replica's device set is empty"),
    ({"devices": [[0], [0, 0]]}, "stages.a.devices[1][1]", "device 0 is given twice"),
    ({"devices": [[0], [0]], "exclusive": True}, "stages.a.devices", "more than one replica"),
    ({"devices": [0], "replicas": 2, "exclusive": True}, "stages.a.devices", "would share device(s) [0]"),
    ({"idle_unload_s": 0}, "stages.a.idle_unload_s", "must be > 0"),
    ({"idle_unload_s": True}, "stages.a.idle_unload_s", "not a boolean"),
])
def test_bad_replicas_and_sleep_settings_are_reported(tmp_path: Path, stage: dict[str, Any], path: str,
                                                      fragment: str) -> None:
    reported(one_stage(**stage), tmp_path, path, fragment)


def test_a_reload_of_replicas_alone_keeps_the_workers(tmp_path: Path) -> None:
    before = parse(one_stage(devices=[[0], [1]]), tmp_path).stages["a"]
    more = parse(one_stage(devices=[[0], [1], [2]]), tmp_path).stages["a"]
    moved = parse(one_stage(devices=[[0], [3]]), tmp_path).stages["a"]
    other = parse(one_stage(devices=[[0], [1]], max_inflight=2), tmp_path).stages["a"]
    assert before.same_worker(more, 0) and before.same_worker(more, 1) and not before.same_worker(more, 2)
    assert before.same_worker(moved, 0) and not before.same_worker(moved, 1)
    assert not before.same_worker(other, 0)
    sleepy = parse(one_stage(devices=[[0], [1]], idle_unload_s=9), tmp_path).stages["a"]
    assert before.same_worker(sleepy, 0) and before.same_worker(sleepy, 1)


# --------------------------------------------------------------------------- placement = "ray"


def ray_config(daemon: dict[str, Any] | None = None, **stage: Any) -> dict[str, Any]:
    return {"daemon": {"ray_address": "10.0.0.1:6379", **(daemon or {})},
            "stages": {"a": py(), "b": py(**stage)}, "pipelines": {"p": {"stages": ["a", "b"]}}}


def test_ray_placement_and_resource_needs_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "ray_available", lambda: True)
    cfg = parse(ray_config(placement="ray", ray={"num_gpus": 1, "num_cpus": 2, "memory_mb": 512,
                                                 "resources": {"node2": 1}, "labels": {"zone": "b"}}), tmp_path)
    b = cfg.stages["b"]
    assert cfg.daemon.ray_address == "10.0.0.1:6379"
    assert b.placement == ("ray",) and b.placement_of(0) == "ray" and cfg.stages["a"].placement_of(0) == "local"
    assert b.ray.actor_options() == {"num_cpus": 2.0, "num_gpus": 1.0, "memory": 512 << 20,
                                     "resources": {"node2": 1.0}, "label_selector": {"zone": "b"}}
    mixed = parse(ray_config(placement=["local", "ray"], replicas=2), tmp_path).stages["b"]
    assert [mixed.placement_of(i) for i in range(2)] == ["local", "ray"]
    local = parse(ray_config(placement="local"), tmp_path).stages["b"]
    assert local.placement == () and local.placement_of(0) == "local"
    pickle.loads(pickle.dumps(cfg))         # handed to workers and actors


def test_ray_placement_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "ray_available", lambda: True)
    found = problems({**ray_config(placement="ray"), "daemon": {}}, tmp_path)
    assert "is required" in found["daemon.ray_address"][0]
    found = problems(ray_config(placement="cloud"), tmp_path)
    assert "must be one of 'local', 'ray'" in found["stages.b.placement"][0]
    found = problems(ray_config(placement=["ray"], replicas=2), tmp_path)
    assert "one per replica" in found["stages.b.placement"][0]
    found = problems(ray_config(placement="ray", devices=[0]), tmp_path)
    assert "ray.num_gpus" in found["stages.b.devices"][0]
    found = problems(ray_config(placement="ray", ray={"gpus": 1, "num_cpus": -1, "resources": {"x": "y"}}),
                     tmp_path)
    assert "unknown key" in found["stages.b.ray.gpus"][0]
    assert "stages.b.ray.num_cpus" in found and "stages.b.ray.resources.x" in found


def test_ray_placement_without_ray_installed_is_a_check_error(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "ray_available", lambda: False)
    found = problems(ray_config(placement="ray"), tmp_path)
    assert found["stages.b.placement"] == ["\"ray\" needs Ray, which is not installed: pip install 'omnid[ray]'"]
    parse(ray_config(), tmp_path)           # without a Ray-placed stage, no Ray needed


def test_a_pipeline_keeps_outputs_of_stages_that_are_not_last(tmp_path: Path) -> None:
    stages = {"a": py(), "b": py()}
    good = {"stages": stages, "pipelines": {"p": {"stages": ["a", "b"], "outputs": {"a": ["text"]}}}}
    p = parse(good, tmp_path).pipelines["p"]
    assert p.sinks == ("a", "b") and p.keep == {"a": ("text",)}
    assert p.kept("a", {"text": "t", "ids": [1]}) == {"text": "t"}          # only the named ones
    assert p.kept("b", {"x": 1, "y": 2}) == {"x": 1, "y": 2}                # a last stage's: all
    assert p.as_api()["kept_outputs"] == {"a": ["text"]}
    bad = {"stages": stages, "pipelines": {"p": {"stages": ["a", "b"],
                                                 "outputs": {"b": ["x"], "c": ["x"], "a": "text"}}}}
    found = problems(bad, tmp_path)
    assert "a last stage: all its outputs are the job's already" in found["pipelines.p.outputs.b"][0]
    assert "is not in the pipeline" in found["pipelines.p.outputs.c"][0]
    assert "must be a list of output names" in found["pipelines.p.outputs.a"][0]


# ------------------------------------------------------------------------- the checker's own words


def test_checker_get_names_the_kinds_wanted_and_the_value_found() -> None:
    from omnid.config.checker import Checker, typename

    c = Checker()
    data = {"n": "3", "flag": True, "ratio": [1], "t": 5, "x": 1.5, "ok": 3, "b": True}
    assert c.get(data, "n", "stages.a", int) is None
    assert c.get(data, "flag", "stages.a", (int, float), 7) == 7
    assert c.get(data, "ratio", "", (dict, list, str, bool, int, float, bytes)) == [1]
    assert c.get(data, "t", "top", (dict, str)) is None
    assert c.get(data, "x", "top", (list, bytes)) is None
    assert c.get(data, "ok", "", int) == 3 and c.get(data, "b", "", (bool, int)) is True
    assert c.get(data, "missing", "top", int, 9) == 9 and c.problems[-1].path == "top.x"
    assert c.get(data, "needed", "", int, required=True) is None
    assert [str(p) for p in c.problems] == [
        "stages.a.n: must be an integer, not a string",
        "stages.a.flag: must be an integer or a number, not a boolean",
        "top.t: must be a table or a string, not an integer",
        "top.x: must be an array or bytes, not a number",
        "needed: is required",
    ]
    c2 = Checker()
    assert c2.table([1], "stages.a.args") == {} and c2.table({"k": 1}, "p") == {"k": 1}
    assert c2.table(None, "p") == {}
    assert [str(p) for p in c2.problems] == ["stages.a.args: must be a table, not an array", "p: must be a table, not NoneType"]
    assert [typename(v) for v in ({}, [], "", False, 0, 0.0, None, b"")] == [
        "a table", "an array", "a string", "a boolean", "an integer", "a number", "NoneType", "bytes"]


def test_callable_refs_are_checked_in_form_and_found_on_the_python_path(tmp_path: Path) -> None:
    from omnid.config.checker import Checker, check_callable_ref

    (tmp_path / "mine_pkg").mkdir()
    (tmp_path / "mine_pkg" / "__init__.py").write_text("")
    (tmp_path / "mine_pkg" / "steps.py").write_text("def run(x):\n    return x\n")
    c = Checker()
    check_callable_ref(c, "mine_pkg.steps:run", "a", (tmp_path,))
    check_callable_ref(c, "json:loads", "b", (tmp_path,))           # the python path comes before sys.path, not instead
    assert c.problems == []
    for ref in ("mine_pkg.steps", ":run", "mine_pkg.steps:", "a:b:c", "mine pkg:run", "m:1run"):
        check_callable_ref(c, ref, "p", (tmp_path,))
    assert [p.message for p in c.problems] == [f"must be \"package.module:function\", not {r!r}" for r in (
        "mine_pkg.steps", ":run", "mine_pkg.steps:", "a:b:c", "mine pkg:run", "m:1run")]
    (tmp_path / "solo_step_mod.py").write_text("def run(x):\n    return x\n")
    c = Checker()
    check_callable_ref(c, "solo_step_mod:run", "p", ())
    assert [p.message for p in c.problems] == ["module 'solo_step_mod' cannot be found on sys.path (python_path is "
                                               "empty; its folders are relative to the config file's folder)"]
    check_callable_ref(c, "solo_step_mod:run", "p", (tmp_path,))
    assert len(c.problems) == 1
