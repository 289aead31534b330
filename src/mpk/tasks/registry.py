"""Finds task kinds: every folder under mpk/tasks with a task.py registers its kind on import."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path

from mpk.errors import GraphError
from mpk.tasks.base import TaskKind

_KINDS: dict[str, TaskKind] = {}
TASKS_DIR = Path(__file__).parent


def register(cls: type[TaskKind]) -> type[TaskKind]:
    """Class decorator: the kind's name must equal its folder's name."""
    folder = cls.__module__.split(".")[-2]
    if cls.name != folder:
        raise AssertionError(f"task kind {cls.name!r} lives in folder {folder!r}; names must match")
    _KINDS[cls.name] = cls()
    return cls


@cache
def _discover() -> None:
    for info in pkgutil.iter_modules([str(TASKS_DIR)]):
        if info.ispkg and (TASKS_DIR / info.name / "task.py").exists():
            importlib.import_module(f"mpk.tasks.{info.name}.task")


def all_kinds() -> dict[str, TaskKind]:
    _discover()
    return dict(sorted(_KINDS.items()))


def get_kind(name: str) -> TaskKind:
    kinds = all_kinds()
    if name not in kinds:
        raise GraphError(f"unknown task kind {name!r}; known kinds: {', '.join(kinds)}")
    return kinds[name]
