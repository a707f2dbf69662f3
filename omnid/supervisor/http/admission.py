"""Admission: whether a submission may become a job, and why not. One door for every front end
(`POST /v1/jobs`, the OpenAI-compatible paths, and the TCP listener behind its keys).

Checking a submission: its pipeline resolved (the job's one look-up of it by name in the supervisor:
the `Submission` it becomes carries it to the scheduler), its inputs decoded and checked
for the pipeline's first stages (a text prompt where the engine needs one, media within the
stage's limits), its params checked by their engine's rules (`omnid.params`), its timeout; each
refusal a `Refused` that names what is wrong. What an engine needs and gives is read from its declaration
(`omnid.engines.capabilities`), never from its name. The pipeline facts the OpenAI paths ask
(which stage answers in text, which samples, which takes media) are here too.

First the body itself: JSON, within `daemon.max_request_bytes` (`json_body`, every front end's and the
TCP door's reader of a JSON body; its one await). The rest: pure functions of the config in force
(the caller passes it) and the request's JSON; no I/O but `answers`' one read of the job store (a
short sqlite read). Runs in the supervisor's event loop.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from omnid import media, prompt_length
from omnid.config import TENSOR_PROMPTS, Config, PipelineConfig, StageConfig
from omnid.engines.capabilities import capabilities, job_param_problem, values_problem
from omnid.fair_queue import PRIORITY_LIMIT
from omnid.lora import adapter_problem
from omnid.params import merged, plain_value
from omnid.store import JobStore
from omnid.supervisor.errors import Problems, Refused
from omnid.supervisor.jobs.submission import Submission
from omnid.vocabulary import ErrorCode

MAX_TIMEOUT_S = 7 * 24 * 3600.0
SUMMARY_CHARS = 1000          # how much of a long text input the job document shows
JOB_KEYS = frozenset({"pipeline", "inputs", "params", "timeout_s", "priority"})
MAX_BYTES_KEY = web.AppKey("max_request_bytes", int)      # the app's `daemon.max_request_bytes`


async def json_body(request: web.Request) -> Any:
    """The request's JSON body; Refused 413 over `daemon.max_request_bytes`, 400 if it is not JSON."""
    limit = request.app[MAX_BYTES_KEY]
    if request.content_length is not None and request.content_length > limit:
        raise Refused(413, ErrorCode.TOO_LARGE, f"the request body is larger than {limit} bytes "
                      "(daemon.max_request_bytes)", max_bytes=limit)
    raw = await request.read()
    try:
        # NaN and Infinity are not JSON: refused here, they could never be answered as JSON.
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, ErrorCode.BAD_JSON, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise Refused(400, ErrorCode.BAD_JSON, "the request body is nested too deeply") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def job_submission(config: Config, body: Any, owner_uid: int) -> Submission:
    """`POST /v1/jobs`'s body, checked: {"pipeline", "inputs", "params", "timeout_s", "priority"}; the
    job would be `owner_uid`'s. A refusal says every problem at once (`Problems`)."""
    if not isinstance(body, dict):
        raise Refused(400, ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
    said = Problems()
    unknown = set(body) - JOB_KEYS
    if unknown:
        said.add(Refused(400, ErrorCode.INVALID_REQUEST, f"unknown field(s) {', '.join(sorted(unknown))}; "
                         f"a job has {', '.join(sorted(JOB_KEYS))}"))
    name = body.get("pipeline")
    pipeline = None
    if not isinstance(name, str) or not name:
        said.add(Refused(400, ErrorCode.INVALID_REQUEST, "\"pipeline\" must name a pipeline"))
    else:
        pipeline = said.of(find_pipeline, config, name)
    given = params = None
    if pipeline is not None:
        given = said.of(inputs, config, body.get("inputs", {}), pipeline)
        params = said.of(job_params, config, body.get("params", {}), pipeline)
    timeout = said.of(timeout_s, body.get("timeout_s"))
    rank = said.of(priority, body.get("priority"))
    said.check()
    assert pipeline is not None and given is not None and params is not None and rank is not None
    return Submission(pipeline, given[0], params, given[1], owner_uid, timeout, priority=rank)


def timeout_s(raw: Any) -> float | None:
    """A job's `timeout_s`: seconds in (0, MAX_TIMEOUT_S], or None."""
    # A range check, not math.isfinite: that overflows on a 400-digit integer.
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (int, float))
                            or not 0 < raw <= MAX_TIMEOUT_S):
        raise Refused(400, ErrorCode.INVALID_REQUEST, f"\"timeout_s\" must be a number of seconds in "
                      f"(0, {MAX_TIMEOUT_S:.0f}], not {raw!r}", input="timeout_s")
    return None if raw is None else float(raw)


