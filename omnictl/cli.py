"""The ``omnictl`` command line: click parses arguments and formats results, nothing more.

Where it runs: in the omnictl process's main thread, one command per process. It blocks on the
daemon's socket through :class:`omnictl.client.Client` (30 s per request; without limit while
following a job's events) and on writing output files. The requests live in ``client.py``, the
formatting in ``render.py``.

Exit codes (the public contract): 0 success; 1 the job ended failed, cancelled or timed out (or a
local file could not be written); 2 usage error; 3 daemon unreachable; 4 the daemon refused the
request, its message printed to stderr as ``omnictl: <message> (<code>)``; 130 interrupted.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, NoReturn, TextIO

import click
from click.shell_completion import CompletionItem, get_completion_class

from omnictl import render
from omnictl.client import (
    JOB_STATES,
    TERMINAL_STATES,
    ApiError,
    Client,
    ClientError,
    DaemonUnreachable,
    file_input,
    parse_prometheus,
)
from omnid.vocabulary import JobState, WorkerState

COMPLETION_SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_OMNICTL_COMPLETE"     # click's shell-completion protocol variable for prog "omnictl"
COMPLETE_TIMEOUT_S = 1.0               # how long a <TAB> may wait for the daemon



class ExitCode(IntEnum):
    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    REFUSED = 4
    INTERRUPTED = 130


@dataclass
class Settings:
    """The global options, shared by every command through the click context."""

    socket: str | None = None
    json: bool = False

    def client(self) -> Client:
        return Client(self.socket)


pass_settings = click.make_pass_decorator(Settings, ensure=True)


def _fail(message: str, code: ExitCode) -> NoReturn:
    click.echo(f"omnictl: {message}", err=True)
    raise click.exceptions.Exit(int(code))


class OmnictlGroup(click.Group):
    """Maps the client's exceptions to the documented exit codes, in one place for every command."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as exc:
            _fail(f"{exc.message} ({exc.code})", ExitCode.REFUSED)
        except DaemonUnreachable as exc:
            _fail(str(exc), ExitCode.UNREACHABLE)
        except ClientError as exc:
            # The daemon answered, but not with the API (a bug on one side); it did not do the work.
            _fail(str(exc), ExitCode.REFUSED)
        except KeyboardInterrupt:
            # A verb that leaves a job running says so itself (submit --wait, watch); the rest
            # changed nothing that goes on without them.
            _fail("interrupted", ExitCode.INTERRUPTED)
        except BrokenPipeError:
            raise  # stdout went away (`| head`); click's main exits quietly
        except OSError as exc:
            # Requests never raise OSError (the client wraps them); this is a local file we wrote or read.
            where = f": {exc.filename}" if exc.filename else ""
            _fail(f"{exc.strerror or exc}{where}", ExitCode.JOB_FAILED)


# --- shared options, defined once ------------------------------------------------------------


def _enable_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(Settings).json = True


json_option = click.option(
    "--json",
    "json_output",
    is_flag=True,
    expose_value=False,
    callback=_enable_json,
    help="Print the API's JSON instead of text (also accepted before the command).",
)

output_dir_option = click.option(
    "-o",
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write the outputs here (default: ./<job id>/).",
)

# --- shell completion: names asked of the daemon, quietly -----------------------------------


def client_version() -> str:
    """omnictl's own version (the installed ``omnid`` distribution's)."""
    try:
        return importlib.metadata.version("omnid")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _completion_client(ctx: click.Context) -> Client:
    """A client for <TAB>: the ``--socket`` given so far (else the default), a short timeout."""
    socket = ctx.find_root().params.get("socket")
    return Client(socket if isinstance(socket, str) else None, timeout=COMPLETE_TIMEOUT_S)


