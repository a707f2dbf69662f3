"""``omnictl``'s job commands: ``submit`` (with its KEY=VALUE, KEY=PATH and STAGE.KEY=VALUE
arguments), ``status``, ``cancel``, ``rm``, ``watch``, ``result``, ``trace`` and ``talk``; following a
job's events and writing its outputs.

Runs in the omnictl process's main thread; blocks on the daemon's socket (without limit while
following a job) and on writing output files. cli.py adds these to ``omnictl``'s group (``COMMANDS``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TextIO

import click

from omnictl import render
from omnictl.cli_base import (
    ExitCode,
    Settings,
    command,
    complete_jobs,
    complete_pipelines,
    fail,
    job_ids_argument,
    output_dir_option,
    print_json,
    print_json_line,
)
from omnictl.client import JOB_STATES, TERMINAL_STATES, ApiError, Client, ClientError, file_input
from omnid.vocabulary import JobState

# --- parsing KEY=VALUE arguments ---------------------------------------------------------------


def _split_assignment(value: str, param_hint: str) -> tuple[str, str]:
    key, sep, rest = value.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{value!r} is not {param_hint}", param_hint=param_hint)
    return key, rest


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(name)  # NaN and Infinity are not JSON; take such values as strings


def parse_param_value(text: str) -> Any:
    """A ``--param`` value: JSON when it parses (numbers, true/false, null, lists, objects), else the string."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text
    if isinstance(value, float) and not math.isfinite(value):        # 1e400 parses as inf
        raise click.BadParameter(f"{text!r} is not a finite number", param_hint="STAGE.KEY=VALUE")
    return value


def _parse_inputs(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    return dict(_split_assignment(value, "KEY=VALUE") for value in values)


def _parse_files(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for value in values:
        key, path = _split_assignment(value, "KEY=PATH")
        if not path:
            raise click.BadParameter(f"{value!r} names no file", param_hint="KEY=PATH")
        try:
            data = file_input(path)
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="KEY=PATH") from None
        # The same KEY again: a list of files, in order (several images for one job, a video's frames).
        if key not in files:
            files[key] = data
        elif isinstance(files[key], list):
            files[key].append(data)
        else:
            files[key] = [files[key], data]
    return files


def _parse_params(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    params: dict[str, dict[str, Any]] = {}
    for value in values:
        target, text = _split_assignment(value, "STAGE.KEY=VALUE")
        stage, dot, key = target.partition(".")
        if not dot or not stage or not key:
            raise click.BadParameter(f"{value!r} is not STAGE.KEY=VALUE", param_hint="STAGE.KEY=VALUE")
        params.setdefault(stage, {})[key] = parse_param_value(text)
    return params


def _follow(
    settings: Settings, client: Client, job_id: str, stream: TextIO, sinks: list[str] | None = None, created_at: Any = None
) -> dict[str, Any]:
    """Follow a job to its end, printing its events (to stdout as NDJSON with --json, else
    for humans to ``stream``, live when it is a terminal); return the final job.

    With ``sinks`` (the pipeline's last stages), the human view also says once when the first of
    their outputs came (timed from the job's ``created_at``)."""
    if settings.json:
        return client.wait(job_id, print_json_line)
    printer = render.EventPrinter(
        stream, live=stream.isatty(), sinks=sinks or (),
        created_at=created_at if isinstance(created_at, (int, float)) else None,
    )
    try:
        return client.wait(job_id, printer.feed)
    finally:
        printer.close_line()


def _pipeline_sinks(client: Client, name: str) -> list[str]:
    """The pipeline's last stages (those with no outgoing edge), from ``GET /v1/pipelines``; [] if unknown."""
    try:
        document = client.pipelines()
    except ClientError:
        return []  # only the "first output" line needs them; following the job will say what is wrong
    for pipeline in document.get("pipelines") or []:
        if not isinstance(pipeline, dict) or pipeline.get("name") != name:
            continue
        sinks = pipeline.get("sinks")
        if isinstance(sinks, list):
            return [str(s) for s in sinks]
        stages = pipeline.get("stages") or []
        edges = [e for e in pipeline.get("edges") or [] if isinstance(e, dict)]
        return [str(s) for s in stages if not any(e.get("from") == s for e in edges)]
    return []


def _write_results(settings: Settings, client: Client, job: Mapping[str, Any], output_dir: Path | None) -> NoReturn:
    """Write a finished job's outputs, list them, end with its state line, and exit by its state."""
    directory = output_dir if output_dir is not None else Path(str(job.get("id")))
    paths = client.save_outputs(job, directory)
    if not settings.json:
        for path in paths:
            click.echo(str(path))
        click.echo(render.final_state_line(job))
    raise click.exceptions.Exit(int(ExitCode.OK if job.get("state") == JobState.SUCCEEDED else ExitCode.JOB_FAILED))


@command(
    click.argument("pipeline", shell_complete=complete_pipelines),
    click.option("--prompt", metavar="TEXT", help="Shorthand for --input prompt=TEXT."),
    click.option("--input", "inputs", multiple=True, metavar="KEY=VALUE", callback=_parse_inputs, help="A string input."),
    click.option("--file", "files", multiple=True, metavar="KEY=PATH", callback=_parse_files,
                 help="A file input (an image, a WAV file, ...); the same KEY again makes a list of files."),
    click.option(
        "-p", "--param", "params", multiple=True, metavar="STAGE.KEY=VALUE", callback=_parse_params,
        help="A stage parameter; VALUE is JSON if it parses, else a string.",
    ),
    click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), metavar="S", help="Job timeout in seconds."),
    click.option("--priority", type=int, metavar="N", help="Lower runs earlier (0 by default; below your "
                 "max_priority: 403)."),
    click.option("--wait", is_flag=True, help="Follow the job, write its outputs, exit by its final state."),
    output_dir_option,
)
def submit(
    settings: Settings,
    pipeline: str,
    prompt: str | None,
    inputs: dict[str, str],
    files: Mapping[str, Any],
    params: dict[str, dict[str, Any]],
    timeout_s: float | None,
    priority: int | None,
    wait: bool,
    output_dir: Path | None,
) -> None:
    """Submit a job to PIPELINE and print its id."""
    if output_dir is not None and not wait:
        raise click.UsageError("-o/--output-dir needs --wait (or use `omnictl result JOB -o DIR`)")
    all_inputs: dict[str, Any] = dict(inputs)
    for key, value in files.items():
        if key in all_inputs:
            raise click.UsageError(f"input {key!r} is given twice (--input and --file)")
        all_inputs[key] = value
    if prompt is not None:
        if "prompt" in all_inputs:
            raise click.UsageError("give --prompt or --input prompt=..., not both")
        all_inputs["prompt"] = prompt
    if timeout_s is not None and not math.isfinite(timeout_s):
        raise click.BadParameter("must be a finite number of seconds", param_hint="--timeout")

    client = settings.client()
    job = client.submit(pipeline, all_inputs, params, timeout_s, priority)
    job_id = str(job.get("id"))
    if not wait:
        if settings.json:
            print_json(job)
        else:
            click.echo(job_id)
        return
    sinks: list[str] = []
    if not settings.json:
        click.echo(job_id)
        sinks = _pipeline_sinks(client, pipeline)
    try:
        final = _follow(settings, client, job_id, sys.stderr, sinks, job.get("created_at"))
    except KeyboardInterrupt:
        fail(f"stopped waiting; job {job_id} keeps running (`omnictl cancel {job_id}` stops it)", ExitCode.INTERRUPTED)
    _write_results(settings, client, final, output_dir)


