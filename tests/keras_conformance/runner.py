"""Runs Keras's own tests plain and routed through EPLTrainer, and compares (see __init__)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO = TESTS_DIR.parent
CALLBACKS = "callbacks"
MODELS = "models"
TRAINERS = "trainers"
MODEL_FILES = ("model_test.py", "functional_test.py", "sequential_test.py")
# Directories whose test files join when they call fit, evaluate or predict (the others
# test Keras's pieces directly, run the same code routed or not, and would prove nothing
# of ours: with keras 3.15.1 all of losses/, compile_utils_test.py, epoch_iterator_test.py
# and every data adapter test but tf_dataset_adapter_test.py's one fit).
GROUP_DIRECTORIES = {
    CALLBACKS: ("callbacks",),
    TRAINERS: ("trainers", "trainers/data_adapters", "losses"),
}
CALLS_FIT = re.compile(r"\.(fit|evaluate|predict)\(")
# Edits to the copies so that they import without packages this project does not install,
# with the reason. Each must apply (a new keras that changes the line fails loudly).
SOURCE_EDITS = {
    "trainer_test.py": [
        (
            "import jax\n",
            "jax = None  # conformance copy: jax is not installed; only the jax "
            "backend's tests use it\n",
        )
    ],
}
# Plain Keras's outcomes, recorded by `python -m keras_conformance.runner --record`: a run
# with the same keras version reuses them instead of running the tests plain again.
RECORDED = HERE / "plain_baseline.json"


def keras_src() -> Path:
    """The installed keras's `src` directory, found without importing keras (no TF here)."""
    import importlib.util

    spec = importlib.util.find_spec("keras")
    return Path(spec.origin).parent / "src"


def select_files(groups=(CALLBACKS,)) -> list[Path]:
    """The test files of `groups`: those of GROUP_DIRECTORIES' directories that call
    `fit`, `evaluate` or `predict`, and MODEL_FILES for MODELS."""
    unknown = sorted(set(groups) - {*GROUP_DIRECTORIES, MODELS})
    if unknown:
        raise ValueError(
            f"Unknown conformance groups {unknown}. Received: {list(groups)}; known: "
            f"{sorted({*GROUP_DIRECTORIES, MODELS})}"
        )
    src = keras_src()
    files = []
    for group in groups:
        for directory in GROUP_DIRECTORIES.get(group, ()):
            for path in sorted((src / directory).glob("*_test.py")):
                if CALLS_FIT.search(path.read_text()):
                    files.append(path)
    if MODELS in groups:
        files += [src / "models" / name for name in MODEL_FILES]
    return files


