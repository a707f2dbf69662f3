"""The ``omnictl`` command line: click parses arguments and formats results, nothing more.

Where it runs: in the omnictl process's main thread, one command per process. It blocks on the
daemon's socket through :class:`omnictl.client.Client` (30 s per request; without limit while
following a job's events) and on writing output files. This module is the ``omnictl`` group (its
global options, the exit codes of every command, shell completion); the commands live in
``job_commands.py``, ``stage_commands.py`` and ``daemon_commands.py``, made with ``cli_base.py``;
the requests in ``client.py``, the formatting in ``render.py``.

Exit codes (the public contract): 0 success; 1 the job ended failed, cancelled or timed out (or a
local file could not be written); 2 usage error; 3 daemon unreachable; 4 the daemon refused the
request, its message printed to stderr as ``omnictl: <message> (<code>)``; 130 interrupted.
"""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import get_completion_class

from omnictl import daemon_commands, job_commands, stage_commands
from omnictl.cli_base import ExitCode, Settings, fail, pass_settings
from omnictl.client import ApiError, ClientError, DaemonUnreachable
from omnictl.daemon_commands import client_version
from omnictl.job_commands import parse_param_value

__all__ = ["cli", "client_version", "main", "parse_param_value"]

COMPLETION_SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_OMNICTL_COMPLETE"     # click's shell-completion protocol variable for prog "omnictl"


class OmnictlGroup(click.Group):
    """Maps the client's exceptions to the documented exit codes, in one place for every command."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as exc:
            # a refusal that passes by itself (429, 503, 507): when to try again, as its Retry-After says
            wait = f" (try again in {exc.retry_after} s)" if exc.retry_after and "try again in" not in exc.message else ""
            fail(f"{_refusal(exc)}{wait}", ExitCode.REFUSED)
        except DaemonUnreachable as exc:
            fail(str(exc), ExitCode.UNREACHABLE)
        except ClientError as exc:
            # The daemon answered, but not with the API (a bug on one side); it did not do the work.
            fail(str(exc), ExitCode.REFUSED)
        except KeyboardInterrupt:
            # A verb that leaves a job running says so itself (submit --wait, watch); the rest
            # changed nothing that goes on without them.
            fail("interrupted", ExitCode.INTERRUPTED)
        except BrokenPipeError:
            raise  # stdout went away (`| head`); click's main exits quietly
        except OSError as exc:
            # Requests never raise OSError (the client wraps them); this is a local file we wrote or read.
            where = f": {exc.filename}" if exc.filename else ""
            fail(f"{exc.strerror or exc}{where}", ExitCode.JOB_FAILED)


def _refusal(exc: ApiError) -> str:
    """A refusal as a user reads it: its message and code; a request wrong in several places (the
    error's `problems`), one line each."""
    error = exc.body.get("error") if isinstance(exc.body, dict) else None
    problems = error.get("problems") if isinstance(error, dict) else None
    if isinstance(problems, list) and len(problems) > 1 and all(isinstance(p, dict) for p in problems):
        lines = "".join(f"\n  - {p.get('message')} ({p.get('code')})" for p in problems)
        return f"the request has {len(problems)} problems:{lines}"
    return f"{exc.message} ({exc.code})"


# --- the group: every command, from its module ----------------------------------------------------


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


for _command in (*job_commands.COMMANDS, *stage_commands.COMMANDS, *daemon_commands.COMMANDS):
    cli.add_command(_command)


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