def _names(ctx: click.Context, listing: Callable[[Client], Any], key: str, field: str) -> list[Any]:
    """The documents under ``key`` of a listing, or [] when the daemon cannot say (never an error)."""
    try:
        document = listing(_completion_client(ctx))
    except Exception:  # completion must stay silent whatever goes wrong: the shell shows nothing
        return []
    items = document.get(key) if isinstance(document, dict) else None
    return [item for item in items or [] if isinstance(item, dict) and isinstance(item.get(field), str)]


def complete_pipelines(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(p["name"], help=", ".join(map(str, p.get("stages") or [])))
            for p in _names(ctx, Client.pipelines, "pipelines", "name") if p["name"].startswith(incomplete)]


def complete_stages(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(s["name"], help=f"{s.get('engine')}, {s.get('state')}")
            for s in _names(ctx, Client.stages, "stages", "name") if s["name"].startswith(incomplete)]


def complete_jobs(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(j["id"], help=f"{j.get('pipeline')}, {j.get('state')}")
            for j in _names(ctx, lambda c: c.jobs(limit=200), "jobs", "id") if j["id"].startswith(incomplete)]


job_ids_argument = click.argument("job_ids", metavar="JOB...", nargs=-1, required=True, shell_complete=complete_jobs)


def command(*options: Callable[[Any], Any]) -> Callable[[Callable[..., None]], click.Command]:
    """Register a command with ``--json`` and the given options, passing it the Settings."""

    def decorate(fn: Callable[..., None]) -> click.Command:
        wrapped: Any = pass_settings(fn)
        for option in reversed(options):
            wrapped = option(wrapped)
        return cli.command(name=fn.__name__.rstrip("_").replace("_", "-"))(json_option(wrapped))

    return decorate


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


# --- output helpers ------------------------------------------------------------------------------


def _print_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2))


def _print_json_line(document: Any) -> None:
    click.echo(json.dumps(document))


def _follow(
    settings: Settings, client: Client, job_id: str, stream: TextIO, sinks: list[str] | None = None, created_at: Any = None
) -> dict[str, Any]:
    """Follow a job to its end, printing its events (to stdout as NDJSON with --json, else
    for humans to ``stream``, live when it is a terminal); return the final job.

    With ``sinks`` (the pipeline's last stages), the human view also says once when the first of
    their outputs came (timed from the job's ``created_at``)."""
    if settings.json:
        return client.wait(job_id, _print_json_line)
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


def _write_results(settings: Settings, client: Client, job: dict[str, Any], output_dir: Path | None) -> NoReturn:
    """Write a finished job's outputs, list them, end with its state line, and exit by its state."""
    directory = output_dir if output_dir is not None else Path(str(job.get("id")))
    paths = client.save_outputs(job, directory)
    if not settings.json:
        for path in paths:
            click.echo(str(path))
        click.echo(render.final_state_line(job))
    raise click.exceptions.Exit(int(ExitCode.OK if job.get("state") == JobState.SUCCEEDED else ExitCode.JOB_FAILED))


# --- commands ----------------------------------------------------------------------------------


@click.group(
    cls=OmnictlGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 job failed/cancelled/timed out, 2 usage, 3 daemon unreachable, 4 refused.",
)
@click.option(
    "--socket",
    metavar="PATH",
    default=None,
    help="The daemon's socket (default: $OMNID_SOCKET, else /run/omnid/omnid.sock for root, "
    "else $XDG_RUNTIME_DIR/omnid/omnid.sock).",
)
@click.option("--json", "json_output", is_flag=True, help="Print the API's JSON instead of text.")
@click.version_option(package_name="omnid", prog_name="omnictl", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, socket: str | None, json_output: bool) -> None:
    """Control omnid, the local multi-stage model serving daemon."""
    settings = ctx.ensure_object(Settings)
    settings.socket = socket
    settings.json = settings.json or json_output


