"""`omnid --check` and the config parser: every problem reported, with its key path.

Most tests run `python -m omnid -c FILE --check` as a real subprocess on a file
written to a tmp dir, the way an operator would; a few call `omnid.config`
directly for what the parser hands the daemon (default edges, sources/sinks,
resolved paths).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, ROOT, edge, toml_dumps

from omnid import config as C
from omnid.engines.capabilities import stage_accepts

# ------------------------------------------------------------------------- helpers


def run_omnid(path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnid", "-c", str(path), *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def problems(stderr: str) -> dict[str, list[str]]:
    """`  key.path: message` lines of omnid's report, by key path."""
    found: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        if line.startswith("  ") and ": " in line:
            key, _, message = line.strip().partition(": ")
            found.setdefault(key, []).append(message)
    return found


def assert_reported(result: subprocess.CompletedProcess[str], expected: list[tuple[str, str]]) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "invalid configuration" in result.stderr, result.stderr
    got = problems(result.stderr)
    for key, fragment in expected:
        assert any(fragment in m for m in got.get(key, [])), \
            f"no problem {key!r} containing {fragment!r} in:\n{result.stderr}"


def base_config(tmp_path: Path) -> dict[str, Any]:
    """A valid config using all three engines; model paths are relative to the file."""
    return {
        "daemon": {"socket": str(tmp_path / "omnid.sock"), "state_dir": "state", "lock_dir": "lock"},
        "stages": {
            "expand": {"engine": "vllm", "model": "llm", "defaults": {"max_tokens": 8}},
            "draw": {"engine": "diffusers", "model": "sd", "defaults": {"num_inference_steps": 2}},
            "post": {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]},
            "post2": {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]},
        },
        "pipelines": {
            "t2i": {"stages": ["expand", "draw"],
                    "edges": [{"from": "expand", "to": "draw", "window": -1, "map": {"prompt": "text"}}],
                    "timeout_s": 30},
            "chain": {"stages": ["post", "post2"]},
        },
    }


def write_config(tmp_path: Path, data: dict[str, Any], name: str = "omnid.toml") -> Path:
    path = tmp_path / name
    path.write_text(toml_dumps(data))
    return path


