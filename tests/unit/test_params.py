"""`omnid.params` (the tables: names and value rules) and the per-engine lookups over them (`omnid.engines.capabilities`)."""

from __future__ import annotations

from typing import Any

import pytest

from omnid import params as M
from omnid.engines.capabilities import check_param, job_param_problem, stage_accepts
from omnid.params import merged, plain_value

NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------- check_param

VALID = [
    ("vllm", "max_tokens", 1), ("vllm", "max_tokens", 4096), ("vllm", "min_tokens", 0),
    ("vllm", "temperature", 0), ("vllm", "temperature", 0.7), ("vllm", "temperature", 2),
    ("vllm", "top_p", 1), ("vllm", "top_p", 0.01), ("vllm", "top_k", -1), ("vllm", "top_k", 50),
    ("vllm", "min_p", 0), ("vllm", "min_p", 1.0), ("vllm", "seed", 0), ("vllm", "seed", 2**63 - 1),
    ("vllm", "stop", "\n"), ("vllm", "stop", ["a", "b"]), ("vllm", "stop", []),
    ("vllm", "ignore_eos", True), ("vllm", "ignore_eos", False), ("vllm", "include_prompt", False),
    ("vllm", "repetition_penalty", 1.1), ("vllm", "presence_penalty", -2), ("vllm", "frequency_penalty", 2.0),
    ("vllm", "prompt_template", "Q: {prompt}\nA:"),
    ("diffusers", "num_inference_steps", 1), ("diffusers", "num_inference_steps", 1000),
    ("diffusers", "height", 8), ("diffusers", "width", 512), ("diffusers", "width", 4096),
    ("diffusers", "guidance_scale", 7.5), ("diffusers", "guidance_scale", 0), ("diffusers", "eta", 0.5),
    ("diffusers", "seed", 42), ("diffusers", "negative_prompt", "blurry"),
    ("diffusers", "num_images_per_prompt", 16), ("diffusers", "guidance_rescale", 0.7),
]


def short_id(value: Any) -> str:
    """A parameter's id: its repr, cut; without backslashes, which pytest escapes once more each time
    it collects again in one process (mutmut's runs), so that the id would no longer be found."""
    return repr(value)[:20].replace("\\", "")


@pytest.mark.parametrize(("engine", "key", "value"), VALID, ids=short_id)
def test_valid_values_pass(engine: str, key: str, value: Any) -> None:
    assert check_param(engine, key, value) is None