@command(
    click.argument("pipeline", shell_complete=complete_pipelines),
    click.option("--prompt", metavar="TEXT", help="Shorthand for --input prompt=TEXT."),
    click.option("--input", "inputs", multiple=True, metavar="KEY=VALUE", callback=_parse_inputs, help="A string input."),
    click.option("--file", "files", multiple=True, metavar="KEY=PATH", callback=_parse_files,
                 help="A file input (an image, a WAV file, ...); the same KEY again makes a list of files."),
    click.option(
        "--param", "params", multiple=True, metavar="STAGE.KEY=VALUE", callback=_parse_params,
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
    files: dict[str, Any],
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
            _print_json(job)
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
        _fail(f"stopped waiting; job {job_id} keeps running (`omnictl cancel {job_id}` stops it)", ExitCode.INTERRUPTED)
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
            _print_json(job)
        else:
            click.echo(render.job_detail(job, now))
        return
    listing = client.jobs(state=state, pipeline=pipeline, limit=limit or 1000)
    if settings.json:
        _print_json(listing)
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
        _print_json(documents)
    elif settings.json and not refused:
        _print_json(documents[0])
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
        _fail(f"stopped watching; job {job_id} keeps running (`omnictl cancel {job_id}` stops it)", ExitCode.INTERRUPTED)
    if not settings.json:
        click.echo(render.final_state_line(final))
    raise click.exceptions.Exit(int(ExitCode.OK if final.get("state") == JobState.SUCCEEDED else ExitCode.JOB_FAILED))


@command(click.argument("job_id", metavar="JOB", shell_complete=complete_jobs), output_dir_option)
def result(settings: Settings, job_id: str, output_dir: Path | None) -> None:
    """Write the outputs of a finished JOB (into -o/--output-dir, default ./<job id>/); exit 1 unless it succeeded."""
    client = settings.client()
    job = client.job(job_id)
    if job.get("state") not in TERMINAL_STATES:
        _fail(f"job {job_id} is {job.get('state')}; `omnictl watch {job_id}` follows it (job_not_finished)", ExitCode.REFUSED)
    if settings.json:
        _print_json(job)
    _write_results(settings, client, job, output_dir)


@command()
def stages(settings: Settings) -> None:
    """Show every stage: state, process, devices, queue, work done and health."""
    document = settings.client().stages()
    if settings.json:
        _print_json(document)
    else:
        click.echo(render.stages_table(document.get("stages") or []))


@cli.group()
def stage() -> None:
    """Act on one stage (root or the daemon's admin group)."""


@stage.command("restart")
@click.argument("name", shell_complete=complete_stages)
@json_option
@click.option("--no-wait", is_flag=True, help="Return at once instead of waiting for the new worker.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for it.")
@pass_settings
def stage_restart(settings: Settings, name: str, no_wait: bool, timeout: float) -> None:
    """Replace NAME's workers (one given up after a crash loop too), one replica after the other:
    each one's running jobs finish first. A sleeping stage is woken instead.

    Waits until every new worker is ready (exit 0) or the stage failed (exit 1)."""
    client = settings.client()
    answer = client.restart_stage(name)
    old_pids = set(_replica_pids(answer.get("stage") or {}))
    if no_wait:
        if settings.json:
            _print_json(answer)
        else:
            click.echo(f"{name}: restarting")
        return

    def replaced(snap: dict[str, Any]) -> bool:     # ready, every replica a new process
        pids = _replica_pids(snap)
        return snap.get("state") in (WorkerState.READY, WorkerState.BUSY) and bool(pids) and None not in pids \
            and not old_pids & set(pids)

    snap = _wait_for_stage(settings, client, name, timeout, "not ready in time", done=replaced,
                           failed=(WorkerState.FAILED,))
    if settings.json:
        _print_json(snap)
    else:
        click.echo(f"{name}: ready (pid {snap.get('pid')}, loaded in {snap.get('load_s')} s)")


def _wait_for_stage(settings: Settings, client: Client, name: str, timeout: float, late: str,
                    done: Callable[[dict[str, Any]], bool], failed: tuple[str, ...]) -> dict[str, Any]:
    """Poll `GET /v1/stages` until stage `name` is `done`; exit 1 when it is in a `failed` state, is
    gone, or `timeout` passes (saying its state and last error, or `late`)."""
    deadline = time.monotonic() + timeout
    while True:
        snap: dict[str, Any] = next((s for s in client.stages().get("stages", []) if s.get("name") == name), {})
        if snap and done(snap):
            return snap
        state = snap.get("state")
        if not snap or state in failed or time.monotonic() > deadline:
            if settings.json:
                _print_json(snap)
            click.echo(f"omnictl: {name}: {state or 'gone'}: {snap.get('last_error') or late}", err=True)
            raise click.exceptions.Exit(int(ExitCode.JOB_FAILED))
        time.sleep(0.2)


def _replica_pids(snap: dict[str, Any]) -> list[Any]:
    replicas = snap.get("replicas")
    if isinstance(replicas, list) and replicas:
        return [r.get("pid") for r in replicas if isinstance(r, dict)]
    return [snap.get("pid")] if snap else []


@stage.command("sleep")
@click.argument("name", shell_complete=complete_stages)
@json_option
@pass_settings
def stage_sleep(settings: Settings, name: str) -> None:
    """Stop NAME's workers now, giving back their memory and GPUs; its next job wakes it (or
    `omnictl stage wake`). Refused (exit 4) while it has jobs in progress."""
    answer = settings.client().sleep_stage(name)
    if settings.json:
        _print_json(answer)
    else:
        click.echo(f"{name}: {'asleep already' if answer.get('already') else 'going to sleep'}")


@stage.command("wake")
@click.argument("name", shell_complete=complete_stages)
@json_option
@click.option("--no-wait", is_flag=True, help="Return at once instead of waiting for its workers.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for them.")
@pass_settings
def stage_wake(settings: Settings, name: str, no_wait: bool, timeout: float) -> None:
    """Load a sleeping stage's workers again, before its next job needs them.

    Waits until it is ready (exit 0) or could not wake (exit 1)."""
    client = settings.client()
    answer = client.wake_stage(name)
    if no_wait or answer.get("already"):
        if settings.json:
            _print_json(answer)
        else:
            click.echo(f"{name}: {'awake already' if answer.get('already') else 'waking'}")
        return
    # `sleeping` again: the wake failed (`starting` while it runs)
    snap = _wait_for_stage(settings, client, name, timeout, "not awake in time",
                           done=lambda snap: snap.get("state") in (WorkerState.READY, WorkerState.BUSY,
                                                                   WorkerState.DEGRADED),
                           failed=(WorkerState.FAILED, WorkerState.SLEEPING))
    if settings.json:
        _print_json(snap)
    else:
        click.echo(f"{name}: {snap.get('state')} (woke in {snap.get('wake_s')} s)")


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
        _print_json(doc)
    else:
        click.echo(waterfall(doc, width or shutil.get_terminal_size((100, 24)).columns))


@command(click.argument("name", required=False, shell_complete=complete_pipelines))
def pipelines(settings: Settings, name: str | None) -> None:
    """Show every pipeline with its stages and edges; with NAME, what it takes: its inputs, each
    stage's parameters (types, limits, defaults), its edges and outputs."""
    document = settings.client().pipeline(name) if name is not None else settings.client().pipelines()
    if settings.json:
        _print_json(document)
    elif name is not None:
        click.echo(render.pipeline_detail(document))
    else:
        click.echo(render.pipelines_text(document.get("pipelines") or []))


@command(
    click.option("--wait", "wait", is_flag=True, help="Wait until every stage takes jobs (or --timeout)."),
    click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True, metavar="SECONDS",
                 help="With --wait: how long to wait."),
)
def health(settings: Settings, wait: bool, timeout: float) -> None:
    """Exit 0 when every stage takes jobs (ready, degraded: some replicas down, or sleeping: it wakes
    for its next job), else 1 and name the stages that do not. --wait: until they do; a daemon
    still starting (its socket not there yet) is waited for too."""
    client = settings.client()
    deadline = time.monotonic() + timeout
    while True:
        try:
            ok, body = client.ready()
        except DaemonUnreachable:
            if not wait or time.monotonic() >= deadline:
                raise
        else:
            if ok or not wait or time.monotonic() >= deadline:
                break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if settings.json:
        _print_json(body)
    else:
        click.echo(render.ready_text(ok, body))
    raise click.exceptions.Exit(int(ExitCode.OK if ok else ExitCode.JOB_FAILED))


@cli.group()
def key() -> None:
    """API keys for the TCP listener (daemon.listen); root or the daemon's admin group."""


@key.command("add")
@click.argument("name")
@click.option("--uid", type=click.IntRange(0), help="The user the key acts as: its jobs are that uid's "
              "(default: yours; root must give it).")
@click.option("--admin", is_flag=True, help="The key may do the admin actions over TCP (restart, sleep, wake "
              "a stage, reload, logs, others' jobs).")
@click.option("--max-jobs", type=click.IntRange(1), metavar="N", help="At most N of its jobs live at once "
              "(past it: 429).")
@click.option("--rps", type=click.FloatRange(0.001), metavar="R", help="At most R requests per second "
              "(past it: 429 with Retry-After).")
@json_option
@pass_settings
def key_add(settings: Settings, name: str, uid: int | None, admin: bool, max_jobs: int | None,
            rps: float | None) -> None:
    """Make a key NAME and print it, once, on the last line (it is stored hashed; it cannot be shown again)."""
    answer = settings.client().add_key(name, uid, max_jobs, rps, admin)
    if settings.json:
        _print_json(answer)
        return
    click.echo(render.key_added(answer))
    click.echo(str(answer.get("key")))


@key.command("list")
@json_option
@pass_settings
def key_list(settings: Settings) -> None:
    """The keys: name, uid, limits, when made, and their first characters (never the keys)."""
    document = settings.client().keys()
    if settings.json:
        _print_json(document)
    else:
        click.echo(render.keys_table(document.get("keys") or [], time.time()))


@key.command("rm")
@click.argument("name")
@json_option
@pass_settings
def key_rm(settings: Settings, name: str) -> None:
    """Remove the key NAME: its next request gets 401 (its jobs stay its uid's)."""
    answer = settings.client().remove_key(name)
    if settings.json:
        _print_json(answer)
    else:
        click.echo(f"removed key {name}")


@cli.group()
def adapter() -> None:
    """A stage's LoRA adapters at run time (its lora table); add and rm: root or the daemon's admin group."""


@adapter.command("list")
@click.argument("stage", shell_complete=complete_stages)
@json_option
@pass_settings
def adapter_list(settings: Settings, stage: str) -> None:
    """The adapters of STAGE, their folders, and the base model they adapt."""
    document = settings.client().adapters(stage)
    if settings.json:
        _print_json(document)
    else:
        click.echo(render.adapters_table(document))


@adapter.command("add")
@click.argument("stage", shell_complete=complete_stages)
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, file_okay=True, dir_okay=True, resolve_path=True))
@json_option
@pass_settings
def adapter_add(settings: Settings, stage: str, name: str, path: str) -> None:
    """Add the LoRA adapter in folder PATH to STAGE as NAME: jobs may name it at once (`adapter`, or the
    OpenAI model PIPELINE:NAME); the jobs running keep going."""
    answer = settings.client().add_adapter(stage, name, path)
    if settings.json:
        _print_json(answer)
    else:
        click.echo(f"added adapter {name} to {stage} (rank {answer.get('rank')})")


