"""The pages and sections the package's docstrings and comments cite exist.

Measurements behind a rule live in docs/benchmarks.md, and the docstring that states the
rule links the section (`docs/benchmarks.md#trace-cost`); a renamed heading must not leave
the link pointing nowhere.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A section of one of our pages; a bare `docs/x.md` may be another project's (EPL's).
CITED = re.compile(r"\bdocs/([\w./-]+\.md)#([\w-]+)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: pathlib.Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def citations() -> list[tuple[str, str, str]]:
    """(source file, page, anchor) of every `docs/<page>.md#<anchor>` in epl_trainer/."""
    found = []
    for source in sorted((ROOT / "epl_trainer").rglob("*.py")):
        for page, anchor in CITED.findall(source.read_text()):
            found.append((str(source.relative_to(ROOT)), page, anchor))
    return found


def test_the_package_cites_benchmark_sections():
    assert any(page == "benchmarks.md" for _, page, _ in citations())


def test_slug_matches_mkdocs():
    assert slug("Deleting tf.data iterators") == "deleting-tfdata-iterators"
    assert slug("XLA: the whole step, each lane, or each stage") == (
        "xla-the-whole-step-each-lane-or-each-stage"
    )


@pytest.mark.parametrize("source, page, anchor", citations())
def test_a_cited_section_exists(source, page, anchor):
    path = ROOT / "docs" / page
    assert path.is_file(), f"{source} cites docs/{page}, which does not exist"
    assert anchor in anchors(path), (
        f"{source} cites docs/{page}#{anchor}, a heading that page does not have. "
        f"Received anchors: {sorted(anchors(path))}"
    )