INVALID = [
    # integers: never a bool, never a float (even a whole one), never a string
    ("vllm", "max_tokens", True, "must be an integer"),
    ("vllm", "max_tokens", False, "must be an integer"),
    ("vllm", "max_tokens", 8.0, "must be an integer"),
    ("vllm", "max_tokens", "8", "must be an integer"),
    ("diffusers", "seed", True, "must be an integer"),
    # integer ranges
    ("vllm", "max_tokens", 0, "must be >= 1"),
    ("vllm", "min_tokens", -1, "must be >= 0"),
    ("vllm", "top_k", -2, "must be >= -1"),
    ("vllm", "seed", -1, f"must be from 0 to {2**63 - 1}"),
    ("vllm", "seed", 2**63, f"must be from 0 to {2**63 - 1}"),
    ("diffusers", "num_inference_steps", 0, "must be from 1 to 1000"),
    ("diffusers", "num_inference_steps", 1001, "must be from 1 to 1000"),
    ("diffusers", "num_images_per_prompt", 17, "must be from 1 to 16"),
    ("diffusers", "height", 0, "must be from 8 to 4096"),
    ("diffusers", "width", 4104, "must be from 8 to 4096"),
    # multiples of 8
    ("diffusers", "width", 100, "must be a multiple of 8"),
    ("diffusers", "height", 513, "must be a multiple of 8"),
    # finite numbers: no bool, no NaN, no infinity, no string
    ("vllm", "temperature", True, "must be a finite number"),
    ("vllm", "temperature", NAN, "must be a finite number"),
    ("vllm", "temperature", INF, "must be a finite number"),
    ("vllm", "temperature", -INF, "must be a finite number"),
    ("vllm", "temperature", "0.5", "must be a finite number"),
    ("diffusers", "guidance_scale", NAN, "must be a finite number"),
    # number ranges, open and closed
    ("vllm", "temperature", -0.1, "must be >= 0"),
    ("vllm", "top_p", 0, "must be > 0"),
    ("vllm", "top_p", 0.0, "must be > 0"),
    ("vllm", "top_p", 1.01, "must be <= 1"),
    ("vllm", "min_p", -0.5, "must be >= 0"),
    ("vllm", "repetition_penalty", 0, "must be > 0"),
    ("vllm", "presence_penalty", -2.5, "must be >= -2"),
    ("vllm", "frequency_penalty", 2.01, "must be <= 2"),
    ("diffusers", "eta", 1.5, "must be <= 1"),
    # stop: a string or a list of strings
    ("vllm", "stop", 3, "must be a string or a list of strings"),
    ("vllm", "stop", ["a", 1], "must be a string or a list of strings"),
    ("vllm", "stop", [["a"]], "must be a string or a list of strings"),
    ("vllm", "stop", ("a",), "must be a string or a list of strings"),
    ("vllm", "stop", None, "must be a string or a list of strings"),
    # booleans and strings
    ("vllm", "ignore_eos", 1, "must be true or false"),
    ("vllm", "include_prompt", "yes", "must be true or false"),
    ("vllm", "prompt_template", 3, "must be a string"),
    ("diffusers", "negative_prompt", ["x"], "must be a string"),
]


@pytest.mark.parametrize(("engine", "key", "value", "why"), INVALID, ids=short_id)
def test_invalid_values_say_why(engine: str, key: str, value: Any, why: str) -> None:
    assert check_param(engine, key, value) == why


def test_unknown_parameters_and_python_stages_have_no_rules() -> None:
    assert check_param("vllm", "no_such_param", object()) is None
    assert check_param("python", "max_tokens", True) is None       # the user's function decides
    assert check_param("python", "seconds", "soon") is None
    assert check_param("onnx", "max_tokens", -1) is None


def test_every_known_parameter_has_a_rule() -> None:
    assert set(M.VLLM_RULES) == M.VLLM_PARAMS
    assert set(M.DIFFUSERS_RULES) == M.DIFFUSERS_PARAMS
    assert set(M.VLLM_OMNID_PARAMS) <= M.VLLM_PARAMS
    from omnid.engines.capabilities import CAPABILITIES
    assert {n: c.params for n, c in CAPABILITIES.items()} == {"vllm": M.VLLM_PARAMS, "diffusers": M.DIFFUSERS_PARAMS,
                                                              "python": None}
    assert CAPABILITIES["vllm"].rules is M.VLLM_RULES and CAPABILITIES["diffusers"].rules is M.DIFFUSERS_RULES


# ------------------------------------------------------------------------- stage_accepts


def test_stage_accepts() -> None:
    assert stage_accepts("python", {"seconds": 1}) is None          # any name
    assert stage_accepts("diffusers", {}) == M.DIFFUSERS_PARAMS
    assert stage_accepts("vllm", {"max_tokens": 3}) == M.VLLM_PARAMS
    assert stage_accepts("vllm", {"extra": 1}) == M.VLLM_PARAMS | {"extra"}
    assert "num_inference_steps" not in stage_accepts("vllm", {})
    assert "max_tokens" not in stage_accepts("diffusers", {})
    with pytest.raises(KeyError):
        stage_accepts("onnx", {})


# ------------------------------------------------------------------------- plain_value


@pytest.mark.parametrize("value", ["", "x", True, False, 0, -3, 2**70, 0.5, -1e300, None, [], ["a", 1, 2.5, True]],
                         ids=repr)
def test_plain_values(value: Any) -> None:
    assert plain_value(value) is True


