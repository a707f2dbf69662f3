"""A vLLM stage's engine arguments and --check's parallelism rules (no vLLM import: in-process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omnidtest import tmpfs

from omnid import config as C
from omnid.engines.vllm_engine import COMPILE_ROOM, compile_cache_dirs, eager_if_no_room, engine_args, free_bytes

pytestmark = pytest.mark.vllm


def stage(args: dict[str, Any], devices: tuple[int, ...] = ()) -> C.StageConfig:
    return C.StageConfig(name="llm", engine="vllm", model=Path("/m"), devices=devices, args=args)


def test_one_process_by_default_and_mp_when_parallel() -> None:
    assert engine_args(stage({}))["distributed_executor_backend"] == "uni"
    assert "enforce_eager" not in engine_args(stage({}))                        # vLLM's default: compiled
    assert "enforce_eager" not in engine_args(stage({}, devices=(0,)))
    assert engine_args(stage({"enforce_eager": True}))["enforce_eager"] is True
    assert engine_args(stage({"tensor_parallel_size": 2}, (0, 1)))["distributed_executor_backend"] == "mp"
    assert engine_args(stage({"pipeline_parallel_size": 2}, (0, 1)))["distributed_executor_backend"] == "mp"
    assert engine_args(stage({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, (0, 1)))[
        "distributed_executor_backend"] == "ray"                                 # the stage's own choice wins


def problems(tmp_path: Path, args: dict[str, Any], devices: list[int]) -> dict[str, list[str]]:
    (tmp_path / "llm").mkdir(exist_ok=True)
    (tmp_path / "llm" / "config.json").write_text("{}")
    data = {"stages": {"llm": {"engine": "vllm", "model": "llm", "devices": devices, "args": args}},
            "pipelines": {"p": {"stages": ["llm"]}}}
    with pytest.raises(C.ConfigError) as err:
        C.parse(data, base=tmp_path)
    found: dict[str, list[str]] = {}
    for p in err.value.problems:
        found.setdefault(p.path, []).append(p.message)
    return found


def test_check_refuses_uni_with_parallelism_and_too_few_gpus(tmp_path: Path) -> None:
    found = problems(tmp_path, {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, [0])
    assert found["stages.llm.args.distributed_executor_backend"] == [
        '"uni" runs the model in one process, but tensor/pipeline parallelism asks for 2: set "mp" (or leave '
        'it out: omnid picks "mp" then)']
    assert found["stages.llm.devices"] == ["tensor/pipeline parallelism of 2 needs 2 GPUs, but the stage has 1 ([0])"]
    C.parse({"stages": {"llm": {"engine": "vllm", "model": "llm", "devices": [0, 1],
                                "args": {"tensor_parallel_size": 2}}},
             "pipelines": {"p": {"stages": ["llm"]}}}, base=tmp_path)            # fine: omnid picks mp


def test_the_tap_and_prompt_embeds_only_when_asked() -> None:
    plain = engine_args(stage({}))
    assert "worker_extension_cls" not in plain and "enable_prompt_embeds" not in plain
    assert "enable_prefix_caching" not in plain
    ids_only = C.StageConfig(name="llm", engine="vllm", model=Path("/m"), tensor_outputs=frozenset({"token_ids"}))
    assert "worker_extension_cls" not in engine_args(ids_only)         # token ids need no tap
    tapped = C.StageConfig(name="llm", engine="vllm", model=Path("/m"), tensor_outputs=frozenset({"hidden_states"}))
    assert engine_args(tapped)["worker_extension_cls"] == "omnid.engines.vllm_tap.HiddenStateTap"
    assert "enable_prefix_caching" not in engine_args(tapped)
    with_prompt = C.StageConfig(name="llm", engine="vllm", model=Path("/m"), hidden_prompt=True,
                                tensor_outputs=frozenset({"hidden_states"}))
    assert engine_args(with_prompt)["enable_prefix_caching"] is False    # a cached prefix has no rows
    on_gpu = C.StageConfig(name="llm", engine="vllm", model=Path("/m"), devices=(0,),
                           tensor_outputs=frozenset({"hidden_states"}))
    assert engine_args(on_gpu)["enforce_eager"] is True                  # hooks: no compiled graph, no CUDA graph
    assert "enforce_eager" not in engine_args(C.StageConfig(name="llm", engine="vllm", model=Path("/m"), devices=(0,)))
    assert engine_args(C.StageConfig(name="llm", engine="vllm", model=Path("/m"), devices=(0,),
                                     args={"enforce_eager": False},
                                     tensor_outputs=frozenset({"hidden_states"})))["enforce_eager"] is False
    fed = C.StageConfig(name="llm", engine="vllm", model=Path("/m"), takes_embeds=True)
    assert engine_args(fed)["enable_prompt_embeds"] is True


def test_a_compiled_load_without_room_for_its_caches_runs_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tmpfs(tmp_path / "small", 4) as small:
        roomy = tmp_path / "roomy"
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(roomy / "inductor"))     # (not there yet)
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(roomy / "vllm"))
        assert compile_cache_dirs() == [str(roomy / "vllm"), str(roomy / "inductor")]
        if free_bytes(str(roomy)) < COMPILE_ROOM:
            pytest.skip("this disk has under COMPILE_ROOM free")
        args: dict[str, Any] = {}
        assert eager_if_no_room(args, {}) is None and "enforce_eager" not in args

        monkeypatch.setenv("VLLM_CACHE_ROOT", str(small / "vllm"))
        assert 0 < free_bytes(str(small / "vllm")) <= 4 << 20                   # its nearest existing parent
        why = eager_if_no_room(args, {})
        assert args["enforce_eager"] is True
        assert why is not None and str(small / "vllm") in why and str(roomy) not in why

        args = {"enforce_eager": False}                                           # the stage chose: it stands
        assert eager_if_no_room(args, {"enforce_eager": False}) is None and args["enforce_eager"] is False


def test_a_cpu_stage_leaves_one_cpu_to_the_worker_and_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnid.engines.vllm_engine import cpu_threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpu = stage({})
    assert cpu_threads(cpu, engine_args(cpu), {}) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5})
    assert cpu_threads(cpu, engine_args(cpu), {}) == 1                          # never none
    assert cpu_threads(cpu, engine_args(cpu), {"OMP_NUM_THREADS": "2"}) is None  # the stage's env says
    gpu = stage({}, devices=(0,))
    assert cpu_threads(gpu, engine_args(gpu), {}) is None
    tp = stage({"tensor_parallel_size": 2})
    assert cpu_threads(tp, engine_args(tp), {}) is None                          # vLLM's mp executor sets its own