def priority(raw: Any, field: str = "priority") -> int:
    """A job's `priority`: an integer, lower runs earlier, 0 when not given (as vLLM's)."""
    if raw is None:
        return 0
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)          # JSON's integers: -3.0 is one (JSON Schema's "integer" says so too)
    if isinstance(raw, bool) or not isinstance(raw, int) or not -PRIORITY_LIMIT <= raw <= PRIORITY_LIMIT:
        raise Refused(400, ErrorCode.INVALID_REQUEST, f"\"{field}\" must be an integer from {-PRIORITY_LIMIT} to "
                      f"{PRIORITY_LIMIT} (lower runs earlier; 0 by default), not {raw!r}", input=field)
    return raw


def owned(config: Config, sub: Submission, key: str | None, socket: bool) -> Submission:
    """The submission with its owner's policy (`[daemon.owners]`): its fair-share weight and queued
    bound; 403 `priority_not_allowed` when it asks for a priority more urgent than the owner's `max_priority`."""
    weight, top, queued = config.daemon.owner_policy(sub.owner_uid, key, socket)
    if top is not None and sub.priority < top:
        who = f"key {key!r}" if key else f"uid {sub.owner_uid}"
        raise Refused(403, ErrorCode.PRIORITY_NOT_ALLOWED, f"priority {sub.priority} is more urgent than {who} may "
                      f"ask: its max_priority is {top} (daemon.owners; lower runs earlier)",
                      input="priority", max_priority=top)
    return replace(sub, key=key, weight=weight, max_queued=queued)


def find_pipeline(config: Config, name: str, in_path: bool = False) -> PipelineConfig:
    """The pipeline named `name`; else Refused `unknown_pipeline` (400 named in a body, 404 in a path)."""
    pipeline = config.pipelines.get(name)
    if pipeline is None:
        why = f"no pipeline {name!r}; known: {', '.join(sorted(config.pipelines))}"
        if in_path:
            raise Refused(404, ErrorCode.UNKNOWN_PIPELINE, why)
        raise Refused(400, ErrorCode.UNKNOWN_PIPELINE, why)
    return pipeline


# ------------------------------------------------------------------ inputs