@command(
    click.argument("job_id", metavar="[JOB]", required=False, shell_complete=complete_jobs),
    click.option("--state", type=click.Choice(JOB_STATES), help="Only jobs in this state."),
    click.option("--pipeline", help="Only jobs of this pipeline."),
    click.option("-n", "--limit", type=click.IntRange(0, 1000), default=20, show_default=True,
                 help="How many jobs, newest first (0: as many as the daemon lists, 1000)."),
)
def status(settings: Settings, job_id: str | None, state: str | None, pipeline: str | None, limit: int) -> None:
    """Show one job in detail, or a table of your recent jobs."""
    client = settings.client()
    now = time.time()
    if job_id is not None:
        job = client.job(job_id)
        if settings.json:
            print_json(job)
        else:
            click.echo(render.job_detail(job, now))
        return
    listing = client.jobs(state=state, pipeline=pipeline, limit=limit or 1000)
    if settings.json:
        print_json(listing)
        return
    click.echo(render.jobs_table(listing.get("jobs") or [], now))


def _for_each_job(
    settings: Settings, job_ids: tuple[str, ...], action: Callable[[str], dict[str, Any]], describe: Callable[[str, dict[str, Any]], str]
) -> None:
    """Apply ``action`` to every job, reporting each; a refusal does not stop the others.

    With --json: one job's answer is its document; several jobs' are one JSON array, in the order
    given, a refused one as ``{"id", "error": {"code", "message"}}`` (and on stderr as ever)."""
    refused = False
    documents: list[Any] = []
    for job_id in job_ids:
        try:
            document = action(job_id)
        except ApiError as exc:
            refused = True
            prefix = f"{job_id}: " if len(job_ids) > 1 else ""
            click.echo(f"omnictl: {prefix}{exc.message} ({exc.code})", err=True)
            documents.append({"id": job_id, "error": {"code": exc.code, "message": exc.message}})
            continue
        documents.append(document)
        if not settings.json:
            click.echo(describe(job_id, document))
    if settings.json and len(job_ids) > 1:
        print_json(documents)
    elif settings.json and not refused:
        print_json(documents[0])
    if refused:
        raise click.exceptions.Exit(int(ExitCode.REFUSED))


