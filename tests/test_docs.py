"""The documentation (README.md, mkdocs.yml, docs/): the site builds with `mkdocs build
--strict`, and the pages' code blocks run as written.

What a fenced block's info string means:

- ```python: run. The blocks of one page run in order in one fresh Python process, like a
  doctest session: names a block defines are there for the later ones. So a page's first
  block calls `epl.init(...)`, as a user's program does before TensorFlow starts.
- ```bash: run with `bash -euo pipefail` at its place in the page's session (cheap
  commands: `epl-plan`, `epl-launch` of a small script, two workers started by hand).
- any language with `title="NAME"`: written to the file NAME in the session's directory
  for a later block (a `train.py` that an `epl-launch` block runs, a JSON config).
- ```console, ```text, ```yaml, ```json, ```toml, ```ini or no language: shown, not run
  (commands that install packages, train for minutes, or need two hosts, a GPU or Slurm).

Any other language fails `test_every_block_is_run_or_shown`, so a block is run or shown
on purpose, never skipped by accident. Each page runs in a fresh temporary directory that
holds a link to configs/ (the pages' commands are written for the repository root), with
the repository on PYTHONPATH and no EPL_* or TF_CONFIG variables.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import clean_env  # tests/ is on sys.path, as for _models

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

RUN = {"python", "bash"}
SHOWN = {"console", "text", "yaml", "json", "toml", "ini", ""}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
PAGE_TIMEOUT_SECONDS = 240


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path) -> list[dict]:
    """The fenced blocks of a page: language, title, source (dedented), first line."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].strip()
        body, i = [], i + 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        title = TITLE.search(info)
        found.append(
            {
                "language": info.split()[0].lower() if info else "",
                "title": title["title"] if title else None,
                "source": "\n".join(body) + "\n",
                "line": i - len(body) + 1,  # the first line of the body, 1-based
            }
        )
        i += 1
    return found


def session(page: Path) -> list[dict]:
    """The page's blocks that run or write a file, in page order."""
    steps = []
    for block in blocks(page):
        if block["title"]:
            steps.append({**block, "kind": "file"})
        elif block["language"] in RUN:
            steps.append({**block, "kind": block["language"]})
    return steps


RUN_PAGES = [page for page in pages() if any(s["kind"] != "file" for s in session(page))]

# Runs one page's session in its own process (argv[1]: the JSON of the page's blocks).
# Python blocks are compiled with the page's name and padded to their line in it, so a
# traceback points at the page's line; the page's code is put in linecache under that
# name, so `inspect.getsource` finds a block's functions (tf.function's autograph reads it).
DRIVER = r"""
import json, linecache, subprocess, sys, time
from pathlib import Path

page, steps = json.loads(Path(sys.argv[1]).read_text())
lines = []
for step in steps:
    if step["kind"] == "python":
        lines += ["\n"] * (step["line"] - 1 - len(lines)) + step["source"].splitlines(True)
linecache.cache[page] = (sum(map(len, lines)), None, lines, page)
namespace = {"__name__": "__main__"}
start = time.perf_counter()
for step in steps:
    where = f"{page}:{step['line']}"
    print(f"=== {where} ({step['kind']}) at {time.perf_counter() - start:.1f} s", flush=True)
    if step["kind"] == "file":
        Path(step["title"]).write_text(step["source"])
    elif step["kind"] == "bash":
        subprocess.run(["bash", "-euo", "pipefail", "-c", step["source"]], check=True)
    else:
        source = "\n" * (step["line"] - 1) + step["source"]
        exec(compile(source, page, "exec"), namespace)
    sys.stdout.flush()
"""


def page_env() -> dict:
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg")
    # The console scripts (epl-launch, epl-plan) of this interpreter's environment.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.mark.parametrize("page", RUN_PAGES, ids=name)