@pytest.mark.parametrize("value", [NAN, INF, -INF, [NAN], ["a", None], [["a"]], [[]], {"a": 1}, [{"a": 1}],
                                   ("a",), b"x", {"a"}, object()],
                         ids=lambda v: "object()" if type(v) is object else repr(v))
def test_values_that_are_not_plain(value: Any) -> None:
    assert plain_value(value) is False


# ------------------------------------------------------------------------- job_param_problem


def test_job_param_problem_unknown_name_lists_the_known_ones() -> None:
    why = job_param_problem("draw", "diffusers", {}, "steps", 4)
    assert why == f"stage 'draw' has no parameter 'steps'; known: {', '.join(sorted(M.DIFFUSERS_PARAMS))}"
    # A name is checked before its value.
    assert job_param_problem("draw", "diffusers", {}, "steps", {"x": 1}).startswith("stage 'draw' has no parameter")


def test_job_param_problem_a_stages_own_defaults_are_settable() -> None:
    assert job_param_problem("gen", "vllm", {"custom": 1}, "custom", 2) is None
    assert "known: adapter, custom, frequency_penalty" in job_param_problem("gen", "vllm", {"custom": 1}, "nope", 2)


def test_job_param_problem_value_not_plain() -> None:
    assert job_param_problem("post", "python", {}, "cfg", {"a": 1}) == \
        "params.post.cfg must be a string, number, boolean, or a list of those"
    assert job_param_problem("gen", "vllm", {}, "temperature", NAN) == \
        "params.gen.temperature must be a string, number, boolean, or a list of those"


def test_job_param_problem_value_breaks_a_rule() -> None:
    assert job_param_problem("draw", "diffusers", {}, "width", 100) == \
        "params.draw.width must be a multiple of 8, not 100"
    assert job_param_problem("gen", "vllm", {}, "max_tokens", True) == \
        "params.gen.max_tokens must be an integer, not True"
    assert job_param_problem("gen", "vllm", {}, "stop", ["a", 1]) == \
        "params.gen.stop must be a string or a list of strings, not ['a', 1]"


def test_job_param_problem_accepts_good_values() -> None:
    assert job_param_problem("draw", "diffusers", {}, "width", 512) is None
    assert job_param_problem("gen", "vllm", {}, "stop", ["\n"]) is None
    assert job_param_problem("post", "python", {}, "anything", [1, "two"]) is None


# ------------------------------------------------------------------------- merged


def test_merged_overrides_defaults_without_changing_them() -> None:
    defaults = {"max_tokens": 8, "temperature": 0.0}
    params = {"temperature": 0.7, "seed": 1}
    out = merged(defaults, params)
    assert out == {"max_tokens": 8, "temperature": 0.7, "seed": 1}
    assert defaults == {"max_tokens": 8, "temperature": 0.0} and params == {"temperature": 0.7, "seed": 1}
    assert out is not defaults and merged(defaults, {}) == defaults and merged(defaults, {}) is not defaults
    assert merged({}, {"a": None}) == {"a": None}


# ------------------------------------------------------------------------- the rule builders
# The tables above are built when the module is imported; these build rules afresh, so that what a
# builder makes (its check and its schema) is tried too.


def test_integer_rule_checks_and_describes_its_bounds() -> None:
    r = M._integer(8, 64, multiple=8)
    assert r.schema == {"type": "integer", "minimum": 8, "maximum": 64, "multipleOf": 8}
    assert repr(r) == "Rule({'type': 'integer', 'minimum': 8, 'maximum': 64, 'multipleOf': 8})"
    assert [r(v) for v in (8, 64, 16)] == [None, None, None]
    assert r(0) == r(72) == "must be from 8 to 64"
    assert r(12) == "must be a multiple of 8"
    assert r(True) == r(16.0) == r("16") == "must be an integer"
    lo_only = M._integer(-1)
    assert lo_only.schema == {"type": "integer", "minimum": -1}
    assert lo_only(-1) is None and lo_only(7) is None and lo_only(-2) == "must be >= -1"
    hi_only = M._integer(hi=3)
    assert hi_only.schema == {"type": "integer", "maximum": 3}
    assert hi_only(-100) is None and hi_only(3) is None and hi_only(4) is not None
    free = M._integer()
    assert free.schema == {"type": "integer"} and free(-(2**70)) is None and free(5) is None


