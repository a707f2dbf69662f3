"""Every TOML example in docs/ passes the check `omnid --check` makes (omnid.config.load), in the context a
reader would put it in: merged over the demo config (etc/omnid-demo.toml), its relative paths from a
config in etc/ of the checkout, as the examples are written.

- A stage the example gives replaces the demo's stage of that name (and the demo's pipelines through it
  are left out); a pipeline the example gives with `stages` replaces the demo's, one without
  (`[pipelines.omni] realtime = ...`) adds its keys to the demo's.
- A model at a path this host does not have (`/srv/models/...`, a real checkpoint's) gets a stand-in: a
  folder with the config.json (or model_index.json) of the tiny model of its kind, at a real checkpoint's
  depth (32 layers), so that the checks that read a model's files (media, widths, layers, DiT or UNet) run.
- A python module the example names that is nowhere (the reader's own `voice:talk`) is a stub of that
  name beside the config, and a stage a pipeline names that no table defines is a python stub stage.

Anything else the check refuses fails the test with the check's own words. In-process; no daemon.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from omnidtest import toml_dumps

from omnid import config as C

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / ".models"


def examples() -> list[tuple[str, str]]:
    """(page:line, block) of every ```toml block in docs/ (indented ones too)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^( *)```toml\n(.*?)^\1```", text, re.S | re.M):
            block = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines()) + "\n"
            found.append((f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", block))
    return found


def stand_in(path: Path, engine: str, stage: dict[str, Any], original: str) -> None:
    """A folder at `path` shaped as a real checkpoint of `engine`: the tiny model's index files, 32 layers."""
    if engine == "diffusers":
        kind = "dit" if "cache" in stage else "sd"
        path.mkdir(parents=True)
        for f in (MODELS / kind).iterdir():
            (path / f.name).symlink_to(f)
        return
    kind = "vlm" if "llava" in original.lower() else "llm"
    path.mkdir(parents=True)
    cfg = json.loads((MODELS / kind / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        if "num_hidden_layers" in c:
            c["num_hidden_layers"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    for f in (MODELS / kind).iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)


def compose(block: str, etc: Path) -> dict[str, Any]:
    """The demo config with the example merged over it (see the module's docstring), its stand-ins made."""
    demo = tomllib.loads((ROOT / "etc/omnid-demo.toml").read_text())
    ex = tomllib.loads(block)
    assert set(ex) <= {"daemon", "stages", "pipelines"}, f"a config example holds whole tables, not {set(ex)}"
    redefined = set(ex.get("stages", {})) & set(demo["stages"])
    data: dict[str, Any] = {"daemon": {**demo["daemon"], **ex.get("daemon", {})},
                            "stages": {**demo["stages"], **ex.get("stages", {})},
                            "pipelines": {name: pipe for name, pipe in demo["pipelines"].items()
                                          if not redefined & set(pipe["stages"])}}
    for name, pipe in ex.get("pipelines", {}).items():
        data["pipelines"][name] = pipe if "stages" in pipe else {**demo["pipelines"].get(name, {}), **pipe}
    stubs = etc / "stubs"
    for name, st in ex.get("stages", {}).items():
        model = st.get("model")
        if model is not None and not (etc / model).exists():
            where = etc / "models" / name
            stand_in(where, st.get("engine", ""), st, model)
            st["model"] = str(where)
        for key in ("function", "batch_function", "sessions"):
            ref = st.get(key)
            if ref is None:
                continue
            module, _, attr = ref.partition(":")
            if any((etc / p / f"{module}.py").exists() for p in st.get("python_path", [])) or \
                    (ROOT / "omnid").joinpath(*module.split(".")[1:]).with_suffix(".py").exists():
                continue
            stubs.mkdir(exist_ok=True)
            body = (f"class {attr}:\n    def __init__(self, load): ...\n    def open(self, inputs, params, ctx): ...\n"
                    "    def step(self, sessions): return [None for _ in sessions]\n") if key == "sessions" else \
                f"def {attr}(inputs, params, ctx):\n    return {{}}\n"
            (stubs / f"{module}.py").write_text(body)
            st["python_path"] = [*st.get("python_path", []), str(stubs)]
    for pipe in data["pipelines"].values():
        for stage in pipe.get("stages", []):
            if stage not in data["stages"]:
                data["stages"][stage] = {"engine": "python", "function": "json:dumps"}
    for edge in (e for pipe in data["pipelines"].values() for e in pipe.get("edges", [])):
        transform = edge.get("transform")
        if transform and (ROOT / "etc/examples" / (transform.split(":")[0] + ".py")).exists():
            src = data["stages"][edge["from"]]   # the transform runs in the upstream's worker, on its python_path
            src["python_path"] = [*src.get("python_path", []), "examples"]
    return data


@pytest.fixture(scope="module")
def etc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder each example's checkout is made in."""
    return tmp_path_factory.mktemp("docs-examples")


def check(block: str, top: Path, name: str) -> list[str]:
    """The problems `omnid --check` reports for the example, in its words ([] when it passes), its config
    written in etc/ of a checkout's layout: etc/'s files (the demo's python stages, examples/) and .models."""
    folder = top / name / "etc"
    folder.mkdir(parents=True)
    for f in (ROOT / "etc").iterdir():
        (folder / f.name).symlink_to(f)
    (top / name / ".models").symlink_to(MODELS)
    data = compose(block, folder)
    for key in ("socket", "state_dir", "lock_dir"):
        data["daemon"][key] = str(folder / "run" / key)
    path = folder / "omnid.toml"
    path.unlink(missing_ok=True)        # (a link to the checkout's etc/omnid.toml: never written through)
    path.write_text(toml_dumps(data))
    try:
        C.load(path)
    except C.ConfigError as e:
        return [str(p) for p in e.problems]
    return []


@pytest.mark.parametrize("where,block", examples(), ids=[w for w, _ in examples()])
def test_each_config_example_in_the_docs_passes_the_check(where: str, block: str, etc: Path) -> None:
    problems = check(block, etc, re.sub(r"\W", "_", where))
    assert problems == [], f"{where}: omnid --check refuses it:\n" + "\n".join(problems)


def test_the_check_refuses_a_wrong_example(etc: Path) -> None:
    """The same machinery on an example with a wrong key, a wrong value and a stage of no engine fails."""
    where, block = next((w, b) for w, b in examples() if "[stages.describe]" in b)
    assert check(block, etc, "good") == []
    assert any("colour" in p for p in check(block.replace("max_inflight", "colour"), etc, "unknown_key"))
    assert check(block.replace("max_inflight = 8", "max_inflight = 0"), etc, "bad_value") != []
    assert check(block.replace('engine = "vllm"', 'engine = "onnx"'), etc, "bad_engine") != []


def test_there_are_config_examples_to_check() -> None:
    assert len(examples()) >= 15