def inputs(config: Config, raw: Any, pipeline: PipelineConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job's `inputs` as JSON gives them, decoded (files to bytes) and checked for the
    pipeline's first stages; with the summary the job document shows. A refusal names every wrong
    input, and what the first stages need of the others."""
    if not isinstance(raw, dict):
        raise Refused(400, ErrorCode.INVALID_REQUEST, "\"inputs\" must be an object of named inputs")
    said = Problems()
    found: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for key, value in raw.items():
        decoded = said.of(_input, key, value)
        if decoded is not None:
            found[key], summary[key] = decoded
    try:
        check_inputs(config, found, summary, pipeline)
    except Refused as need:             # (what the stages need of an input that is wrong already: said)
        if need.extra.get("input") not in {r.extra.get("input") for r in said.found} - {None}:
            said.add(need)
    said.check()
    return found, summary


def _input(key: str, value: Any) -> tuple[Any, Any]:
    """One input as JSON gives it: (its value, files decoded to bytes; its summary)."""
    if not key or len(key) > 128:
        raise Refused(400, ErrorCode.INVALID_INPUT, f"input name {key!r} is empty or too long", input=key)
    if isinstance(value, (str, int, float, bool)) or value is None:
        if not plain_value(value):
            raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r} is not a finite number", input=key)
        return value, text_summary(value) if isinstance(value, str) else value
    if _is_file(value) or _is_samples(value):
        return _file_or_samples(key, value)
    if isinstance(value, list) and value and all(_is_file(v) or _is_samples(v) for v in value):
        decoded = [_file_or_samples(f"{key}[{i}]", v) for i, v in enumerate(value)]
        return [data for data, _ in decoded], [doc for _, doc in decoded]
    if isinstance(value, list) and plain_value(value):
        return value, list_summary(value)
    raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r} must be a string, number, boolean, list of "
                  "those, a file {\"b64\": ..., \"filename\": ...} or a list of files, or audio samples "
                  "{\"samples\": [...], \"rate\": HZ}", input=key)


def text_summary(value: str) -> str:
    """A text input as the job document shows it: long ones cut (listings stay small)."""
    return value if len(value) <= SUMMARY_CHARS else value[:SUMMARY_CHARS] + f"... ({len(value)} characters)"


def list_summary(value: list[Any]) -> list[Any] | str:
    """A list input as the job document shows it: whole while its JSON is short, else its length and
    size (the document, the 201 and every listing stay small whatever a job was given)."""
    size = len(json.dumps(value, separators=(",", ":")))
    return value if size <= SUMMARY_CHARS else f"[a list of {len(value)} values, {size} bytes of JSON]"


def check_inputs(config: Config, found: Mapping[str, Any], summary: Mapping[str, Any], pipeline: PipelineConfig) -> None:
    """What the pipeline's first stages need of a job's (decoded) inputs: the text `prompt` of an
    engine that needs one, the media of one that takes them within its limits (each file's type and
    size read from its header; `summary` gains what was read). Refused names the input."""
    for src in pipeline.sources:
        stage = config.stages[src]
        caps = capabilities(stage.engine)
        has_media = caps.media and _check_media(stage, pipeline, found, summary)
        prompt = found.get("prompt")
        if caps.text_prompt and isinstance(prompt, bytes):
            raise Refused(400, ErrorCode.INVALID_INPUT, f"input \"prompt\" of {stage.engine} stage {src!r} must be "
                          "text, not a file (use --prompt or --input prompt=...)", input="prompt")
        if caps.text_prompt and prompt is not None and not isinstance(prompt, str):
            raise Refused(400, ErrorCode.INVALID_INPUT, f"input \"prompt\" of {stage.engine} stage {src!r} must be "
                          f"text, not {_kind_of(prompt)} ({text_summary(json.dumps(prompt))[:60]})", input="prompt")
        if (caps.chat and isinstance(found.get("messages"), str)) or has_media \
                or (caps.tensors and any(found.get(k) is not None for k in TENSOR_PROMPTS)):
            continue                # a chat (JSON text), media (the stage renders its chat template), tensors
        if caps.text_prompt and not isinstance(prompt, str):
            raise Refused(400, ErrorCode.MISSING_INPUT, f"pipeline {pipeline.name!r} starts with {stage.engine} stage "
                          f"{src!r}, which needs a text input \"prompt\"{_what_was_given(found)}", input="prompt")
    _check_lengths(config, found, pipeline)


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a list" if isinstance(value, list) else "null" if value is None else type(value).__name__


def _what_was_given(found: Mapping[str, Any]) -> str:
    """What a job without its `prompt` gave instead: its inputs' names, a near miss named."""
    if not found:
        return "; the job has no inputs"
    names = sorted(found)
    near = difflib.get_close_matches("prompt", names, n=1, cutoff=0.6)
    hint = f" (did you mean \"prompt\" for {near[0]!r}?)" if near else ""
    return f"; the job's inputs are {', '.join(repr(n) for n in names)}{hint}"


def _check_lengths(config: Config, found: Mapping[str, Any], pipeline: PipelineConfig) -> None:
    """A text prompt (or a chat's text) that cannot fit a first stage's context window: 400, the
    input named, before a job is made of it (`prompt_length`)."""
    prompt, messages = found.get("prompt"), found.get("messages")
    for src in pipeline.sources:
        stage = config.stages[src]
        caps = capabilities(stage.engine)
        if not caps.context_window or any(found.get(k) is not None for k in TENSOR_PROMPTS):
            continue
        if caps.chat and isinstance(messages, str):
            try:
                text, name = prompt_length.chat_text(json.loads(messages)), "messages"
            except ValueError:
                continue            # (the stage says what is wrong with it)
        elif isinstance(prompt, str):
            text, name = prompt, "prompt"
        else:
            continue
        why = prompt_length.too_long(stage, text)
        if why is not None:
            raise Refused(400, ErrorCode.PROMPT_TOO_LONG, f"input {name!r} is too long: {why}", input=name)


def _check_media(stage: StageConfig, pipeline: PipelineConfig, found: Mapping[str, Any],
                 summary: Mapping[str, Any]) -> bool:
    """A first stage's media inputs against its `media` limits; True if the job has any."""
    any_media = False
    for kind in media.MEDIA_KINDS:
        value = found.get(kind)
        if value is None:
            continue
        any_media = True
        if not stage.media.count(kind):
            raise Refused(400, ErrorCode.MEDIA_NOT_ACCEPTED, f"input {kind!r}: pipeline {pipeline.name!r} starts "
                          f"with stage {stage.name!r}, whose model takes no {kind} input (the media it takes: "
                          f"{', '.join(stage.media.kinds) or 'none'})", input=kind)
        files = value if isinstance(value, list) else [value]
        if not all(isinstance(v, bytes) for v in files):
            what = "a list of frame files" if kind == "video" else "a file {\"b64\": ...} or a list of files"
            raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {kind!r} must be {what}", input=kind)
        try:
            found_items = media.check_media(kind, value, stage.media)
        except media.MediaError as e:
            raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {kind!r}{_filename(summary.get(kind))}: {e} "
                          f"(stage {stage.name!r})", input=kind) from None
        doc = summary.get(kind)
        if isinstance(doc, dict) and found_items:
            doc.update(found_items[0])
        elif isinstance(doc, list) and kind != "video":
            for item_doc, found_doc in zip(doc, found_items):
                if isinstance(item_doc, dict):
                    item_doc.update(found_doc)
    chat = found.get("messages")
    if isinstance(chat, str) and '"type"' in chat:      # a chat may place media parts of its own
        try:
            placed = media.chat_media_counts(json.loads(chat))
        except ValueError:
            placed = {}             # (the stage says what is wrong with it)
        for kind, n in placed.items():
            if not n:
                continue
            if not stage.media.count(kind):
                raise Refused(400, ErrorCode.MEDIA_NOT_ACCEPTED, f"input \"messages\" has {kind} parts, but "
                              f"stage {stage.name!r}'s model takes no {kind} input", input="messages")
            given = len(media.as_items(kind, found[kind])) if found.get(kind) is not None else 0
            if n != given:
                raise Refused(400, ErrorCode.INVALID_MEDIA, f"input \"messages\" has {n} {kind} part(s), but "
                              f"input {kind!r} gives {given}", input=kind)
            any_media = True
    return any_media


