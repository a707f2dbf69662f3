"""``omnictl``'s commands for the daemon as a whole: ``key add|list|rm`` (the TCP listener's API
keys), ``reload`` (its config read again), ``metrics`` and ``version``.

Runs in the omnictl process's main thread; blocks on the daemon's socket. cli.py adds these to
``omnictl``'s group (``COMMANDS``).
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

import click

from omnictl import render
from omnictl.cli_base import ExitCode, Settings, command, fail, json_option, pass_settings, print_json
from omnictl.client import DaemonUnreachable, parse_prometheus


def client_version() -> str:
    """omnictl's own version (the installed ``omnid`` distribution's)."""
    try:
        return importlib.metadata.version("omnid")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@click.group()
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
        print_json(answer)
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
        print_json(document)
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
        print_json(answer)
    else:
        click.echo(f"removed key {name}")


@command()
def reload(settings: Settings) -> None:
    """Read the daemon's config file again and apply it, as SIGHUP does (root, the admin group, or
    an --admin key); exit 4 when it was refused (the daemon's status line is printed), as for any refusal."""
    answer = settings.client().reload()
    if settings.json:
        print_json(answer)
    elif answer.get("reloaded"):
        click.echo(str(answer.get("status")))
    if not answer.get("reloaded"):
        if settings.json:
            raise click.exceptions.Exit(int(ExitCode.REFUSED))
        fail(str(answer.get("status")), ExitCode.REFUSED)


@command()
def metrics(settings: Settings) -> None:
    """Print the daemon's Prometheus metrics (--json: {name: [{labels, value}]})."""
    text = settings.client().metrics()
    if settings.json:
        print_json(parse_prometheus(text))
    else:
        click.echo(text, nl=not text.endswith("\n"))


@command()
def version(settings: Settings) -> None:
    """Print omnictl's version and the daemon's; exit 3 (after omnictl's) if the daemon is unreachable."""
    mine = client_version()
    try:
        theirs: Any = settings.client().health().get("version")
    except DaemonUnreachable as exc:
        if settings.json:
            print_json({"client": mine, "daemon": None})
        else:
            click.echo(f"client  {mine}")
        fail(str(exc), ExitCode.UNREACHABLE)
    if settings.json:
        print_json({"client": mine, "daemon": theirs})
    else:
        click.echo(f"client  {mine}\ndaemon  {theirs}")


COMMANDS: tuple[click.Command, ...] = (key, reload, metrics, version)
