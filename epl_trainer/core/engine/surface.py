"""A parallelism folder's surface: the names other modules may import from it.

Each folder of the engine (`zero/`, `pipeline/`, `split/`, `precision/`, `update/`) lists
its surface in its `__init__` as `name -> module of the folder`. The names load on first
use, so importing a folder's surface costs nothing until a name is read, and a folder
that reads another's surface while that one reads back (the engine state and ZeRO's
gathered parameters) does not form an import-time cycle. `tests/test_architecture.py`
reads the same tables: a module outside a folder imports only its surface.
"""

from __future__ import annotations

import importlib


def lazy_surface(package: str, surface: dict[str, str]):
    """`(__getattr__, __dir__, __all__)` for a folder `package` exporting `surface`."""

    def __getattr__(name: str):
        module = surface.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__():
        return sorted(surface)

    return __getattr__, __dir__, sorted(surface)
