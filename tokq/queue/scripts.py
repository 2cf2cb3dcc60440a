"""The queue's Lua scripts: one ``.lua`` file per operation, loaded from package ``tokq.lua``, with
``--#include lib/<name>.lua`` lines expanded so shared logic exists once. Scripts run by EVALSHA,
and by EVAL on NOSCRIPT, so a Redis restart or SCRIPT FLUSH needs no code elsewhere.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

LUA_PACKAGE = "tokq.lua"
_INCLUDE = re.compile(r"^--#include (lib/[A-Za-z0-9_]+\.lua)$", re.MULTILINE)


def script_names() -> tuple[str, ...]:
    """Every operation script shipped in ``tokq.lua`` (file names without ``.lua``)."""
    root = resources.files(LUA_PACKAGE)
    return tuple(sorted(p.name[:-4] for p in root.iterdir() if p.name.endswith(".lua")))


@cache
def script_source(name: str) -> str:
    """The text sent to Redis for one operation, its ``--#include`` lines expanded."""
    root = resources.files(LUA_PACKAGE)
    text = root.joinpath(f"{name}.lua").read_text(encoding="utf-8")

    def include(match: re.Match) -> str:
        return root.joinpath(match.group(1)).read_text(encoding="utf-8").rstrip("\n")

    return _INCLUDE.sub(include, text)


class Scripts:
    """All queue scripts registered on one client; ``calls`` counts runs per script."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._scripts = {name: client.register_script(script_source(name))
                         for name in script_names()}
        self.calls: Counter[str] = Counter()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._scripts)

    def sha(self, name: str) -> str:
        """The script's SHA1, what EVALSHA names it by."""
        return self._scripts[name].sha

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.calls[name] += 1
        script = self._scripts[name]
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            # EVAL runs it on its keys' node and caches it there; redis-py's SCRIPT LOAD goes to
            # every primary of a cluster, and fails while any one is down.
            return await self._client.eval(script.script, len(keys), *keys, *args)