def test_page_runs(page, tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    steps_file = tmp_path / "steps.json"
    steps_file.write_text(json.dumps([name(page), session(page)]))
    start = time.perf_counter()
    # A session of its own: on a timeout the whole group goes, the workers a page's
    # bash block started included (a worker waiting for a peer in epl.init ignores SIGTERM).
    process = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(steps_file)],
        cwd=tmp_path,
        env=page_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=PAGE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{name(page)} ran over {PAGE_TIMEOUT_SECONDS} s:\n{stdout[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a block left running
            os.killpg(process.pid, signal.SIGKILL)
    seconds = time.perf_counter() - start
    ran = sum(s["kind"] != "file" for s in session(page))
    print(f"{name(page)}: {ran} blocks in {seconds:.1f} s")
    assert process.returncode == 0, f"{name(page)} failed:\n{stdout[-6000:]}\n{stderr[-6000:]}"


def test_every_block_is_run_or_shown():
    unknown = [
        f"{name(page)}:{block['line']} ```{block['language']}"
        for page in pages()
        for block in blocks(page)
        if not block["title"] and block["language"] not in RUN | SHOWN
    ]
    assert not unknown, (
        "Blocks neither run nor shown on purpose (use ```python / ```bash to run them, "
        f"```console / ```text to show them). Received: {unknown}"
    )
    counts = {
        kind: sum(s["kind"] == kind for page in pages() for s in session(page))
        for kind in ("python", "bash", "file")
    }
    print(f"blocks run: {counts['python']} python, {counts['bash']} bash; files: {counts['file']}")


def test_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "api" / "index.html").exists()


def test_python_blocks_are_ruff_formatted(tmp_path):
    """The blocks are formatted as the code is (line length 100), whether or not the
    installed ruff formats Markdown itself."""
    for page in pages():
        for block in blocks(page):
            if block["language"] == "python":
                stem = name(page).replace("/", "_").replace(".", "_")
                (tmp_path / f"{stem}_{block['line']}.py").write_text(block["source"])
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--line-length", "100", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_api_reference_lists_every_public_name():
    import epl_trainer

    api = (DOCS / "api.md").read_text()
    names = set(epl_trainer.__all__) - {"__version__", "io", "layers"}
    missing = sorted(n for n in names if f"::: epl_trainer.{n}\n" not in api)
    assert not missing, f"docs/api.md has no `::: epl_trainer.<name>` for {missing}"


# A file the pages name in backticks: a repository path, or a path inside epl_trainer/.
PATH = re.compile(
    r"`(?P<path>(?:epl_trainer|tests|bench|configs|model_zoo|examples|docs|core|\.ci)"
    r"/[\w./-]*\w)(?:::(?P<test>\w+))?"
)


FILE_SUFFIXES = {".py", ".md", ".json", ".yaml", ".yml", ".sh", ".txt", ".toml", ".tfrecord"}


def cited(path: str) -> tuple[Path | None, str | None]:
    """The file a cited path names, and the name it must define: `a/b.py::test_x` is a
    test, `a/b.NAME` (no file suffix) a name defined in a/b.py."""
    attribute = None
    if "." in Path(path).name and Path(path).suffix not in FILE_SUFFIXES:
        path, attribute = path.rsplit(".", 1)
        path += ".py"
    for candidate in (ROOT / path, ROOT / "epl_trainer" / path):
        if candidate.exists():
            return candidate, attribute
    return None, attribute


def test_named_files_exist():
    """Files and tests the pages cite exist (modules move; the pages must follow)."""
    stale = []
    for page in pages():
        for match in PATH.finditer(page.read_text()):
            found, attribute = cited(match["path"])
            name_defined = match["test"] or attribute
            if found is None or (name_defined and name_defined not in found.read_text()):
                stale.append(f"{name(page)}: {match[0].strip('`')}")
    assert not stale, f"Pages name files or tests that do not exist: {stale}"


def test_readme_is_short_and_keeps_its_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for command in (
        'pip install -e ".[cpu]" && python -m model_zoo.bert_squad',
        'pip install -e ".[test]" && python -m pytest -q -n 2',
    ):
        assert f"\n{command}\n" in text, command
    begin = "<!-- features-table:begin (generated by tools/features_table.py; do not edit) -->"
    end = "<!-- features-table:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    assert text.index(begin) < text.index(end)
    for link in re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / link).exists(), link


def test_keras_conformance_page_lists_every_exception():
    """tests/test_keras_conformance.py points readers at this page for the reasons."""
    from keras_conformance import exceptions

    def words(text):
        return " ".join(text.lower().split())

    page = words((DOCS / "reference" / "keras-conformance.md").read_text())
    missing = [reason for reason in exceptions.EXCEPTIONS if words(reason) not in page]
    assert not missing, f"docs/reference/keras-conformance.md does not give: {missing}"