@adapter.command("rm")
@click.argument("stage", shell_complete=complete_stages)
@click.argument("name")
@json_option
@pass_settings
def adapter_rm(settings: Settings, stage: str, name: str) -> None:
    """Remove adapter NAME from STAGE: new jobs may no longer name it; running ones finish with it."""
    answer = settings.client().remove_adapter(stage, name)
    if settings.json:
        _print_json(answer)
    else:
        click.echo(f"removed adapter {name} from {stage}")


@command()
def reload(settings: Settings) -> None:
    """Read the daemon's config file again and apply it, as SIGHUP does (root, the admin group, or
    an --admin key); exit 1 when it was refused."""
    answer = settings.client().reload()
    if settings.json:
        _print_json(answer)
    else:
        click.echo(str(answer.get("status")))
    if not answer.get("reloaded"):
        raise SystemExit(1)


@command()
def metrics(settings: Settings) -> None:
    """Print the daemon's Prometheus metrics (--json: {name: [{labels, value}]})."""
    text = settings.client().metrics()
    if settings.json:
        _print_json(parse_prometheus(text))
    else:
        click.echo(text, nl=not text.endswith("\n"))


@command(
    click.argument("stage", metavar="[STAGE]", required=False, shell_complete=complete_stages),
    click.option("-f", "--follow", is_flag=True, help="Keep printing new lines as they come, until interrupted."),
    click.option("--since", metavar="T", help="Only lines since T: a duration ago (30s, 10m, 1h, 2d), "
                 "an ISO 8601 time or a Unix time."),
    click.option("-n", "--tail", type=click.IntRange(0, 100000), metavar="N", help="Only the last N lines."),
    click.option("-t", "--timestamps", is_flag=True, help="Prefix each line with the UTC time the daemon read it."),
    click.option("-r", "--replica", type=click.IntRange(0), metavar="N", help="Replica N of a stage that has "
                 "several (default: 0)."),
)
def logs(settings: Settings, stage: str | None, follow: bool, since: str | None, tail: int | None,
         timestamps: bool, replica: int | None) -> None:
    """Print what STAGE's worker wrote to stdout and stderr (without STAGE: the daemon's own records);
    root or the daemon's admin group. --json: one {"ts", "line"} object per line."""
    if replica is not None and stage is None:
        _fail("--replica needs a STAGE", ExitCode.USAGE)
    for line in settings.client().logs(stage, since=since, tail=tail, follow=follow, replica=replica):
        ts, _, text = line.partition(" ")
        if settings.json:
            _print_json_line({"ts": ts, "line": text})
        else:
            click.echo(line if timestamps else text)


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
        _fail(str(e), ExitCode.REFUSED)
    raise click.exceptions.Exit(code)