def test_number_rule_checks_and_describes_its_bounds() -> None:
    closed = M._number(0, 2)
    assert closed.schema == {"type": "number", "minimum": 0, "maximum": 2}
    assert [closed(v) for v in (0, 0.0, 1.5, 2)] == [None] * 4
    assert closed(-0.001) == "must be >= 0" and closed(2.001) == "must be <= 2"
    for bad in (True, NAN, INF, -INF, "1", None):
        assert closed(bad) == "must be a finite number"
    opened = M._number(0, lo_open=True)
    assert opened.schema == {"type": "number", "exclusiveMinimum": 0}
    assert opened(0) == opened(-1) == "must be > 0" and opened(1e-9) is None and opened(1e300) is None
    hi_only = M._number(hi=1)
    assert hi_only.schema == {"type": "number", "maximum": 1} and hi_only(-5) is None and hi_only(1.5) == "must be <= 1"
    assert M._number().schema == {"type": "number"} and M._number()(-1e300) is None


def test_type_rules() -> None:
    flag, text, count = M._of_type(bool, "true or false"), M._of_type(str, "a string"), M._of_type(int, "an integer")
    assert flag.schema == {"type": "boolean"} and text.schema == {"type": "string"} and count.schema == {"type": "integer"}
    assert M._of_type(float, "a number").schema == {"type": "number"}
    assert flag(False) is None and flag(0) == "must be true or false"
    assert text("") is None and text(b"x") == "must be a string"
    assert count(3) is None and count(True) == "must be an integer" and count(3.0) == "must be an integer"


def test_stop_rule() -> None:
    assert M._check_stop("") == M._check_stop(["a", ""]) == "must not be or hold an empty string"
    assert M._check_stop("XXXX") is None and M._check_stop(["XXXX"]) is None and M._check_stop([]) is None


def test_adapters_rule() -> None:
    assert M._check_adapters({"a": -10, "b": 10, "c": 0.5}) is None
    assert M._check_adapters(["a"]) == "must be an object of adapter names and weights: {\"style\": 0.8}"
    for weight in (-10.5, -11, 10.5, 11, NAN, INF, True, "1", None):
        assert M._check_adapters({"a": 1, "s": weight}) == \
            f"must give each adapter a weight from -10 to 10 ('s': {weight!r})"


def test_token_bounds_problem() -> None:
    assert M.token_bounds_problem("gen", {"min_tokens": 9, "max_tokens": 8}) == \
        "params.gen.min_tokens (9) must not be more than max_tokens (8)"
    assert M.token_bounds_problem("gen", {"min_tokens": 8, "max_tokens": 8}) is None
    assert M.token_bounds_problem("gen", {"min_tokens": 9}) is None
    assert M.token_bounds_problem("gen", {"max_tokens": 0}) is None
    assert M.token_bounds_problem("gen", {"min_tokens": 9, "max_tokens": "8"}) is None


def test_parallel_size_is_tensor_times_pipeline() -> None:
    assert M.parallel_size({}) == 1
    assert M.parallel_size({"tensor_parallel_size": 2}) == 2
    assert M.parallel_size({"pipeline_parallel_size": 3}) == 3
    assert M.parallel_size({"tensor_parallel_size": 2, "pipeline_parallel_size": 3}) == 6
    # A value that is not a positive integer counts as 1 (the checker reports it).
    for bad in (0, -2, True, 2.0, "2", None):
        assert M.parallel_size({"tensor_parallel_size": bad, "pipeline_parallel_size": 3}) == 3