@command(job_ids_argument)
def cancel(settings: Settings, job_ids: tuple[str, ...]) -> None:
    """Cancel queued or running jobs (cancelling a finished job changes nothing)."""
    _for_each_job(settings, job_ids, settings.client().cancel, lambda job_id, job: f"{job.get('id') or job_id} {job.get('state')}")


@command(job_ids_argument)
def rm(settings: Settings, job_ids: tuple[str, ...]) -> None:
    """Forget finished jobs and delete their output files."""
    _for_each_job(settings, job_ids, settings.client().delete, lambda job_id, doc: str(doc.get("deleted") or job_id))


@command(click.argument("job_id", metavar="JOB", shell_complete=complete_jobs))
def watch(settings: Settings, job_id: str) -> None:
    """Follow a job's events until it ends; exit 1 unless it succeeded."""
    client = settings.client()
    try:
        final = _follow(settings, client, job_id, sys.stdout)
    except KeyboardInterrupt:
        fail(f"stopped watching; job {job_id} keeps running (`omnictl cancel {job_id}` stops it)", ExitCode.INTERRUPTED)
    if not settings.json:
        click.echo(render.final_state_line(final))
    raise click.exceptions.Exit(int(ExitCode.OK if final.get("state") == JobState.SUCCEEDED else ExitCode.JOB_FAILED))


@command(click.argument("job_id", metavar="JOB", shell_complete=complete_jobs), output_dir_option)
def result(settings: Settings, job_id: str, output_dir: Path | None) -> None:
    """Write the outputs of a finished JOB (into -o/--output-dir, default ./<job id>/); exit 1 unless it succeeded."""
    client = settings.client()
    job = client.job(job_id)
    if job.get("state") not in TERMINAL_STATES:
        fail(f"job {job_id} is {job.get('state')}; `omnictl watch {job_id}` follows it (job_not_finished)", ExitCode.REFUSED)
    if settings.json:
        print_json(job)
    _write_results(settings, client, job, output_dir)


@command(click.argument("job_id", metavar="JOB", shell_complete=complete_jobs),
         click.option("--width", type=click.IntRange(40), default=None, help="Columns to draw in "
                      "(default: the terminal's)."))
def trace(settings: Settings, job_id: str, width: int | None) -> None:
    """Draw a job's timeline: one bar per stage and edge (waiting, running, first segment), from the
    daemon's own record of the job (no trace collector needed); --json gives the rows."""
    import shutil

    from omnictl.client import EventsIdleTimeout
    from omnictl.timeline import timeline, waterfall
    client = settings.client()
    job = client.job(job_id)
    events: list[dict[str, Any]] = []
    try:        # a live job's stream goes on: what came so far
        for ev in client.events(str(job.get("id") or job_id),
                                idle_timeout=None if job.get("state") in TERMINAL_STATES else 0.5):
            events.append(ev)
    except EventsIdleTimeout:
        pass
    try:
        edges = client.pipeline(str(job.get("pipeline"))).get("edges") or []
    except ApiError:
        edges = []          # a pipeline the config no longer has: its stages alone
    doc = timeline(job, events, edges)
    if settings.json:
        print_json(doc)
    else:
        click.echo(waterfall(doc, width or shutil.get_terminal_size((100, 24)).columns))


@command(
    click.argument("pipeline", shell_complete=complete_pipelines),
    click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Write each spoken answer here as a WAV file (default: play it if an audio output is "
                      "there, else write it into ./)."),
    click.option("--text", "text_only", is_flag=True, help="Answers in text only."),
    click.option("--voice", default=None, help="The voice (a speaker the pipeline knows)."),
    click.option("--url", default=None, help="Talk over TCP to this base URL (http://HOST:PORT) instead of the "
                                             "socket, with $OMNID_API_KEY as the key."),
)
def talk(settings: Settings, pipeline: str, output_dir: Path | None, text_only: bool, voice: str | None,
         url: str | None) -> None:
    """Talk to PIPELINE: type a line, hear (or get as WAV files) and read the answer as it is made.
    Ctrl-C during an answer interrupts it (the daemon stops its job in every stage); Ctrl-D quits."""
    import asyncio
    import os

    from omnictl.client import default_socket_path
    from omnictl.talk import Talk, TalkError

    if settings.json:
        raise click.UsageError("`talk` is a conversation; --json does not apply to it")
    session = Talk(default_socket_path(settings.socket), pipeline, output_dir, text_only, voice,
                   play=output_dir is None, url=url, key=os.environ.get("OMNID_API_KEY") if url else None)
    try:
        code = asyncio.run(session.run())
    except TalkError as e:
        fail(str(e), ExitCode.REFUSED)
    raise click.exceptions.Exit(code)


COMMANDS: tuple[click.Command, ...] = (submit, status, cancel, rm, watch, result, trace, talk)