@command()
def version(settings: Settings) -> None:
    """Print omnictl's version and the daemon's; exit 3 (after omnictl's) if the daemon is unreachable."""
    mine = client_version()
    try:
        theirs: Any = settings.client().health().get("version")
    except DaemonUnreachable as exc:
        if settings.json:
            _print_json({"client": mine, "daemon": None})
        else:
            click.echo(f"client  {mine}")
        _fail(str(exc), ExitCode.UNREACHABLE)
    if settings.json:
        _print_json({"client": mine, "daemon": theirs})
    else:
        click.echo(f"client  {mine}\ndaemon  {theirs}")


@cli.command()
@click.argument("shell", type=click.Choice(COMPLETION_SHELLS))
@pass_settings
def completion(settings: Settings, shell: str) -> None:
    """Print the SHELL completion script: commands, options, and pipeline, stage and job names
    asked of the daemon. Bash: eval "$(omnictl completion bash)" (or put it in ~/.bashrc);
    zsh: eval "$(omnictl completion zsh)"; fish: omnictl completion fish | source."""
    if settings.json:
        raise click.UsageError("`completion` prints a shell script; --json does not apply to it")
    completer = get_completion_class(shell)
    assert completer is not None  # every name in COMPLETION_SHELLS is one of click's
    click.echo(completer(cli, {}, "omnictl", COMPLETE_VAR).source())


def main() -> None:
    """The console-script entry point."""
    cli(prog_name="omnictl")


if __name__ == "__main__":  # pragma: no cover
    main()
