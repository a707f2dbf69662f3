"""``omnictl``'s stage commands: ``stages``, ``stage restart|sleep|wake``, ``adapter list|add|rm`` (a
stage's LoRA adapters), ``pipelines``, ``health`` (whether every stage takes jobs) and ``logs``.

Runs in the omnictl process's main thread; blocks on the daemon's socket (polling ``GET /v1/stages``
while a restarted or woken stage comes up; without limit while following logs). cli.py adds these to
``omnictl``'s group (``COMMANDS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import click

from omnictl import render
from omnictl.cli_base import (
    ExitCode,
    Settings,
    command,
    complete_pipelines,
    complete_stages,
    fail,
    json_option,
    pass_settings,
    print_json,
    print_json_line,
)
from omnictl.client import Client, DaemonUnreachable
from omnid.vocabulary import WorkerState


@command()
def stages(settings: Settings) -> None:
    """Show every stage: state, process, devices, queue, work done and health."""
    document = settings.client().stages()
    if settings.json:
        print_json(document)
    else:
        click.echo(render.stages_table(document.get("stages") or []))
        if document.get("realtime"):
            click.echo("\nreal-time pipelines (capacity measured from the stages' own step times):")
            click.echo(render.realtime_table(document["realtime"]))


@click.group()
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
            print_json(answer)
        else:
            click.echo(f"{name}: restarting")
        return

    def replaced(snap: Mapping[str, Any]) -> bool:     # ready, every replica a new process
        pids = _replica_pids(snap)
        return snap.get("state") in (WorkerState.READY, WorkerState.BUSY) and bool(pids) and None not in pids \
            and not old_pids & set(pids)

    snap = _wait_for_stage(settings, client, name, timeout, "not ready in time", done=replaced,
                           failed=(WorkerState.FAILED,))
    if settings.json:
        print_json(snap)
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
                print_json(snap)
            click.echo(f"omnictl: {name}: {state or 'gone'}: {snap.get('last_error') or late}", err=True)
            raise click.exceptions.Exit(int(ExitCode.JOB_FAILED))
        time.sleep(0.2)


def _replica_pids(snap: Mapping[str, Any]) -> list[Any]:
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
        print_json(answer)
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
            print_json(answer)
        else:
            click.echo(f"{name}: {'awake already' if answer.get('already') else 'waking'}")
        return
    # `sleeping` again: the wake failed (`starting` while it runs)
    snap = _wait_for_stage(settings, client, name, timeout, "not awake in time",
                           done=lambda snap: snap.get("state") in (WorkerState.READY, WorkerState.BUSY,
                                                                   WorkerState.DEGRADED),
                           failed=(WorkerState.FAILED, WorkerState.SLEEPING))
    if settings.json:
        print_json(snap)
    else:
        click.echo(f"{name}: {snap.get('state')} (woke in {snap.get('wake_s')} s)")


@command(click.argument("name", required=False, shell_complete=complete_pipelines))
def pipelines(settings: Settings, name: str | None) -> None:
    """Show every pipeline with its stages and edges; with NAME, what it takes: its inputs, each
    stage's parameters (types, limits, defaults), its edges and outputs."""
    document = settings.client().pipeline(name) if name is not None else settings.client().pipelines()
    if settings.json:
        print_json(document)
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
        print_json(body)
    else:
        click.echo(render.ready_text(ok, body))
    raise click.exceptions.Exit(int(ExitCode.OK if ok else ExitCode.JOB_FAILED))


@click.group()
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
        print_json(document)
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
        print_json(answer)
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
        print_json(answer)
    else:
        click.echo(f"removed adapter {name} from {stage}")


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
        fail("--replica needs a STAGE", ExitCode.USAGE)
    for line in settings.client().logs(stage, since=since, tail=tail, follow=follow, replica=replica):
        ts, _, text = line.partition(" ")
        if settings.json:
            print_json_line({"ts": ts, "line": text})
        else:
            click.echo(line if timestamps else text)


COMMANDS: tuple[click.Command, ...] = (stages, stage, pipelines, health, adapter, logs)