def copy_files(files, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for path in files:
        text = path.read_text()
        for old, new in SOURCE_EDITS.get(path.name, ()):
            if old not in text:
                raise ValueError(
                    f"{path}: the conformance edit no longer applies. Received: {old!r} "
                    f"not found (SOURCE_EDITS in {__file__})"
                )
            text = text.replace(old, new, 1)
        (directory / path.name).write_text(text)
    return directory


def run_layout(directory: Path, layout: str, only: list[str] | None = None, timeout=1500):
    """pytest on `directory` in a fresh process; returns ({node id: result}, seconds)."""
    results = directory / f"results_{layout}.json"
    env = dict(os.environ)
    env.update(
        KC_LAYOUT=layout,
        KC_RESULTS=str(results),
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(
            [str(TESTS_DIR), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
        ),
    )
    env.pop("KC_ONLY", None)
    if only is not None:
        only_file = directory / f"only_{layout}.txt"
        only_file.write_text("\n".join(only) + "\n")
        env["KC_ONLY"] = str(only_file)
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-p", "keras_conformance.plugin", "-p", "no:randomly", "-o", "addopts=",
        "--continue-on-collection-errors", "-W", "ignore", "--rootdir", str(directory),
        "--timeout", "300", "--tb=native", str(directory),
    ]  # fmt: skip
    # --tb=native: Python's own traceback (the failures' text comes from the exceptions,
    # plugin.py). Measured alone: the dp layout's 69 failing tests took 21 s with
    # --tb=short, 6 s with it; the whole dp test 138 s -> 98 s, pipeline's 108 s -> 62 s.
    start = time.monotonic()
    process = subprocess.run(
        command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.monotonic() - start
    (directory / f"log_{layout}.txt").write_text(process.stdout + process.stderr)
    if not results.exists():
        raise RuntimeError(
            f"{layout}: pytest wrote no results (exit {process.returncode}):\n"
            + (process.stdout + process.stderr)[-3000:]
        )
    return json.loads(results.read_text()), seconds


def file_of(node_id: str) -> str:
    return node_id.split("::")[0]


# Tests that pass plain and call fit / evaluate / predict but are not run routed, by
# pattern of their node id, with the reason. trainer_test.py runs most of its tests once
# per Keras execution mode: run_eagerly=True ("_eager"), XLA ("_jit"), and Keras's graph
# function ("_graph_fn", "_non_jit", "_graph"). Routed, EPLTrainer runs its own step
# function whatever `run_eagerly` says, so an "_eager" test runs the same code as its graph
# sibling; the "_jit" ones compile XLA on this CPU in each of plain, dp and pipeline, and
# would double the trainers group's time for a path the trainer's own tests cover
# (tests/test_speed_features.py). The unrolled steps_per_execution test is XLA-only: its
# count 3 is kept.
DESELECTED = {
    r"^trainer_test\.py::.*_eager$": "Keras's run_eagerly variant (the trainer runs its own "
    "graph either way: same code as the _graph_fn / _non_jit / _graph variant)",
    r"^trainer_test\.py::.*(?<!_non)_jit$": "Keras's XLA variant of a test also run without XLA",
    r"^trainer_test\.py::.*unrolled_steps_steps_count_(8|32)$": "the same XLA-only test with "
    "another steps_per_execution (3 is kept)",
}


def deselected(node: str) -> str | None:
    """The reason `node` is not run routed (DESELECTED), or None."""
    return next((why for pattern, why in DESELECTED.items() if re.search(pattern, node)), None)


def routable(plain: dict) -> list[str]:
    """The tests to run routed: those passing on plain Keras that call `fit`, `evaluate`
    or `predict` there, less DESELECTED. One that calls none of them runs the same code
    routed or not (model construction, summaries, saving), so running it again per layout
    would prove nothing of ours. A record without call counts keeps every pass."""
    return sorted(
        n
        for n, r in plain.items()
        if r["outcome"] == "passed" and r.get("calls", 1) > 0 and not deselected(n)
    )


def compare(plain: dict, routed: dict[str, dict], files) -> dict:
    """Per layout and file, the counts of verdict.py (routed passes, unrouted passes,
    listed exceptions, failures) of the tests run routed, and the problems (disagreements
    with exceptions.py's lists); failing tests grouped by cause."""
    from keras_conformance import verdict

    baseline = routable(plain)
    report = {"plain": {}, "layouts": {}}
    for node in plain:
        counts = report["plain"].setdefault(file_of(node), collections.Counter())
        counts[plain[node]["outcome"]] += 1
    report["plain"] = {f: dict(c) for f, c in sorted(report["plain"].items())}
    names = [path.name for path in files]
    for layout, results in routed.items():
        judged = verdict.judge(layout, baseline, results, names)
        per_file: dict[str, dict] = {}
        listed: dict[str, list[str]] = collections.defaultdict(list)
        failed: dict[str, list[str]] = collections.defaultdict(list)
        excepted = exceptions_for(layout)
        for node, outcome in judged.verdicts.items():
            entry = per_file.setdefault(file_of(node), dict.fromkeys((*verdict.COUNTS, "run"), 0))
            entry[outcome.count] += 1
            entry["run"] += 1
            if outcome.count == "listed":
                listed[excepted[node][0]].append(node)
            elif outcome.count == "failed":
                result = results.get(node, {})
                failed[_normalise(result.get("error") or outcome.problem or "?")].append(node)
        report["layouts"][layout] = {
            "per_file": dict(sorted(per_file.items())),
            "totals": {**judged.counts(), "run": len(judged.verdicts)},
            "problems": judged.problems(),
            "listed": dict(listed),
            "failed": dict(sorted(failed.items(), key=lambda kv: -len(kv[1]))),
        }
    report["baseline_passed"] = len(baseline)
    passed_with_calls = [
        n for n, r in plain.items() if r["outcome"] == "passed" and r.get("calls", 1) > 0
    ]
    report["deselected"] = len(passed_with_calls) - len(baseline)
    report["plain_passed_without_calls"] = sum(
        r["outcome"] == "passed" for r in plain.values()
    ) - len(passed_with_calls)
    return report


def exceptions_for(layout: str) -> dict[str, tuple[str, str]]:
    from keras_conformance import exceptions

    return exceptions.for_layout(layout, exceptions.EXCEPTIONS)


def _normalise(error: str) -> str:
    """Groups errors that differ only by numbers, addresses or temp paths."""
    error = re.sub(r"0x[0-9a-f]+", "0x…", error)
    error = re.sub(r"/tmp/\S+", "/tmp/…", error)
    return error[:200]


def _cell(entry: dict) -> str:
    counts = "/".join(str(entry[count]) for count in ("routed", "unrouted", "listed", "failed"))
    return f"{counts} of {entry['run']}"


def format_report(report: dict, seconds: dict) -> str:
    layouts = list(report["layouts"])
    lines = [
        "",
        "Keras conformance, per layout: routed passes / unrouted passes (listed) / listed "
        "exceptions / failures, of the plain passes that call fit, evaluate or predict",
        f"({report['plain_passed_without_calls']} more plain passes call none of them and "
        f"{report['deselected']} are deselected (runner.DESELECTED): not run routed)",
    ]
    header = f"{'file':36s}" + "".join(f"{name:>24s}" for name in layouts)
    lines += [header, "-" * len(header)]
    files = sorted({f for lay in report["layouts"].values() for f in lay["per_file"]})
    empty = {"routed": 0, "unrouted": 0, "listed": 0, "failed": 0, "run": 0}
    for name in files:
        cells = [_cell(report["layouts"][lay]["per_file"].get(name, empty)) for lay in layouts]
        lines.append(f"{name:36s}" + "".join(f"{cell:>24s}" for cell in cells))
    totals = [_cell(report["layouts"][lay]["totals"]) for lay in layouts]
    lines += ["-" * len(header), f"{'TOTAL':36s}" + "".join(f"{c:>24s}" for c in totals)]
    lines.append("Plain Keras outcomes per file (all tests; only 'passed' ones are compared):")
    for name, counts in report["plain"].items():
        lines.append(f"  {name:40s} {counts}")
    lines.append("Run times: " + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))
    for layout in layouts:
        data = report["layouts"][layout]
        lines.append(f"\n[{layout}] listed exceptions by reason:")
        for reason, nodes in data["listed"].items():
            lines.append(f"  {len(nodes):3d} x {reason}")
        lines.append(f"[{layout}] failures by first error line ({data['totals']['failed']}):")
        for cause, nodes in data["failed"].items():
            lines.append(f"  {len(nodes):3d} x {cause}")
            lines += [f"        {node}" for node in nodes]
        lines.append(f"[{layout}] problems with the lists ({len(data['problems'])}):")
        lines += [f"  {node}: {problem}" for node, problem in data["problems"].items()]
    return "\n".join(lines)


def keras_version() -> str:
    """The installed keras's version, read without importing keras (no TF here)."""
    from importlib.metadata import version

    return version("keras")


def recorded_plain(files) -> dict | None:
    """The recorded plain outcomes of `files`, if recorded with the installed keras."""
    if not RECORDED.exists():
        return None
    record = json.loads(RECORDED.read_text())
    names = {path.name for path in files}
    if record["keras"] != keras_version() or not names <= set(record["files"]):
        return None
    return {node: r for node, r in record["results"].items() if file_of(node) in names}


def record_plain(directory: Path, groups=(CALLBACKS, MODELS, TRAINERS)) -> Path:
    """Runs every selected file on plain Keras and records the outcomes in RECORDED."""
    files = select_files(groups)
    copy_files(files, directory)
    plain, _ = run_layout(directory, "plain")
    results = {
        n: {"outcome": r["outcome"], "calls": r.get("calls", 0)} for n, r in sorted(plain.items())
    }
    record = {"keras": keras_version(), "files": sorted(p.name for p in files), "results": results}
    RECORDED.write_text(json.dumps(record, indent=1) + "\n")
    return RECORDED


def run(
    directory: Path, layouts=("dp",), groups=(CALLBACKS,), plain_run=False
) -> tuple[dict, str, Path]:
    """Copies the tests, takes plain Keras's outcomes (recorded for this keras version, or
    run with `plain_run`/without a record), runs each layout on plain's passes; returns
    the report, its text and the JSON path."""
    files = select_files(groups)
    copy_files(files, directory)
    seconds = {}
    plain = None if plain_run else recorded_plain(files)
    if plain is None:
        plain, seconds["plain"] = run_layout(directory, "plain")
    else:
        seconds["plain (recorded)"] = 0.0
    routed = {}
    for layout in layouts:
        routed[layout], seconds[layout] = run_layout(directory, layout, only=routable(plain))
    report = compare(plain, routed, files)
    report["seconds"] = seconds
    text = format_report(report, seconds)
    path = directory / "keras_conformance.json"
    path.write_text(json.dumps({"report": report, "plain": plain, "routed": routed}, indent=1))
    return report, text, path


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layouts", default="dp")
    parser.add_argument("--groups", default=CALLBACKS)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--plain", action="store_true", help="run plain Keras, not the record")
    parser.add_argument("--record", action="store_true", help=f"record plain runs in {RECORDED}")
    args = parser.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="keras_conformance_"))
    if args.record:
        print(f"Recorded plain Keras outcomes in {record_plain(directory)}")
        raise SystemExit(0)
    _, text, path = run(directory, args.layouts.split(","), args.groups.split(","), args.plain)
    print(text)
    print(f"\nReport JSON: {path}")
