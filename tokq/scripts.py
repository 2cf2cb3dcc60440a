"""The queue's Lua scripts: loaded from package ``tokq.lua`` and registered with redis-py.

One ``.lua`` file per operation. A line ``--#include lib/<name>.lua`` is replaced by that
snippet, so logic shared by several scripts (writing a result, parsing an entry) exists once.
``register_script`` sends EVALSHA and reloads on NOSCRIPT, so a Redis restart or a SCRIPT
FLUSH needs no code here.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

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
        return await self._scripts[name](keys=keys, args=args)
