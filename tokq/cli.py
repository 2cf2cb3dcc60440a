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
    "embed-file": "tokq.bulk.cli:embed_file_command",
    "rerank": "tokq.client_cli:rerank_command",
    "profile": "tokq.profiling.profile.cli:profile_command",
    "bench": "tokq.profiling.bench.cli:bench_group",
}


class LazyGroup(click.Group):
    """A group whose subcommands are named as "module:attribute" and imported when called."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = COMMANDS if lazy is None else lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return None
        module, attr = self.lazy[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tokq")
def main() -> None:
    """tokq: token-count batching for embedding inference over Redis."""
    from tokq.config import warn_unknown_env

    warn_unknown_env()


if __name__ == "__main__":
    main()
