"""The `tokq` command: a thin click group; each subcommand lives beside the code it runs and
is imported only when called (so `tokq embed` does not pay for importing torch)."""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click.Command
COMMANDS = {
    "up": "tokq.up:up_command",
    "gateway": "tokq.gateway.cli:gateway_command",
    "worker": "tokq.workers.cli:worker_command",
    "embed": "tokq.client_cli:embed_command",
    "profile": "tokq.profiling.profile.cli:profile_command",
    "bench": "tokq.profiling.bench.service.cli:bench_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tokq")
def main() -> None:
    """tokq: token-count batching for embedding inference over Redis."""


if __name__ == "__main__":
    main()
