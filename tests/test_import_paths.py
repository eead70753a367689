"""Every name the README and the docs import resolves, and each module has one import path:
the package answers no old path (`epl_trainer.trainer` is `epl_trainer.training.trainer`)."""

import importlib
import pathlib
import re
import sys

import pytest

import epl_trainer as epl

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
FROM_IMPORT = re.compile(r"^\s*from (epl_trainer[\w.]*) import \(?([\w, \n]+?)\)?$", re.M)
IMPORT = re.compile(r"^\s*import (epl_trainer[\w.]*)", re.M)
EPL_NAME = re.compile(r"\bepl\.([A-Za-z_]\w*)")


def documented_imports() -> set[tuple[str, str | None]]:
    """(module, name or None) of every epl_trainer import in the pages' python blocks."""
    found = set()
    for page in PAGES:
        for block in CODE_BLOCK.findall(page.read_text()):
            for module, names in FROM_IMPORT.findall(block):
                for name in re.split(r"[,\s]+", names):
                    if name and name != "as":
                        found.add((module, name))
            found |= {(module, None) for module in IMPORT.findall(block)}
            if "import epl_trainer as epl" in block:
                found |= {("epl_trainer", name) for name in EPL_NAME.findall(block)}
    return found


def test_the_pages_import_something():
    assert len(documented_imports()) >= 5


@pytest.mark.parametrize("module, name", sorted(documented_imports(), key=str))
def test_every_documented_name_imports(module, name):
    imported = importlib.import_module(module)
    if name is not None:
        # `from package import module` is a submodule import, also fine.
        assert hasattr(imported, name) or importlib.import_module(f"{module}.{name}")


def test_the_lobby_names_resolve():
    for name in epl.__all__:
        assert getattr(epl, name) is not None


def test_a_module_has_one_import_path():
    # Old paths from before the regrouping (`epl_trainer.trainer`, `epl_trainer.flags`) are
    # not found: the package installs no import hook that would answer them.
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("epl_trainer")]
    for old in ("epl_trainer.trainer", "epl_trainer.flags", "epl_trainer.core.engine.amp"):
        with pytest.raises(ModuleNotFoundError, match=old):
            importlib.import_module(old)


def test_the_io_and_layers_attributes_are_their_modules():
    assert epl.io is importlib.import_module("epl_trainer.training.io")
    assert epl.layers is importlib.import_module("epl_trainer.layers")