def _is_file(value: Any) -> bool:
    return isinstance(value, dict) and set(value) <= {"b64", "filename"} and isinstance(value.get("b64"), str) \
        and isinstance(value.get("filename"), (str, type(None)))


def _is_samples(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"samples", "rate"}


def _file_or_samples(key: str, value: Mapping[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """A file input's bytes, or audio samples as a WAV file; and the summary the job shows of it."""
    if "samples" in value:
        rate = value["rate"]
        if isinstance(rate, float) and rate.is_integer():
            rate = int(rate)            # (JSON has one number type: 16000.0 is the integer its schema says)
        try:
            wav = media.samples_to_wav(value["samples"], rate)
        except media.MediaError as e:
            raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {key!r}: {e}", input=key.partition("[")[0]) from None
        return wav, {"samples": len(value["samples"]), "rate": rate, "size": len(wav)}
    try:
        data = base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r}: \"b64\" is not valid base64",
                      input=key.partition("[")[0]) from None
    return data, {"filename": value.get("filename"), "size": len(data)}


def _filename(doc: Any) -> str:
    """` (cat.png)`, for an error about a named file input."""
    name = doc.get("filename") if isinstance(doc, dict) else None
    return f" ({name})" if isinstance(name, str) and name else ""


# ------------------------------------------------------------------ params


def job_params(config: Config, raw: Any, pipeline: PipelineConfig) -> dict[str, dict[str, Any]]:
    """A job's `params` ({"STAGE": {"KEY": value}}), each checked by its stage's engine's rules; a
    refusal says every wrong one."""
    if not isinstance(raw, dict):
        raise Refused(400, ErrorCode.INVALID_REQUEST, "\"params\" must be an object: {\"STAGE\": {\"KEY\": value}}")
    said = Problems()
    out: dict[str, dict[str, Any]] = {}
    for stage_name, values in raw.items():
        if stage_name not in pipeline.stages:
            said.add(Refused(400, ErrorCode.INVALID_PARAM, f"pipeline {pipeline.name!r} has no stage {stage_name!r} "
                             f"(its stages: {', '.join(pipeline.stages)})"))
        elif not isinstance(values, dict):
            said.add(Refused(400, ErrorCode.INVALID_PARAM, f"params.{stage_name} must be an object"))
        else:
            out[stage_name] = said.of(_stage_params, config.stages[stage_name], values) or {}
    said.check()
    return out


def _stage_params(stage: StageConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """One stage's params, checked by its engine's rules: each wrong one, else what they make together."""
    said = Problems()
    for key, value in values.items():
        why = job_param_problem(stage.name, stage.engine, stage.defaults, key, value)
        if why is None and key in ("adapter", "adapters"):
            why = adapter_problem(stage.name, stage.engine, stage.adapters, key, value)
        if why is not None:
            said.add(Refused(400, ErrorCode.INVALID_PARAM, why))
    said.check()
    why = values_problem(stage.name, stage.engine, merged(stage.defaults, values))
    if why is None and capabilities(stage.engine).context_window:
        why = prompt_length.max_tokens_problem(stage, values.get("max_tokens"))
        why = f"stage {stage.name!r}: {why}" if why is not None else None
    if why is not None:
        raise Refused(400, ErrorCode.INVALID_PARAM, why)
    return dict(values)


# ------------------------------------------------------------------ what a pipeline answers with


def answers(config: Config, store: JobStore, p: PipelineConfig) -> list[str] | None:
    """The kinds of answer the pipeline gives (`text`, `image`, ...), known before any job runs: its
    last stages' engines' (vllm: text, diffusers: image), or what a python last stage declares (its
    `produces`, or its function's); None when one declares nothing (it may give anything). (`store`
    is no longer read: a pipeline's answer is not learned from its past jobs.)"""
    kinds: set[str] = set()
    for s in p.sinks:
        stage = config.stages[s]
        kind = capabilities(stage.engine).answer
        if kind is not None:
            kinds.add(kind)
        elif stage.produces is not None:
            kinds |= set(stage.produces)
        else:
            return None
    return sorted(kinds)


def media_stage(config: Config, p: PipelineConfig) -> StageConfig | None:
    """The stage a chat's media go to: the pipeline's first stage whose engine takes media."""
    for name in p.sources:
        stage = config.stages[name]
        if capabilities(stage.engine).media:
            return stage
    return None


def token_stage(config: Config, p: PipelineConfig) -> str | None:
    """The stage whose params the sampling fields set (and whose tokens are counted): of the stages
    whose engine samples, a last stage, else the last one."""
    sampling = [s for s in p.stages if capabilities(config.stages[s].engine).sampling]
    sinks = [s for s in sampling if s in p.sinks]
    return (sinks or sampling)[-1] if sampling else None


def text_stage(config: Config, p: PipelineConfig) -> str | None:
    """The last stage whose text segments are the answer: one whose engine answers in text, else
    one whose engine's answer is not declared (a function's)."""
    answer = {s: capabilities(config.stages[s].engine).answer for s in p.sinks}
    for wanted in ("text", None):
        for s in p.sinks:
            if answer[s] == wanted:
                return s
    return None


def image_stage(config: Config, p: PipelineConfig) -> str | None:
    """The last stage whose engine takes an image's `width` and `height`."""
    return next((s for s in reversed(p.stages) if capabilities(config.stages[s].engine).image_size), None)


def prompt_key(config: Config, p: PipelineConfig, otherwise: str = "prompt") -> str:
    """The input a text goes in: `prompt` when a first stage's engine needs a text prompt, else `otherwise`."""
    return "prompt" if any(capabilities(config.stages[s].engine).text_prompt for s in p.sources) else otherwise


# ------------------------------------------------------------------ a request body's model, and its problems said plainly

# A message to say for a field (by its path: names, "*" for any index), given where it is ("messages[0].role")
# and its value; and the param to name when not that path itself: a name, or how much of the path.
Say = Callable[[str, Any], str]
Said = dict[tuple[str, ...], tuple[Say, str | int | None]]


def fixed(message: str) -> Say:
    return lambda at, value: message


def shown(value: Any) -> str:
    """A wrong value as a message shows it: its repr, cut (a body may hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


class CheckedBody(BaseModel):
    """A request body's model (pydantic: one definition that parses, checks and describes it), whose
    problems are said as a user reads them: by `MESSAGES` (per field path) or in plain words, each
    naming its field; never pydantic's own wording. The front end that parses it raises its own
    error with them (OpenAI's shape on the OpenAI paths, a `Refused` on the socket API's)."""

    MESSAGES: ClassVar[Said] = {}

    @classmethod
    def problems(cls, error: ValidationError, body: Any) -> list[tuple[str | None, str]]:
        """(the field, the message) of each problem of `body`, in order; the fields the body may not
        have, in one."""
        errors = error.errors(include_url=False)
        top = [err for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
        unknown = [_where(list(err["loc"])) for err in top]
        said = [cls._say(err, body) for err in errors if not any(err is t for t in top)]
        if unknown:
            said.append((unknown[0], f"unknown field(s) {', '.join(unknown)}; the fields are "
                                     f"{', '.join(cls.model_fields)}"))
        return said

    @classmethod
    def _say(cls, err: ErrorDetails, body: Any) -> tuple[str | None, str]:
        """(param, message) of one of pydantic's errors: the message of the longest known path that
        starts the error's, else `_plain`'s."""
        path = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("="))]    # (our union tags)
        for n in range(len(path), 0, -1):
            key = tuple("*" if isinstance(p, int) else p for p in path[:n])
            known = cls.MESSAGES.get(key)
            if known is not None:
                at = _where(path[:n])
                say, param = known
                named = _where(path[:param]) if isinstance(param, int) else param or at
                return named, say(at, _value_at(body, path[:n]))
        return _where(path) or None, _plain(err, _where(path))


def _where(path: list[int | str]) -> str:
    """A field's path as the error names it: `messages[0].content[1]`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _value_at(body: Any, path: list[int | str]) -> Any:
    for p in path:
        try:
            body = body[p]
        except (KeyError, IndexError, TypeError):
            return None
    return body


_PLAIN = {"missing": "is required", "string_type": "must be a string", "bool_type": "must be true or false",
          "int_type": "must be an integer", "float_type": "must be a number", "list_type": "must be an array",
          "dict_type": "must be an object", "model_type": "must be an object", "model_attributes_type":
          "must be an object", "none_required": "is not supported (null only)", "extra_forbidden": "is not a field here"}


def _plain(err: ErrorDetails, at: str) -> str:
    """A problem no message of the model's names, in plain words."""
    words = _PLAIN.get(err["type"])
    if words is None:
        ctx = err.get("ctx") or {}
        if err["type"] == "literal_error":
            words = f"must be {ctx.get('expected')}"
        elif err["type"] in ("too_short", "too_long"):
            words = f"must have {'at least' if err['type'] == 'too_short' else 'at most'} " \
                    f"{ctx.get('min_length', ctx.get('max_length'))} item(s)"
        else:
            words = err["msg"].replace("Input should be", "must be")
    return f"{at or 'the request body'} {words}, not {shown(err['input'])}" \
        if err["type"] not in ("missing", "extra_forbidden") else f"{at} {words}"


