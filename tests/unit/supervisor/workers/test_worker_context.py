"""Which start method a stage's worker gets: forked from the preloaded fork server (a CPU stage with
no `env` of its own), or spawned bare (a GPU stage, a stage with an `env`, preload_workers = false)."""

from __future__ import annotations

from pathlib import Path

from omnid import protocol as P
from omnid.config import parse
from omnid.supervisor.workers.worker_process import forked


def _spec(tmp_path: Path, stage: str, preload: bool = True) -> P.WorkerSpec:
    (tmp_path / "llm").mkdir(exist_ok=True)
    (tmp_path / "llm" / "config.json").write_text("{}")       # (a model folder, as the config checks it)
    raw = {"daemon": {"socket": str(tmp_path / "s.sock"), "state_dir": str(tmp_path / "st"),
                      "lock_dir": str(tmp_path / "l"), "preload_workers": preload},
           "stages": {"cpu": {"engine": "python", "function": "json:dumps"},
                      "gpu": {"engine": "python", "function": "json:dumps", "devices": [0]},
                      "env": {"engine": "python", "function": "json:dumps", "env": {"X": "1"}},
                      "llm": {"engine": "vllm", "model": str(tmp_path / "llm")},
                      "llm_env": {"engine": "vllm", "model": str(tmp_path / "llm"), "env": {"X": "1"}}},
           "pipelines": {"p": {"stages": ["cpu"]}}}
    config = parse(raw, base=tmp_path)
    return P.WorkerSpec(stage=stage, config=config, data_dir=tmp_path, jobs_dir=tmp_path, parent_pid=1)


def test_a_cpu_stage_is_forked_from_the_server_and_others_are_spawned(tmp_path: Path) -> None:
    assert forked(_spec(tmp_path, "cpu"))
    assert not forked(_spec(tmp_path, "gpu"))
    assert forked(_spec(tmp_path, "env"))          # python preloads nothing an env could be late for
    assert forked(_spec(tmp_path, "llm"))
    assert not forked(_spec(tmp_path, "llm_env"))  # vLLM read its env as the server imported it
    assert not forked(_spec(tmp_path, "cpu", preload=False))


def test_a_torch_stage_s_openmp_threads_sleep_when_they_wait_unless_its_env_says(tmp_path: Path, monkeypatch) -> None:
    """A python (or diffusers) stage's worker sets OMP_WAIT_POLICY=PASSIVE before torch loads (a spinning
    team stalls on shared cores); a stage's own `env` wins; a vLLM stage's is left alone."""
    import os
    import sys

    from omnid.worker.bootstrap import setup_environment

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = dict(os.environ)
    try:
        for stage, env, want in (("cpu", {}, "PASSIVE"), ("env", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                 ("llm", {}, None)):
            os.environ.pop("OMP_WAIT_POLICY", None)
            spec = _spec(tmp_path, stage)
            spec.config.stages[stage].env.update(env)
            setup_environment(spec)
            assert os.environ.get("OMP_WAIT_POLICY") == want, stage
    finally:
        os.environ.clear()
        os.environ.update(before)
