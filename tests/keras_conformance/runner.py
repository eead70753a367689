"""Runs Keras's own tests plain and routed through EPLTrainer, and compares (see __init__)."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO = TESTS_DIR.parent
CALLBACKS = "callbacks"
MODELS = "models"
MODEL_FILES = ("model_test.py", "functional_test.py", "sequential_test.py")
# Plain Keras's outcomes, recorded by `python -m keras_conformance.runner --record`: a run
# with the same keras version reuses them instead of running the tests plain again.
RECORDED = HERE / "plain_baseline.json"


def keras_src() -> Path:
    """The installed keras's `src` directory, found without importing keras (no TF here)."""
    import importlib.util

    spec = importlib.util.find_spec("keras")
    return Path(spec.origin).parent / "src"


def select_files(groups=(CALLBACKS,)) -> list[Path]:
    """Every callbacks/*_test.py that calls `fit`; models/model_test.py if asked."""
    src = keras_src()
    files = []
    if CALLBACKS in groups:
        for path in sorted((src / "callbacks").glob("*_test.py")):
            if re.search(r"\.fit\(", path.read_text()):
                files.append(path)
    if MODELS in groups:
        files += [src / "models" / name for name in MODEL_FILES]
    return files


def copy_files(files, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy(path, directory / path.name)
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
        "--timeout", "300", str(directory),
    ]  # fmt: skip
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


def routable(plain: dict) -> list[str]:
    """The tests to run routed: those passing on plain Keras that call `fit`, `evaluate`
    or `predict` there. One that calls none of them runs the same code routed or not
    (92 of the 199 plain passes with keras 3.15.1: model construction, summaries, saving),
    so running it again per layout would prove nothing of ours. A record without call
    counts keeps every pass."""
    return sorted(n for n, r in plain.items() if r["outcome"] == "passed" and r.get("calls", 1) > 0)


def compare(plain: dict, routed: dict[str, dict]) -> dict:
    """Counts per layout and file: the routable tests (passing plain, calling fit /
    evaluate / predict), and of those the routed passes; failing routed tests grouped by
    their first error line."""
    baseline = routable(plain)
    report = {"plain": {}, "layouts": {}}
    for node in plain:
        counts = report["plain"].setdefault(file_of(node), collections.Counter())
        counts[plain[node]["outcome"]] += 1
    report["plain"] = {f: dict(c) for f, c in sorted(report["plain"].items())}
    for layout, results in routed.items():
        per_file: dict[str, dict] = {}
        causes: dict[str, list[str]] = collections.defaultdict(list)
        for node in baseline:
            entry = per_file.setdefault(
                file_of(node), {"plain": 0, "routed": 0, "passed_unrouted": 0}
            )
            entry["plain"] += 1
            result = results.get(node, {"outcome": "missing", "error": "not run routed"})
            if result["outcome"] == "passed":
                entry["routed"] += 1
                if not result.get("routed_calls"):
                    entry["passed_unrouted"] += 1
            else:
                error = result.get("error") or result["outcome"]
                causes[_normalise(error)].append(node)
        report["layouts"][layout] = {
            "per_file": dict(sorted(per_file.items())),
            "passed": sum(e["routed"] for e in per_file.values()),
            "counted": sum(e["plain"] for e in per_file.values()),
            "causes": dict(sorted(causes.items(), key=lambda kv: -len(kv[1]))),
        }
    report["baseline_passed"] = len(baseline)
    report["plain_passed_without_calls"] = sum(
        r["outcome"] == "passed" for r in plain.values()
    ) - len(baseline)
    return report


def _normalise(error: str) -> str:
    """Groups errors that differ only by numbers, addresses or temp paths."""
    error = re.sub(r"0x[0-9a-f]+", "0x…", error)
    error = re.sub(r"/tmp/\S+", "/tmp/…", error)
    return error[:200]


def format_report(report: dict, seconds: dict) -> str:
    lines = [
        "",
        "Keras conformance: routed passes / plain passes that call fit, evaluate or predict",
        f"({report['plain_passed_without_calls']} more plain passes call none of them and are "
        "not run routed)",
    ]
    layouts = list(report["layouts"])
    header = f"{'file':40s}" + "".join(f"{name:>18s}" for name in layouts)
    lines += [header, "-" * len(header)]
    files = sorted({f for lay in report["layouts"].values() for f in lay["per_file"]})
    for name in files:
        row = f"{name:40s}"
        for layout in layouts:
            entry = report["layouts"][layout]["per_file"].get(name, {"routed": 0, "plain": 0})
            row += f"{entry['routed']:>10d} / {entry['plain']:<5d}"
        lines.append(row)
    total = f"{'TOTAL':40s}" + "".join(
        f"{report['layouts'][lay]['passed']:>10d} / {report['layouts'][lay]['counted']:<5d}"
        for lay in layouts
    )
    lines += ["-" * len(header), total]
    for layout in layouts:
        unrouted = sum(e["passed_unrouted"] for e in report["layouts"][layout]["per_file"].values())
        lines.append(f"{layout}: {unrouted} of the routed passes made no routed call")
    lines.append("Plain Keras outcomes per file (all tests; only 'passed' ones are compared):")
    for name, counts in report["plain"].items():
        lines.append(f"  {name:40s} {counts}")
    lines.append("Run times: " + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))
    for layout in layouts:
        causes = report["layouts"][layout]["causes"]
        lines.append(f"\n[{layout}] failures by cause ({sum(map(len, causes.values()))}):")
        for cause, nodes in causes.items():
            lines.append(f"  {len(nodes):3d} x {cause}")
            lines += [f"        {node}" for node in nodes]
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


def record_plain(directory: Path, groups=(CALLBACKS, MODELS)) -> Path:
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
    report = compare(plain, routed)
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
