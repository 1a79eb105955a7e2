"""``import mooncake.store`` served by kvpool: the connectors GPU users already run on Mooncake Store
(vLLM's ``MooncakeStoreConnector``, SGLang's HiCache ``MooncakeStore``, LMCache's
``mooncakestore://`` connector) run unchanged on a kvpool pool.

**Never active unless asked.** Turn it on for an environment::

    python -m kvpool.mooncake_alias install              # kvpool's store wins over a real Mooncake
    python -m kvpool.mooncake_alias install --prefer mooncake   # a real Mooncake wins where installed
    python -m kvpool.mooncake_alias status
    python -m kvpool.mooncake_alias uninstall

``install`` writes ``kvpool-mooncake-alias.pth`` into the interpreter's ``site-packages`` (or
``--site DIR``): every interpreter of that environment, and every process it starts (vLLM's
engine cores, SGLang's schedulers), starts with the alias. In one program instead:
``kvpool.mooncake_alias.activate()``. ``KVPOOL_MOONCAKE_ALIAS`` in the environment overrides an
installed choice per process: ``off`` (the alias does nothing), ``kvpool`` or ``mooncake``.

**What it serves**: ``mooncake.store`` is :mod:`kvpool.mooncake` (``MooncakeDistributedStore``,
``ReplicateConfig``, ``ReplicaDescriptor``, ``ObjectDataType``, ``MooncakeHostMemAllocator``,
``BufferHandle``, ... and the module-level ``bind_to_numa_node``), and ``mooncake`` is a package
holding it when no real Mooncake is installed.

**Precedence when the real Mooncake is installed too**:

- ``--prefer kvpool`` (the default): ``mooncake.store`` is kvpool's; the ``mooncake`` package and
  its other modules (``mooncake.engine``, ``mooncake.allocator``, ...) stay Mooncake's, so code
  that also uses Mooncake's transfer engine keeps it.
- ``--prefer mooncake``: Mooncake's own modules win; the alias serves ``mooncake`` and
  ``mooncake.store`` only where Mooncake does not provide them.
- Either way a process that imported ``mooncake.store`` before the alias was activated keeps
  the module it has (Python caches imports): activate first.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from kvpool._mooncake_alias import CHOICES, ENV, PTH_NAME, _real_spec, activate, active, deactivate

__all__ = ["activate", "active", "deactivate", "install", "uninstall", "status", "main"]


def _site(explicit: Optional[str]) -> Path:
    return Path(explicit) if explicit else Path(sysconfig.get_paths()["purelib"])


def install(prefer: str = "kvpool", site: Optional[str] = None) -> Path:
    """Write the ``.pth`` that activates the alias at every interpreter start."""
    if prefer not in CHOICES:
        raise ValueError(f"prefer must be kvpool or mooncake, not {prefer!r}")
    path = _site(site) / PTH_NAME
    path.write_text(
        "# kvpool's alias of Mooncake Store (python -m kvpool.mooncake_alias uninstall removes it)\n"
        f"import kvpool._mooncake_alias as _kvpool_alias; _kvpool_alias.activate({prefer!r})\n"
    )
    return path


def uninstall(site: Optional[str] = None) -> bool:
    path = _site(site) / PTH_NAME
    if path.exists():
        path.unlink()
        return True
    return False


def status(site: Optional[str] = None) -> str:
    path = _site(site) / PTH_NAME
    installed = "installed" if path.exists() else "not installed"
    real = _real_spec("mooncake", None) is not None
    return (f"{installed} ({path}); active in this process: {active() or 'no'}; "
            f"{ENV}={os.environ.get(ENV, '(unset)')}; a real Mooncake is {'' if real else 'not '}installed")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.mooncake_alias", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="activate the alias at every start of this environment's interpreters")
    i.add_argument("--prefer", choices=CHOICES, default="kvpool")
    i.add_argument("--site", help="site-packages directory (default: this interpreter's)")
    for name in ("uninstall", "status"):
        sub.add_parser(name).add_argument("--site")
    args = p.parse_args(argv)
    if args.cmd == "install":
        print(f"installed: {install(args.prefer, args.site)} (prefer {args.prefer})")
    elif args.cmd == "uninstall":
        print("removed" if uninstall(args.site) else "was not installed")
    else:
        print(status(args.site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
