"""What admission says of a job's inputs, in process (`omnid.supervisor.http.admission`): a prompt
of the wrong type is named as such, and a job without its prompt is told what it gave instead,
a near miss named."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnid.config import Config, parse
from omnid.supervisor.errors import Refused
from omnid.supervisor.http.admission import job_submission


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    return parse({"daemon": {"state_dir": str(model)},
                  "stages": {"gen": {"engine": "vllm", "model": str(model), "devices": []}},
                  "pipelines": {"chat": {"stages": ["gen"]}}}, base=Path("/"))


def refused(config: Config, inputs: object) -> Refused:
    with pytest.raises(Refused) as e:
        job_submission(config, {"pipeline": "chat", "inputs": inputs}, 1000)
    return e.value


@pytest.mark.parametrize("value, kind", [(42, "a number"), (True, "a boolean"), (["a", "b"], "a list")])
def test_a_prompt_that_is_no_text_is_invalid_not_missing(config: Config, value: object, kind: str) -> None:
    e = refused(config, {"prompt": value})
    assert (e.status, e.code) == (400, "invalid_input"), e
    assert f"input \"prompt\" of vllm stage 'gen' must be text, not {kind}" in e.message, e.message


def test_a_missing_prompt_says_what_the_job_gave_and_a_near_miss(config: Config) -> None:
    e = refused(config, {"promt": "fox"})
    assert (e.status, e.code) == (400, "missing_input")
    assert e.message.endswith("needs a text input \"prompt\"; the job's inputs are 'promt' "
                              "(did you mean \"prompt\" for 'promt'?)"), e.message
    e = refused(config, {"colour": "red"})
    assert e.message.endswith("the job's inputs are 'colour'"), e.message
    assert refused(config, {}).message.endswith("; the job has no inputs")


def test_a_priority_is_an_integer_and_an_integral_number_is_one() -> None:
    """JSON Schema's "integer" takes -3.0 (schemathesis sends it): so does the door; 0.5, "1" and
    true are refused with a 400 naming the field."""
    from omnid.supervisor.errors import Refused
    from omnid.supervisor.http.admission import priority

    assert priority(None) == 0 and priority(-3) == -3 and priority(-3623.0) == -3623
    assert isinstance(priority(2.0), int)
    for bad in (0.5, "1", True, 10 ** 9):
        with pytest.raises(Refused) as e:
            priority(bad)
        assert e.value.status == 400 and "priority" in str(e.value)
