"""The engines' declarations (omnid/engines/capabilities.py): one per engine, each engine class
pointing to its own, and the supervisor asking them without importing any engine."""

from __future__ import annotations

import subprocess
import sys

from omnid.config import ENGINES, STREAM_ENGINES
from omnid.engines.capabilities import CAPABILITIES, capabilities
from omnid.params import DIFFUSERS_PARAMS, VLLM_PARAMS


def test_every_engine_is_declared_once_and_its_class_points_to_it() -> None:
    import importlib

    assert ENGINES == tuple(CAPABILITIES)
    for name, caps in CAPABILITIES.items():
        assert caps.name == name
        module, _, cls = caps.engine_class.partition(":")
        engine = getattr(importlib.import_module(module), cls)
        assert engine.capabilities is caps
        assert caps.params == {"vllm": VLLM_PARAMS, "diffusers": DIFFUSERS_PARAMS}.get(name)


def test_declarations_say_what_the_checks_said_by_name() -> None:
    assert STREAM_ENGINES == ("python",)
    assert capabilities("vllm").media and not capabilities("diffusers").media
    assert capabilities("vllm").answer == "text" and capabilities("diffusers").answer == "image"
    assert capabilities("python").answer is None and capabilities("python").outputs is None
    assert [e for e, c in CAPABILITIES.items() if c.text_prompt] == ["vllm", "diffusers"]
    assert capabilities("diffusers").max_batch == 64


def test_the_supervisor_imports_no_engine() -> None:
    code = ("import sys, omnid.supervisor.daemon, omnid.supervisor.http.admission, omnid.config; "
            "print(sorted(m for m in sys.modules if m.startswith('omnid.engines.') "
            "and m != 'omnid.engines.base' and m != 'omnid.engines.capabilities'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
