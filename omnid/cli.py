"""`omnid`: run the daemon in the foreground, or check a configuration; `omnid config-schema` prints
the JSON Schema of the configuration file (for editors: taplo, Even Better TOML).

Runs in the supervisor process's main thread. `main()` parses the command
line; `omnid.supervisor.daemon.run()` is the library call tests use.
Exit status: 0 stopped cleanly or config OK; 1 could not start; 2 invalid config.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from omnid import __version__, paths
from omnid.config import ConfigError, load


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              envvar="OMNID_CONFIG", help="The daemon's TOML file (default: /etc/omnid/omnid.toml for root, "
              "$XDG_CONFIG_HOME/omnid/omnid.toml otherwise).")
@click.option("--check", is_flag=True, help="Validate the configuration, print every problem, and exit "
              "(0 valid, 2 invalid).")
@click.version_option(__version__, prog_name="omnid")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None, check: bool) -> None:
    """Serve multi-stage inference pipelines on warm stage workers."""
    if ctx.invoked_subcommand is not None:
        return
    path = config_path or paths.defaults().config
    try:
        config = load(path)
    except ConfigError as e:
        click.echo(f"omnid: invalid configuration {e.source}:", err=True)
        for p in e.problems:
            click.echo(f"  {p}", err=True)
        sys.exit(2)
    if check:
        n_st, n_pl = len(config.stages), len(config.pipelines)
        click.echo(f"{path}: OK ({n_st} stage{'s' * (n_st != 1)}, {n_pl} pipeline{'s' * (n_pl != 1)})")
        for name, pipeline in config.pipelines.items():
            click.echo(f"  {name}: " + ", ".join(f"{e.src} -> {e.dst}" for e in pipeline.edges) if pipeline.edges
                       else f"  {name}: {pipeline.stages[0]}")
        vllm_stages = [name for name, st in config.stages.items() if st.engine == "vllm"]
        if vllm_stages:
            from omnid.engines import vllm_compat  # (reads package metadata; imports no vLLM)
            click.echo(f"{vllm_compat.describe()} (stages {', '.join(vllm_stages)})")
        sys.exit(0)
    from omnid import logs
    from omnid.supervisor.daemon import run
    logs.configure(config.daemon.log_level, config.daemon.log_format)
    sys.exit(run(config))


@main.command("config-schema")
def config_schema() -> None:
    """Print the JSON Schema of the configuration file (the repo ships it as etc/omnid.schema.json)."""
    from omnid.config.schema import schema_text
    click.echo(schema_text(), nl=False)


if __name__ == "__main__":
    main()
