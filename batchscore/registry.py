"""`Registry`: named variants (engine kinds, wire formats, tasks) that register themselves from their own
modules; the built-in modules are imported on first use.

Listed in one fixed order whichever module happened to be imported first: the built-in entries in
the order of their modules in `built_in`, then the others in the order they registered. The
order matters: it is the order of a job file's allowed values, of the schema's enums and of
what `auto` tries on a tie. Standard library only, so every folder may import it.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by their `name`; `module_of(entry)` names the module that defined it (an entry of
    a module in `built_in` is a built-in one)."""

    def __init__(self, built_in: tuple[str, ...], module_of: Callable[[T], str]):
        self.built_in = built_in
        self._module_of = module_of
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, entry: T) -> T:
        """Add (or replace) `entry`; returns it."""
        self._entries[entry.name] = entry  # type: ignore[attr-defined]
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def entries(self) -> dict[str, T]:
        """Every entry by name: the built-in ones first, in `built_in`'s order, then the others in
        the order they registered."""
        if not self._loaded:
            self._loaded = True
            for module in self.built_in:
                importlib.import_module(module)

        def rank(item: tuple[int, T]) -> tuple[int, int]:
            module = self._module_of(item[1])
            return (self.built_in.index(module) if module in self.built_in else len(self.built_in), item[0])

        return {entry.name: entry for _, entry in sorted(enumerate(self._entries.values()), key=rank)}  # type: ignore[attr-defined]

    def get(self, name: str) -> T | None:
        return self.entries().get(name)
