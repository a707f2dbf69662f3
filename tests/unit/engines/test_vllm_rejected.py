"""Which of vLLM's errors are the request's fault (`input_rejected`, a 400 on the OpenAI paths) and
which the stage's: vLLM's own exception classes, the installed vLLM's."""

from __future__ import annotations

import pytest

from omnid.engines.vllm_engine import _rejected

pytestmark = pytest.mark.vllm

exceptions = pytest.importorskip("vllm.exceptions")


def test_vllms_validation_errors_are_the_requests_fault() -> None:
    # vLLM 0.3x raises VLLMValidationError, which is no ValueError, for a prompt over max_model_len
    too_long = exceptions.VLLMValidationError("The decoder prompt (length 513) is longer than the maximum "
                                              "model length of 512.")
    assert not isinstance(too_long, ValueError)
    assert _rejected(too_long) == "input_rejected"
    assert _rejected(ValueError("top_p must be in (0, 1]")) == "input_rejected"
    assert _rejected(TypeError("unexpected keyword")) == "input_rejected"


def test_a_dead_engine_or_anything_else_is_the_stages() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError
    assert _rejected(EngineDeadError()) is None
    assert _rejected(RuntimeError("boom")) is None
    server = getattr(exceptions, "VLLMServerError", None)
    if server is not None:
        assert _rejected(server("the server's fault")) is None
