"""`[stages.NAME] batching = "step" | "call"`: a diffusers stage's choice, refused elsewhere or with
another value, naming the key.

In-process: omnid.config's parse; no daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omnid import config as C


def _parse(tmp: Path, engine: str, **stage: object) -> C.Config:
    (tmp / "sd").mkdir(exist_ok=True)
    (tmp / "sd" / "model_index.json").write_text("{}")
    base = {"engine": "diffusers", "model": str(tmp / "sd")} if engine == "diffusers" else \
        {"engine": "python", "function": "json:dumps"}
    data = {"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state")},
            "stages": {"s": {**base, **stage}}, "pipelines": {"p": {"stages": ["s"]}}}
    return C.parse(data, base=tmp)


def test_a_diffusers_stage_batches_per_step_unless_told_per_call(tmp_path: Path) -> None:
    assert _parse(tmp_path, "diffusers").stages["s"].batching == "step"
    assert _parse(tmp_path, "diffusers", batching="call").stages["s"].batching == "call"


@pytest.mark.parametrize(("engine", "value", "says"), [
    ("diffusers", "token", "stages.s.batching: must be one of 'step', 'call', not 'token'"),
    ("python", "call", "stages.s.batching: only diffusers stages choose how they batch, not 'python'"),
])
def test_a_bad_batching_is_refused_naming_the_key(tmp_path: Path, engine: str, value: str, says: str) -> None:
    with pytest.raises(C.ConfigError) as e:
        _parse(tmp_path, engine, batching=value)
    assert says in str(e.value)
