"""Public import paths survive the package's regrouping: every name the README and the docs
import, every module's old path (`epl_trainer.trainer`, `epl_trainer.flags`, ...), and
`python -m` on an old path."""

import importlib
import pathlib
import re
import subprocess
import sys

import pytest
from _launch import clean_env

import epl_trainer as epl
from epl_trainer import _moved

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


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_module_path_is_the_moved_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert importlib.import_module(new).__spec__.name == new  # its own spec, not the alias's


def test_the_lobby_names_resolve():
    for name in epl.__all__:
        assert getattr(epl, name) is not None


def test_python_dash_m_runs_an_old_path():
    result = subprocess.run(
        [sys.executable, "-m", "epl_trainer.launcher", "--help"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "epl-launch" in result.stdout