# ------------------------------------------------------------------------- --check, one problem each

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(cfg: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return mutate


def _delete(path: str) -> Mutation:
    def mutate(cfg: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[last]
    return mutate


def _pipeline(name: str, stages: list[str], edges: list[dict[str, Any]] | None = None) -> Mutation:
    body: dict[str, Any] = {"stages": stages}
    if edges is not None:
        body["edges"] = edges
    return _set(f"pipelines.{name}", body)


def _both(*mutations: Mutation) -> Mutation:
    def mutate(cfg: dict[str, Any]) -> None:
        for m in mutations:
            m(cfg)
    return mutate


CASES: dict[str, tuple[Mutation, list[tuple[str, str]]]] = {
    "bad default value": (_set("stages.draw.defaults", {"num_inference_steps": 0, "width": 100}),
                          [("stages.draw.defaults.num_inference_steps", "must be from 1 to 1000, not 0"),
                           ("stages.draw.defaults.width", "must be a multiple of 8, not 100")]),
    "queue_capacity checked beside an unknown engine": (
        _both(_set("stages.post.engine", "onnx"), _set("stages.post.queue_capacity", 0)),
        [("stages.post.engine", "unknown engine"), ("stages.post.queue_capacity", "must be > 0")]),
    "unknown engine": (_set("stages.post.engine", "onnx"),
                       [("stages.post.engine", "unknown engine 'onnx'")]),
    "vllm model dir missing": (_set("stages.expand.model", "no-such-dir"),
                               [("stages.expand.model", "does not exist")]),
    "diffusers model dir missing": (_set("stages.draw.model", "/nonexistent/sd"),
                                    [("stages.draw.model", "'/nonexistent/sd' does not exist")]),
    "vllm model required": (_delete("stages.expand.model"),
                            [("stages.expand.model", "is required for engine 'vllm'")]),
    "vllm dir without config.json": (_set("stages.expand.model", "empty"),
                                     [("stages.expand.model", "has no config.json")]),
    "diffusers dir without model_index.json": (_set("stages.draw.model", "llm"),
                                               [("stages.draw.model", "has no model_index.json")]),
    "edge to an unknown stage": (_set("pipelines.t2i.edges", [edge("expand", "ghost")]),
                                 [("pipelines.t2i.edges[0].to", "unknown stage 'ghost'")]),
    "edge from an unknown stage": (_set("pipelines.t2i.edges", [edge("ghost", "draw")]),
                                   [("pipelines.t2i.edges[0].from", "unknown stage 'ghost'")]),
    "edge to a stage outside the pipeline": (
        _set("pipelines.t2i.edges", [edge("expand", "draw"), edge("draw", "post")]),
        [("pipelines.t2i.edges[1].to", "stage 'post' is not in this pipeline's stages")]),
    "cycle a->b->a": (_pipeline("loop", ["post", "post2"], [edge("post", "post2"), edge("post2", "post")]),
                      [("pipelines.loop.edges", "cycle: post -> post2 -> post")]),
    "self edge": (_pipeline("loop", ["post"], [edge("post", "post")]),
                  [("pipelines.loop.edges[0]", "to itself is a cycle")]),
    "window 0": (_set("pipelines.t2i.edges", [edge("expand", "draw", window=0)]),
                 [("pipelines.t2i.edges[0].window", "must be -1 (full trigger) or a segment count > 0, not 0")]),
    "window -2": (_set("pipelines.t2i.edges", [edge("expand", "draw", window=-2)]),
                  [("pipelines.t2i.edges[0].window", "not -2")]),
    "window string": (_set("pipelines.t2i.edges", [edge("expand", "draw", window="full")]),
                      [("pipelines.t2i.edges[0].window", "must be an integer, not a string")]),
    "window N>0 into diffusers": (_set("pipelines.t2i.edges", [edge("expand", "draw", window=4)]),
                                  [("pipelines.t2i.edges[0].window", "cannot be fed by a window edge")]),
    "device twice in one stage": (_set("stages.post.devices", [0, 0]),
                                  [("stages.post.devices[1]", "device 0 is given twice")]),
    "negative device": (_set("stages.post.devices", [-1]),
                        [("stages.post.devices[0]", "must be a GPU index >= 0")]),
    "exclusive device shared": (
        _both(_set("stages.draw.devices", [0, 1]), _set("stages.draw.exclusive", True),
              _set("stages.post.devices", [1])),
        [("stages.draw.devices", "device 1 is also given to post, but this stage is exclusive")]),
    "unknown stage key": (_set("stages.post.colour", "red"), [("stages.post.colour", "unknown key")]),
    "unknown daemon key": (_set("daemon.sockett", "/x"), [("daemon.sockett", "unknown key")]),
    "unknown top-level key": (_set("extras", {"a": 1}), [("extras", "unknown key")]),
    "unknown pipeline key": (_set("pipelines.chain.stage", ["post"]), [("pipelines.chain.stage", "unknown key")]),
    "unknown edge key": (_set("pipelines.t2i.edges", [edge("expand", "draw", windows=2)]),
                         [("pipelines.t2i.edges[0].windows", "unknown key")]),
    "queue_capacity string": (_set("stages.post.queue_capacity", "4"),
                              [("stages.post.queue_capacity", "must be an integer, not a string")]),
    "max_inflight 0": (_set("stages.expand.max_inflight", 0), [("stages.expand.max_inflight", "must be > 0, not 0")]),
    "devices not an array": (_set("stages.post.devices", 0), [("stages.post.devices", "must be an array")]),
    "exclusive not a boolean": (_set("stages.post.exclusive", "yes"),
                                [("stages.post.exclusive", "must be a boolean, not a string")]),
    "timeout not a number": (_set("pipelines.chain.timeout_s", "10s"),
                             [("pipelines.chain.timeout_s", "must be an integer or a number, not a string")]),
    "python stage without function": (_delete("stages.post.function"),
                                      [("stages.post.function", "is required for engine 'python' (or a batch_function, or sessions)")]),
    "bad function ref": (_set("stages.post.function", "teststages.echo"),
                         [("stages.post.function", 'must be "package.module:function"')]),
    "unimportable module": (_set("stages.post.function", "no_such_module_omnid_t:run"),
                            [("stages.post.function", "module 'no_such_module_omnid_t' cannot be found")]),
    "unknown vllm default param": (_set("stages.expand.defaults", {"max_tokenz": 3}),
                                   [("stages.expand.defaults.max_tokenz", "unknown parameter for engine 'vllm'")]),
    "unknown diffusers default param": (_set("stages.draw.defaults", {"steps": 3}),
                                        [("stages.draw.defaults.steps", "unknown parameter for engine 'diffusers'")]),
    "empty stage table": (_both(_set("stages.bare", {}), _pipeline("b", ["bare"])),
                          [("stages.bare.engine", "is required")]),
    "empty edge table": (_set("pipelines.t2i.edges", [{}]),
                         [("pipelines.t2i.edges[0].from", "is required"),
                          ("pipelines.t2i.edges[0].to", "is required")]),
    "python_path entry not a string": (_set("stages.post.python_path", [str(FIXTURES), 3]),
                                       [("stages.post.python_path[1]", "must be a string")]),
}


def test_check_valid_config(tmp_path: Path, models: Path) -> None:
    path = write_config(tmp_path, base_config(tmp_path))
    result = run_omnid(path, "--check")
    assert result.returncode == 0, result.stderr
    assert "OK (4 stages, 2 pipelines)" in result.stdout
    assert "expand -> draw" in result.stdout and "post -> post2" in result.stdout
    assert not (tmp_path / "omnid.sock").exists(), "--check must not start the daemon"


@pytest.mark.parametrize("case", list(CASES))
def test_check_reports_problem(case: str, tmp_path: Path, models: Path) -> None:
    mutate, expected = CASES[case]
    cfg = base_config(tmp_path)
    mutate(cfg)
    result = run_omnid(write_config(tmp_path, cfg), "--check")
    assert_reported(result, expected)


def test_the_sessions_stage_as_documented_checks_in_a_config_in_etc(tmp_path: Path) -> None:
    """The docs' Sessions block (docs/guides/python-stages.md) and etc/examples/sessions_stage.py's docstring, pasted into a config in
    etc/ (beside examples/, as in the repo): `omnid --check` finds the module. A wrong folder is named."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "examples").symlink_to(ROOT / "etc/examples")
    readme = (ROOT / "docs/guides/python-stages.md").read_text()
    [readme_block] = re.findall(r"```toml\n(\[stages\.talk\]\n.*?)```", readme, re.S)
    docstring = (ROOT / "etc/examples/sessions_stage.py").read_text()
    [example_block] = re.findall(r"\n    (\[stages\.talk\]\n(?:    \S.*\n)+)", docstring)
    daemon = f'[daemon]\nsocket = "{tmp_path / "omnid.sock"}"\nstate_dir = "state"\n\n'
    pipeline = '\n[pipelines.talk]\nstages = ["talk"]\n'
    for block in (readme_block, textwrap.dedent(example_block)):
        path = etc / "omnid.toml"
        path.write_text(daemon + block + pipeline)
        result = run_omnid(path, "--check")
        assert result.returncode == 0, (block, result.stderr)
    # the old text (a path from the repo's top) says which folder it searched, and that it is missing
    path.write_text(daemon + readme_block.replace('["examples"]', '["etc/examples"]') + pipeline)
    assert_reported(run_omnid(path, "--check"), [(
        "stages.talk.sessions", f"module 'sessions_stage' cannot be found in python_path ({etc / 'etc/examples'} "
        "(no such folder); relative folders are from the config file's folder) nor on sys.path")])


def test_check_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "omnid.toml"
    path.write_text('[stages.a]\nengine = "python\n')
    assert_reported(run_omnid(path, "--check"), [("(file)", "not valid TOML")])


def test_check_missing_file(tmp_path: Path) -> None:
    assert_reported(run_omnid(tmp_path / "nope.toml", "--check"), [("(file)", "cannot read")])


def test_check_reports_every_problem_in_one_run(tmp_path: Path, models: Path) -> None:
    cfg = base_config(tmp_path)
    faults: list[tuple[Mutation, str, str]] = [
        (_set("stages.post.engine", "onnx"), "stages.post.engine", "unknown engine"),
        (_set("stages.expand.model", "empty"), "stages.expand.model", "has no config.json"),
        (_set("stages.expand.max_inflight", 0), "stages.expand.max_inflight", "must be > 0"),
        (_set("stages.expand.defaults", {"max_tokenz": 1}), "stages.expand.defaults.max_tokenz", "unknown parameter"),
        (_set("stages.draw.model", "/nonexistent/sd"), "stages.draw.model", "does not exist"),
        (_set("stages.post2.devices", [0, 0]), "stages.post2.devices[1]", "given twice"),
        (_set("stages.post2.function", "teststages.echo"), "stages.post2.function", "package.module:function"),
        (_set("stages.post2.queue_capacity", "4"), "stages.post2.queue_capacity", "must be an integer"),
        (_set("stages.post2.colour", 1), "stages.post2.colour", "unknown key"),
        (_set("daemon.sockett", "/x"), "daemon.sockett", "unknown key"),
        (_set("extras", {"a": 1}), "extras", "unknown key"),
        (_set("pipelines.t2i.edges", [edge("expand", "draw", window=4)]), "pipelines.t2i.edges[0].window",
         "cannot be fed by a window edge"),
        (_pipeline("loop", ["post", "post2"], [edge("post", "post2"), edge("post2", "post")]),
         "pipelines.loop.edges", "cycle"),
        (_set("pipelines.chain.edges", [edge("post", "ghost")]), "pipelines.chain.edges[0].to", "unknown stage"),
    ]
    for mutate, _, _ in faults:
        mutate(cfg)
    result = run_omnid(write_config(tmp_path, cfg), "--check")
    assert_reported(result, [(key, fragment) for _, key, fragment in faults])
    reported = [ln for ln in result.stderr.splitlines() if ln.startswith("  ")]
    assert len(reported) >= len(faults), result.stderr


def test_daemon_refuses_to_start_with_the_same_report(tmp_path: Path, models: Path) -> None:
    cfg = base_config(tmp_path)
    _set("stages.post.engine", "onnx")(cfg)
    _set("pipelines.t2i.edges", [edge("expand", "draw", window=0)])(cfg)
    path = write_config(tmp_path, cfg)
    checked = run_omnid(path, "--check")
    started = run_omnid(path)
    assert started.returncode == 2, started.stderr
    assert started.stderr == checked.stderr
    assert_reported(started, [("stages.post.engine", "unknown engine"), ("pipelines.t2i.edges[0].window", "not 0")])
    assert not (tmp_path / "omnid.sock").exists()
    assert not (tmp_path / "state").exists() and not (tmp_path / "lock").exists()


# ------------------------------------------------------------------------- the parser, directly


def _parse(data: dict[str, Any], base: Path) -> C.Config:
    return C.parse(copy.deepcopy(data), base=base)


def test_chain_gets_default_edges_in_order(tmp_path: Path) -> None:
    stage = {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]}
    cfg = _parse({"stages": {"a": stage, "b": stage, "c": stage},
                  "pipelines": {"abc": {"stages": ["a", "b", "c"]}, "solo": {"stages": ["b"]}}}, tmp_path)
    abc = cfg.pipelines["abc"]
    assert [(e.src, e.dst, e.window, e.map) for e in abc.edges] == [("a", "b", -1, None), ("b", "c", -1, None)]
    assert abc.sources == ("a",) and abc.sinks == ("c",)
    assert cfg.pipelines["solo"].edges == () and cfg.pipelines["solo"].sources == ("b",) == cfg.pipelines["solo"].sinks


def test_diamond_sources_and_sinks(tmp_path: Path) -> None:
    stage = {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]}
    edges = [edge("a", "b", map={"text": "text"}), edge("a", "c"), edge("b", "d"), edge("c", "d"), edge("x", "d")]
    cfg = _parse({"stages": {n: stage for n in "abcdx"},
                  "pipelines": {"dia": {"stages": ["a", "b", "c", "d", "x"], "edges": edges}}}, tmp_path)
    p = cfg.pipelines["dia"]
    assert p.sources == ("a", "x") and p.sinks == ("d",)
    assert {e.src for e in p.incoming("d")} == {"b", "c", "x"}
    assert p.edges[0].map == {"text": "text"}
    assert p.as_api()["edges"][0] == {"from": "a", "to": "b", "window": -1, "map": {"text": "text"}, "transform": None}


def test_relative_paths_resolve_from_the_config_files_directory(tmp_path: Path, models: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    (sub / "mods").mkdir()
    (sub / "mods" / "mystage.py").write_text("def run(inputs, params, ctx):\n    return {}\n")
    data = base_config(tmp_path)
    data["daemon"] = {"socket": "run/omnid.sock", "state_dir": "state", "lock_dir": "lock"}
    data["stages"]["expand"]["model"] = "../llm"
    data["stages"]["draw"]["model"] = str(tmp_path / "sd")    # absolute stays as it is
    data["stages"]["post"] = {"engine": "python", "function": "mystage:run", "python_path": ["mods"]}
    path = write_config(sub, data)
    monkeypatch.chdir("/")                      # the process's cwd must not matter
    cfg = C.load(path)
    assert cfg.source == path.resolve()
    assert cfg.stages["expand"].model == sub.resolve() / ".." / "llm"
    assert cfg.stages["expand"].model.resolve() == (tmp_path / "llm").resolve()
    assert cfg.stages["draw"].model == tmp_path / "sd"
    assert cfg.stages["post"].python_path == (sub.resolve() / "mods",)
    assert cfg.daemon.socket == sub.resolve() / "run" / "omnid.sock"
    assert cfg.daemon.state_dir == sub.resolve() / "state"
    assert cfg.daemon.lock_dir == sub.resolve() / "lock"


def test_relative_model_dir_missing_next_to_the_file_is_a_problem(tmp_path: Path, models: Path) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    data = base_config(tmp_path)
    data["stages"]["expand"]["model"] = "../llm"   # exists, relative to etc/
    # "sd" exists in tmp_path but not in etc/: relative paths are not searched anywhere else.
    with pytest.raises(C.ConfigError) as err:
        C.load(write_config(sub, data))
    assert [(p.path, "does not exist" in p.message) for p in err.value.problems] == [("stages.draw.model", True)]


def test_parsed_stage_fields_and_device_order(tmp_path: Path, models: Path) -> None:
    data = base_config(tmp_path)
    data["stages"]["draw"].update(devices=[3, 1], exclusive=True, queue_capacity=2)
    data["stages"]["expand"].update(devices=[0], max_inflight=4, args={"max_model_len": 256})
    data["stages"]["post"].update(env={"A": "1"})
    cfg = _parse(data, tmp_path)
    draw, expand, post = cfg.stages["draw"], cfg.stages["expand"], cfg.stages["post"]
    assert draw.devices == (3, 1) and draw.exclusive and draw.queue_capacity == 2
    assert expand.max_inflight == 4 and dict(expand.args) == {"max_model_len": 256}
    assert cfg.devices == (0, 1, 3)                       # sorted: the lock order
    assert post.env == {"A": "1"} and stage_accepts(post.engine, post.defaults) is None
    assert "max_tokens" in (stage_accepts(expand.engine, expand.defaults) or ())
    assert cfg.daemon.max_queued_jobs == 256 and cfg.daemon.socket_mode == 0o660
    assert cfg.pipelines["t2i"].timeout_s == 30.0


def test_config_is_picklable_for_the_workers(tmp_path: Path, models: Path) -> None:
    import pickle
    cfg = C.load(write_config(tmp_path, base_config(tmp_path)))
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg


def test_socket_mode_as_octal_string(tmp_path: Path, models: Path) -> None:
    data = base_config(tmp_path)
    data["daemon"]["socket_mode"] = "0600"
    assert _parse(data, tmp_path).daemon.socket_mode == 0o600
    data["daemon"]["socket_mode"] = "rw-rw----"
    with pytest.raises(C.ConfigError) as err:
        _parse(data, tmp_path)
    assert [p.path for p in err.value.problems] == ["daemon.socket_mode"]
