"""The README's features x modes table (tools/features_table.py) cannot go stale: it is
regenerated here from the tests' `combines` markers and `rules.REFUSALS`."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import features_table  # noqa: E402

from epl_trainer.core.plan import rules  # noqa: E402


def test_the_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert features_table.with_table(readme, features_table.render()) == readme, (
        "README.md's features table is stale: run python tools/features_table.py"
    )


def test_every_cell_is_tested_or_refused():
    table = features_table.render()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    unclaimed = [
        f"{row.split('|')[1].strip()} x {features_table.MODES[i]}"
        for row in rows[1:]
        for i, cell in enumerate(row.split("|")[2:-1])
        if cell.strip() == "—"
    ]
    assert unclaimed == []


def test_every_refusal_is_raised_somewhere():
    tree = ast.parse(pathlib.Path(rules.__file__).read_text())
    raised = {
        node.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and getattr(node.value, "id", "") == "REFUSALS"
        and isinstance(node.slice, ast.Constant)
    }
    assert set(rules.REFUSALS) == raised


def test_markers_make_cells_tested_and_bad_markers_are_refused(tmp_path):
    (tmp_path / "test_a.py").write_text(
        'import pytest\n\n@pytest.mark.combines("zero_v1+pipeline+amp")\ndef test_x():\n    pass\n'
    )
    pairs = features_table.tested_pairs(tmp_path)
    assert pairs[frozenset(("zero_v1", "pipeline"))] == ["test_a.py::test_x"]
    assert frozenset(("amp", "pipeline")) in pairs
    assert "| ZeRO v1 | — | — | tested |" in features_table.render(tmp_path)
    (tmp_path / "test_b.py").write_text(
        'import pytest\n\npytestmark = pytest.mark.combines("zero_v9+pipeline")\n'
    )
    with pytest.raises(ValueError, match="zero_v9"):
        features_table.tested_pairs(tmp_path)


def test_a_refusal_needing_a_third_feature_leaves_the_cell_tested(tmp_path):
    (tmp_path / "test_a.py").write_text(
        'import pytest\n\n@pytest.mark.combines("gradient_checkpoint+multi_worker")\n'
        "def test_x():\n    pass\n"
    )
    row = next(
        line
        for line in features_table.render(tmp_path).splitlines()
        if line.startswith("| gradient checkpointing")
    )
    assert "tested (refused with [" in row.split("|")[6]
