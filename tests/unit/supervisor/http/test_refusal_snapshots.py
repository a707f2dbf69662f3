"""What 40 bad requests are answered, word for word: the socket API's job submission and the OpenAI
paths (chat, completions, images, speech), each a 4xx whose body names the field. The answers are
snapshotted in refusal_snapshots.json; a change to one must be deliberate (and read at least as well).

In-process: the daemon's own `Api` with the OpenAI paths mounted, served on a real Unix socket of the
test's event loop (so the caller's uid is read from it as the daemon does), on a config of a vLLM, a
diffusers and a python stage whose models are never loaded: every request here is refused before a
job is made (the scheduler stub fails the test if one is submitted). About a second.

`OMNID_UPDATE_SNAPSHOTS=1` rewrites the file from the answers of the code under test.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from omnid.config import Config, parse
from omnid.store import JobStore
from omnid.supervisor.http.api.app import Api, DaemonInfo
from omnid.supervisor.http.openai.routes import OpenAiApi
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics

SNAPSHOTS = Path(__file__).with_name("refusal_snapshots.json")
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/images/generations", "/v1/audio/speech")
B64_WAV_JUNK = "UklGRg=="       # "RIFF": base64, but no WAV file
CHAT = [{"role": "user", "content": "hi"}]
# A job wrong in nine places: its answer says each (`problems`), in the order of the body's fields
EVERY_PROBLEM = {"pipeline": "chat", "colour": "red", "inputs": {"prompt": 42, "extra": {"a": 1}, "n": [{"b": 2}]},
                 "params": {"gen": {"temperature": -1, "top_p": 5}, "draw": {}}, "timeout_s": 0, "priority": "high"}

# (name, path, field, body): each refused for one reason (but EVERY_PROBLEM); `field` is what its answer must name: on the
# OpenAI paths its `param` ("": the body itself, param null), on /v1/jobs a word of its message
CASES: list[tuple[str, str, str, Any]] = [
    # POST /v1/jobs
    ("job_not_an_object", "/v1/jobs", "request body", [1, 2]),
    ("job_unknown_field", "/v1/jobs", "input", {"pipeline": "chat", "input": {"prompt": "x"}}),
    ("job_no_pipeline", "/v1/jobs", "pipeline", {"inputs": {"prompt": "x"}}),
    ("job_pipeline_not_a_string", "/v1/jobs", "pipeline", {"pipeline": 3}),
    ("job_unknown_pipeline", "/v1/jobs", "chatt", {"pipeline": "chatt", "inputs": {"prompt": "x"}}),
    ("job_inputs_not_an_object", "/v1/jobs", "inputs", {"pipeline": "chat", "inputs": "x"}),
    ("job_prompt_not_text", "/v1/jobs", "prompt", {"pipeline": "chat", "inputs": {"prompt": 42}}),
    ("job_prompt_missing", "/v1/jobs", "prompt", {"pipeline": "chat", "inputs": {"promt": "x"}}),
    ("job_input_bad_value", "/v1/jobs", "extra", {"pipeline": "chat", "inputs": {"prompt": "x", "extra": {"a": 1}}}),
    ("job_params_unknown_stage", "/v1/jobs", "draw", {"pipeline": "chat", "inputs": {"prompt": "x"},
                                              "params": {"draw": {"width": 64}}}),
    ("job_param_out_of_range", "/v1/jobs", "params.gen.temperature", {"pipeline": "chat", "inputs": {"prompt": "x"},
                                            "params": {"gen": {"temperature": -1}}}),
    ("job_timeout_negative", "/v1/jobs", "timeout_s", {"pipeline": "chat", "inputs": {"prompt": "x"}, "timeout_s": -5}),
    ("job_priority_not_integer", "/v1/jobs", "priority", {"pipeline": "chat", "inputs": {"prompt": "x"}, "priority": 0.5}),
    ("job_every_problem_at_once", "/v1/jobs", "params.gen.top_p", EVERY_PROBLEM),
    ("job_prompt_not_base64", "/v1/jobs", "prompt", {"pipeline": "chat", "inputs": {"prompt": {"b64": "!!"}}}),
    # POST /v1/chat/completions
    ("chat_body_not_an_object", "/v1/chat/completions", "", "hello"),
    ("chat_no_model", "/v1/chat/completions", "model", {"messages": CHAT}),
    ("chat_unknown_model", "/v1/chat/completions", "model", {"model": "nope", "messages": CHAT}),
    ("chat_model_gives_no_text", "/v1/chat/completions", "model", {"model": "t2i", "messages": CHAT}),
    ("chat_no_messages", "/v1/chat/completions", "messages", {"model": "chat"}),
    ("chat_messages_empty", "/v1/chat/completions", "messages", {"model": "chat", "messages": []}),
    ("chat_message_not_an_object", "/v1/chat/completions", "messages[0]", {"model": "chat", "messages": ["hi"]}),
    ("chat_bad_role", "/v1/chat/completions", "messages[0].role", {"model": "chat", "messages": [{"role": "robot", "content": "x"}]}),
    ("chat_content_a_number", "/v1/chat/completions", "messages[0].content", {"model": "chat", "messages": [{"role": "user", "content": 5}]}),
    ("chat_bad_content_part", "/v1/chat/completions", "messages[0].content[0]",
     {"model": "chat", "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}),
    ("chat_image_url_not_data", "/v1/chat/completions", "messages[0].content[0]",
     {"model": "chat", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
    ("chat_audio_not_wav", "/v1/chat/completions", "messages[0].content[0]",
     {"model": "chat", "messages": [{"role": "user", "content": [
         {"type": "input_audio", "input_audio": {"data": B64_WAV_JUNK, "format": "mp3"}}]}]}),
    ("chat_n_two", "/v1/chat/completions", "n", {"model": "chat", "messages": CHAT, "n": 2}),
    ("chat_stream_not_bool", "/v1/chat/completions", "stream", {"model": "chat", "messages": CHAT, "stream": "yes"}),
    ("chat_stream_options_without_stream", "/v1/chat/completions", "stream_options",
     {"model": "chat", "messages": CHAT, "stream_options": {"include_usage": True}}),
    ("chat_temperature_a_string", "/v1/chat/completions", "temperature", {"model": "chat", "messages": CHAT, "temperature": "hot"}),
    ("chat_max_tokens_zero", "/v1/chat/completions", "max_tokens", {"model": "chat", "messages": CHAT, "max_tokens": 0}),
    ("chat_top_p_too_big", "/v1/chat/completions", "top_p", {"model": "chat", "messages": CHAT, "top_p": 1.5}),
    ("chat_tools", "/v1/chat/completions", "tools",
     {"model": "chat", "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat_response_format_json", "/v1/chat/completions", "response_format",
     {"model": "chat", "messages": CHAT, "response_format": {"type": "json_object"}}),
    ("chat_priority_too_big", "/v1/chat/completions", "priority", {"model": "chat", "messages": CHAT, "priority": 10 ** 9}),
    # POST /v1/completions
    ("completion_no_prompt", "/v1/completions", "prompt", {"model": "chat"}),
    ("completion_token_prompt", "/v1/completions", "prompt", {"model": "chat", "prompt": [1, 2, 3]}),
    ("completion_echo_not_bool", "/v1/completions", "echo", {"model": "chat", "prompt": "x", "echo": 1}),
    ("completion_best_of", "/v1/completions", "best_of", {"model": "chat", "prompt": "x", "best_of": 3}),
    # POST /v1/images/generations
    ("image_bad_size", "/v1/images/generations", "size", {"model": "t2i", "prompt": "a fox", "size": "big"}),
    ("image_url_format", "/v1/images/generations", "response_format", {"model": "t2i", "prompt": "a fox", "response_format": "url"}),
    # POST /v1/audio/speech
    ("speech_no_input", "/v1/audio/speech", "input", {"model": "speak"}),
    ("speech_mp3", "/v1/audio/speech", "response_format", {"model": "speak", "input": "hello", "response_format": "mp3"}),
]


def _config(tmp: Path) -> Config:
    (tmp / "llm").mkdir()
    (tmp / "llm" / "config.json").write_text("{}")
    (tmp / "sd").mkdir()
    (tmp / "sd" / "model_index.json").write_text("{}")
    (tmp / "stages.py").write_text("def speak(inputs, params, ctx):\n    pass\n")
    return parse({
        "daemon": {"socket": str(tmp / "omnid.sock"), "state_dir": str(tmp / "state"), "lock_dir": str(tmp / "locks")},
        "stages": {"gen": {"engine": "vllm", "model": str(tmp / "llm"), "devices": [], "defaults": {"max_tokens": 16}},
                   "draw": {"engine": "diffusers", "model": str(tmp / "sd"), "devices": []},
                   "speak": {"engine": "python", "function": "stages:speak", "python_path": [str(tmp)],
                             "produces": ["audio"]}},
        "pipelines": {"chat": {"stages": ["gen"]},
                      "t2i": {"stages": ["gen", "draw"], "edges": [{"from": "gen", "to": "draw",
                                                                    "map": {"prompt": "text"}}]},
                      "speak": {"stages": ["speak"]}},
    }, base=tmp)


class _NoJobs:
    """The scheduler, as far as a refused request reaches it: no job is ever made."""

    tracing = None
    live_jobs: dict[str, Any] = {}

    def submit(self, sub: Any) -> Any:
        raise AssertionError(f"a job was made of a bad request: {sub}")


async def _answers(tmp: Path) -> dict[str, dict[str, Any]]:
    config = _config(tmp)
    store = JobStore(tmp / "state")
    api = Api(Live(config), store, _NoJobs(), {}, Metrics({}), DaemonInfo(os.getpid(), 0.0, "test"))  # type: ignore[arg-type]
    OpenAiApi(api).mount(api.app)
    runner = web.AppRunner(api.app)
    await runner.setup()
    sock = tmp / "api.sock"
    await web.UnixSite(runner, str(sock)).start()
    found: dict[str, dict[str, Any]] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session:
            for name, path, _, body in CASES:
                async with session.post(f"http://omnid{path}", json=body) as resp:
                    found[name] = {"path": path, "status": resp.status, "body": await resp.json()}
    finally:
        await runner.cleanup()
        store.close()
    return found


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    found = asyncio.run(_answers(tmp_path_factory.mktemp("refusals")))
    if os.environ.get("OMNID_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n")
    return found


def test_at_least_forty_bad_requests() -> None:
    assert len(CASES) >= 40 and len({name for name, _, _, _ in CASES}) == len(CASES)
    assert {path for _, path, _, _ in CASES} == {"/v1/jobs", *OPENAI_PATHS}


def test_each_answer_is_as_snapshotted(answers: dict[str, dict[str, Any]]) -> None:
    expected = json.loads(SNAPSHOTS.read_text())
    assert set(answers) == set(expected)
    for name in expected:
        assert answers[name] == expected[name], name


@pytest.mark.parametrize("name, field", [(name, field) for name, _, field, _ in CASES])
def test_each_is_a_4xx_that_names_its_field(answers: dict[str, dict[str, Any]], name: str, field: str) -> None:
    answer = answers[name]
    assert 400 <= answer["status"] < 500, answer
    error = answer["body"]["error"]
    assert "[type=" not in error["message"] and "Input should be" not in error["message"], error
    if answer["path"] in OPENAI_PATHS:          # OpenAI's shape, the field in `param` and in the words
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error", error
        assert error["param"] == (field or None), error
        leaf = field.rpartition(".")[2].partition("[")[0] or "request body"
        assert leaf in error["message"], error
    else:                                       # the socket API's: a code, and the field in the words
        assert isinstance(error["code"], str) and field in error["message"], error


def test_a_job_hears_every_problem_at_once(answers: dict[str, dict[str, Any]]) -> None:
    """A job wrong in several places is told each, with its code and the input it names, the first
    one's code and input on the error itself; a job wrong in one place has no list."""
    error = answers["job_every_problem_at_once"]["body"]["error"]
    problems = error["problems"]
    words = ["unknown field(s) colour", "input 'extra' must be", "input 'n' must be", "input \"prompt\" of vllm stage",
             "params.gen.temperature", "params.gen.top_p", "no stage 'draw'", "\"timeout_s\"", "\"priority\""]
    assert len(problems) == len(words), problems
    for problem, word in zip(problems, words):
        assert word in problem["message"], (word, problem)
        assert problem["message"] in error["message"]
    assert [p["code"] for p in problems] == ["invalid_request", "invalid_input", "invalid_input", "invalid_input",
                                             "invalid_param", "invalid_param", "invalid_param", "invalid_request",
                                             "invalid_request"]
    assert [p.get("input") for p in problems][1:4] == ["extra", "n", "prompt"]
    assert error["code"] == "invalid_request" and "input" not in error
    several = {"job_every_problem_at_once", "job_unknown_field"}     # (that one's job also has no prompt)
    assert len(answers["job_unknown_field"]["body"]["error"]["problems"]) == 2
    assert all("problems" not in answers[name]["body"]["error"] for name, *_ in CASES if name not in several)
