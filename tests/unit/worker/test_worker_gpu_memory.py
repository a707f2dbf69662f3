"""A worker's GPU memory figure (`omnid.worker.main._nvml_memory`): what NVML lists for the
worker's own process tree, on every GPU, and nothing where NVML is missing or lists none of it.

NVML itself stands in here (a `pynvml` module of our own in sys.modules); the real one is
checked against nvidia-smi by `make gpu-check` ("GPU memory per stage").
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

from omnid.worker import main as worker_main

MIB = 1 << 20


def fake_nvml(per_gpu: list[list[tuple[int, int | None]]], fail: bool = False) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    def init() -> None:
        if fail:
            raise RuntimeError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: len(per_gpu)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetComputeRunningProcesses = (
        lambda h: [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in per_gpu[h]])
    return m


@pytest.fixture
def child() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "_nvml_state", [])


def test_the_worker_and_its_children_on_every_gpu_are_summed(monkeypatch: pytest.MonkeyPatch, child: int) -> None:
    me = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([
        [(me, 600 * MIB), (1, 9000 * MIB)],          # GPU 0: us, and another program
        [(child, 300 * MIB), (me, None)],            # GPU 1: our child (vLLM's mp workers), us without a figure
    ]))
    assert worker_main._nvml_memory() == 900 * MIB


def test_none_where_nvml_lists_none_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([[(1, 9000 * MIB)]]))   # a pid namespace: host pids
    assert worker_main._nvml_memory() is None


def test_nvml_that_fails_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([[(os.getpid(), MIB)]], fail=True))
    assert worker_main._nvml_memory() is None
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([[(os.getpid(), MIB)]]))
    assert worker_main._nvml_memory() is None                 # torch's figure from now on


def test_without_cuda_a_worker_reports_no_gpu_memory() -> None:
    assert worker_main._gpu_memory() is None
