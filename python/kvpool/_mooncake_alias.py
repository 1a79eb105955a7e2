"""The finder behind :mod:`kvpool.mooncake_alias` (imported by its ``.pth`` at interpreter start:
kept small, it imports nothing of kvpool's until ``mooncake.store`` is imported)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Optional, Sequence

PTH_NAME = "kvpool-mooncake-alias.pth"
ENV = "KVPOOL_MOONCAKE_ALIAS"
CHOICES = ("kvpool", "mooncake")


def _real_spec(name: str, path: Optional[Sequence[str]]) -> Optional[importlib.machinery.ModuleSpec]:
    """What the finders other than this alias would find for ``name``."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except (ImportError, AttributeError, ValueError):
            spec = None
        if spec is not None:
            return spec
    return None


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "mooncake":
            module.__path__ = []  # a package: its submodules are looked up through sys.meta_path
            module.__doc__ = "kvpool's stand-in for Mooncake's package (kvpool.mooncake_alias)."
            return
        store = importlib.import_module("kvpool.mooncake")
        for name in getattr(store, "__all__", []) or [n for n in dir(store) if not n.startswith("_")]:
            setattr(module, name, getattr(store, name))
        for name in dir(store):
            if not name.startswith("_") and not hasattr(module, name):
                setattr(module, name, getattr(store, name))
        if not hasattr(module, "bind_to_numa_node"):
            # SGLang imports it from the module: a kvpool client has no segment to place.
            module.bind_to_numa_node = _bind_to_numa_node  # type: ignore[attr-defined]
        module.__doc__ = "Mooncake Store's API served by kvpool (kvpool.mooncake, via kvpool.mooncake_alias)."
        module.__kvpool__ = True  # type: ignore[attr-defined]


def _bind_to_numa_node(*_: Any, **__: Any) -> int:
    """Mooncake binds the calling thread's allocations to a NUMA node; kvpool's client memory is
    the process's own, so there is nothing to bind: 0 (success), as Mooncake answers."""
    return 0


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, prefer: str) -> None:
        self.prefer = prefer

    def find_spec(self, name: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name not in ("mooncake", "mooncake.store"):
            return None
        if name == "mooncake" and _real_spec(name, path) is not None:
            return None  # Mooncake's own package (and its other modules) stay
        if self.prefer == "mooncake" and _real_spec(name, path) is not None:
            return None
        return importlib.util.spec_from_loader(name, _Loader(), is_package=name == "mooncake")


def active() -> Optional[str]:
    """The preference of the alias active in this process, or None."""
    f = next((x for x in sys.meta_path if isinstance(x, _Finder)), None)
    return f.prefer if f is not None else None


def activate(prefer: str = "kvpool") -> Optional[str]:
    """Serve ``mooncake.store`` from kvpool in this process (see the module docs); the
    environment's ``KVPOOL_MOONCAKE_ALIAS`` wins. Returns the preference in force (None: off)."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("off", "0", "false", "no"):
        deactivate()
        return None
    if env in CHOICES:
        prefer = env
    elif env:
        raise ValueError(f"{ENV} must be off, kvpool or mooncake, not {env!r}")
    if prefer not in CHOICES:
        raise ValueError(f"prefer must be kvpool or mooncake, not {prefer!r}")
    deactivate()
    finder = _Finder(prefer)
    # First, to serve mooncake.store before a real Mooncake's; last, to serve it only where
    # no real Mooncake does.
    if prefer == "kvpool":
        sys.meta_path.insert(0, finder)
    else:
        sys.meta_path.append(finder)
    return prefer


def deactivate() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
