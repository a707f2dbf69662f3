"""The API describing itself, without a daemon: each parameter rule's JSON Schema agrees with the
rule's own check (the same values pass and fail both), `describe_pipeline` for vllm, diffusers and
python stages, the OpenAPI document of an app with a route it has no schema for, and the CLI's
pure helpers (Prometheus parsing, aligned health lines, rule formatting, the step bar).

Pure functions in the test process; nothing blocks. About a second.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp import web

from omnictl.client import parse_prometheus
from omnictl.render import pipeline_detail, ready_text
from omnid.config import Config, DaemonConfig, EdgeConfig, PipelineConfig, StageConfig
from omnid.engines.capabilities import CAPABILITIES, describe_stage_params, stage_params_schema
from omnid.params import ANY_PARAMS, PLAIN_VALUE_SCHEMA
from omnid.supervisor.http.openapi import OPERATIONS, describe_pipeline, openapi_document, routes

SAMPLES: list[Any] = [-3, -2, -1, 0, 1, 2, 7, 8, 16, 17, 1000, 1001, 4096, 4104, 2**63 - 1, 2**63,
                      0.5, 0.01, 1.5, 2.5, -2.5, True, False, "x", "", ["a", "b"], [], [1], None, {"a": 1}]


@pytest.mark.parametrize("engine,key", [(e, k) for e, rules in ((n, c.rules) for n, c in CAPABILITIES.items()) for k in rules])
def test_each_rule_describes_exactly_what_it_checks(engine: str, key: str) -> None:
    rule = CAPABILITIES[engine].rules[key]
    validator = jsonschema.Draft202012Validator(rule.schema)
    for value in SAMPLES:
        assert (rule(value) is None) == validator.is_valid(value), (engine, key, value, rule.schema, rule(value))


def test_rule_schemas_carry_their_limits() -> None:
    assert CAPABILITIES["diffusers"].rules["num_inference_steps"].schema == {"type": "integer", "minimum": 1, "maximum": 1000}
    assert CAPABILITIES["diffusers"].rules["width"].schema == {"type": "integer", "minimum": 8, "maximum": 4096,
                                                        "multipleOf": 8}
    assert CAPABILITIES["vllm"].rules["top_p"].schema == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert CAPABILITIES["vllm"].rules["ignore_eos"].schema == {"type": "boolean"}
    assert CAPABILITIES["vllm"].rules["prompt_template"].schema == {"type": "string"}


def test_stage_params_with_defaults() -> None:
    described = describe_stage_params("diffusers", {"num_inference_steps": 4, "scheduler_hint": "x"})
    assert described["accepts"] == "listed"
    assert described["params"]["num_inference_steps"] == {"type": "integer", "minimum": 1, "maximum": 1000,
                                                          "default": 4}
    assert described["params"]["scheduler_hint"] == {**PLAIN_VALUE_SCHEMA, "default": "x"}
    assert "default" not in described["params"]["seed"]
    python = describe_stage_params("python", {"tag": "a"})
    assert python == {"accepts": ANY_PARAMS, "params": {"tag": {"default": "a"}}}
    # The request schema refuses what the door refuses.
    v = jsonschema.Draft202012Validator(stage_params_schema("diffusers", {}))
    assert v.is_valid({"num_inference_steps": 30}) and not v.is_valid({"num_inference_steps": 0})
    assert not v.is_valid({"nope": 1})
    assert jsonschema.Draft202012Validator(stage_params_schema("python", {})).is_valid({"anything": [1, 2]})


def _config() -> Config:
    d = Path("/nonexistent")
    stages = {
        "expand": StageConfig("expand", "vllm", model=d, defaults={"max_tokens": 16}),
        "draw": StageConfig("draw", "diffusers", model=d, defaults={"num_inference_steps": 4}),
        "frame": StageConfig("frame", "python", function="m:f", defaults={"scale": 2}),
    }
    pipelines = {
        "t2i": PipelineConfig("t2i", ("expand", "draw"), (EdgeConfig("expand", "draw"),)),
        "framed": PipelineConfig("framed", ("frame",), ()),
    }
    return Config(None, DaemonConfig(socket=d, state_dir=d, lock_dir=d), stages, pipelines)


def test_describe_pipeline() -> None:
    config = _config()
    doc = describe_pipeline(config, config.pipelines["t2i"])
    assert {k: doc[k] for k in ("name", "stages", "edges", "sources", "sinks")} == {
        k: v for k, v in config.pipelines["t2i"].as_api().items() if k in ("name", "stages", "edges", "sources", "sinks")}
    assert doc["edges"][0]["window"] == -1
    assert doc["inputs"] == {"expand": {"known": True, "engine": "vllm", "inputs": {"prompt": {
        "type": "string", "required": True, "description": "the text prompt of vllm stage 'expand'"}}}}
    assert doc["params"]["expand"]["params"]["max_tokens"] == {"type": "integer", "minimum": 1, "default": 16}
    assert doc["params"]["draw"]["params"]["height"]["multipleOf"] == 8
    assert [o["name"] for o in doc["outputs"]["draw"]["outputs"]] == ["image", "prompt"]
    framed = describe_pipeline(config, config.pipelines["framed"])
    assert framed["inputs"]["frame"]["known"] is False and "unknown" in framed["inputs"]["frame"]["note"]
    assert framed["params"]["frame"] == {"engine": "python", "accepts": ANY_PARAMS, "params": {"scale": {"default": 2}}}
    assert framed["outputs"]["frame"]["known"] is False
    text = pipeline_detail(doc)
    assert "prompt  string, required  (stage expand, vllm)" in text
    assert re.search(r"height\s+integer 8\.\.4096, multiple of 8\s+-", text), text
    assert re.search(r"num_inference_steps\s+integer 1\.\.1000\s+4", text), text
    assert "PARAMS frame (python): any (the function reads what it wants)" in pipeline_detail(framed)


def test_openapi_lists_every_route_and_falls_back_for_unknown_ones() -> None:
    async def extra(request: web.Request) -> web.Response:
        """Something another module added.

        With a longer description."""
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get("/v1/jobs/{id}", extra), web.post("/v1/extra/{thing}", extra), web.get("/v1/health", extra)])
    doc = openapi_document(app, _config(), "9.9")
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == "9.9"
    assert routes(app) == [("GET", "/v1/jobs/{id}"), ("POST", "/v1/extra/{thing}"), ("GET", "/v1/health")]
    known = OPERATIONS[("GET", "/v1/jobs/{id}")]
    assert doc["paths"]["/v1/jobs/{id}"]["get"] == {**known, "responses": {
        **known["responses"], "503": {"$ref": "#/components/responses/TooManyConnections"}}}
    assert "507" not in doc["paths"]["/v1/extra/{thing}"]["post"]["responses"]     # (only submits and DELETE)
    assert set(doc["components"]["responses"]) == {"Error", "OpenAIError", "InsufficientStorage", "TooManyConnections"}
    fallback = doc["paths"]["/v1/extra/{thing}"]["post"]
    assert fallback["summary"] == "Something another module added."
    assert fallback["parameters"][0]["name"] == "thing"
    jsonschema.Draft202012Validator.check_schema({**doc["components"]["schemas"]["JobRequest"]})
    # One request alternative per pipeline, with its stages' params.
    request = {"$ref": "#/components/schemas/JobRequest", "components": doc["components"]}
    v = jsonschema.Draft202012Validator(request)
    assert v.is_valid({"pipeline": "t2i", "inputs": {"prompt": "a fox"}, "params": {"draw": {"seed": 3}}})
    assert not v.is_valid({"pipeline": "t2i", "inputs": {}})
    assert not v.is_valid({"pipeline": "t2i", "inputs": {"prompt": "a"}, "params": {"draw": {"width": 9}}})
    assert v.is_valid({"pipeline": "framed", "params": {"frame": {"anything": "x"}}})


def test_parse_prometheus() -> None:
    text = ('# HELP omnid_jobs_total Jobs.\n# TYPE omnid_jobs_total counter\n'
            'omnid_jobs_total{pipeline="t2i",state="succeeded"} 3.0\n'
            'omnid_up 1\nh_bucket{le="+Inf"} 2.0\nq{a="say \\"hi\\"\\n"} NaN\n')
    assert parse_prometheus(text) == {
        "omnid_jobs_total": [{"labels": {"pipeline": "t2i", "state": "succeeded"}, "value": 3.0}],
        "omnid_up": [{"labels": {}, "value": 1.0}],
        "h_bucket": [{"labels": {"le": "+Inf"}, "value": 2.0}],
        "q": [{"labels": {"a": 'say "hi"\n'}, "value": "NaN"}],
    }


def test_health_lines_are_aligned() -> None:
    text = ready_text(False, {"not_ready": ["draw"], "stages": {"a": "ready", "expand": "ready", "draw": "loading"}})
    assert text.splitlines() == ["not ready: draw", "  a       ready", "  expand  ready", "  draw    loading"]


def test_step_bar_has_rate_and_time_left() -> None:
    from omnictl.progress import StepBar
    bar = StepBar("draw", 100)
    bar.line(1, 10)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", bar.line(5, 10))
    assert re.fullmatch(r"draw: [━╸╺ ]+ +5/10 [\d.?]+ steps/s \S+", plain.strip()), plain
    assert "\n" not in plain and len(plain) <= 100
