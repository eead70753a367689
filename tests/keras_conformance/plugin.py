"""pytest plugin for the Keras test subprocess (`-p keras_conformance.plugin`).

Environment: KC_LAYOUT ("plain", or a key of `routing.LAYOUTS`), KC_RESULTS (JSON file
written at the end), KC_ONLY (optional file of node ids, one a line: every other test
is deselected).
"""

from __future__ import annotations

import json
import os
import traceback

import pytest

KERAS_MARKERS = ("requires_trainable_backend", "large", "skip_if_backend", "extra_large")
_results: dict[str, dict] = {}
_layout = os.environ.get("KC_LAYOUT", "plain")


def pytest_configure(config):
    for marker in KERAS_MARKERS:
        config.addinivalue_line("markers", marker)
    if _layout == "plain":
        from keras_conformance import routing

        routing.count_calls()
    else:
        # Before TensorFlow initialises (the Keras test modules import it at collection).
        from epl_trainer.runtime.cluster import configure_tensorflow

        configure_tensorflow(2)
        from keras_conformance import routing

        routing.install(_layout)


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("KC_ONLY")
    if not only:
        return
    with open(only) as f:
        keep = {line.strip() for line in f if line.strip()}
    selected = [item for item in items if item.nodeid in keep]
    deselected = [item for item in items if item.nodeid not in keep]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = selected


# Enough of a failure's text for a listed exception's message to be found in it.
FAILURE_CHARS = 4000


def _crash_message(report) -> str:
    """The failure's exception and message (pytest's crash message), else the report."""
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)


def _exception_chain(error: BaseException) -> list[str]:
    """Each exception of `error`'s chain as "Type: message" lines, the first cause first,
    as pytest prints a chain (a refusal inside `pytest.warns` ends as "DID NOT WARN", the
    refusal in the exception before it)."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append("".join(traceback.format_exception_only(type(error), error)).strip())
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return [line.strip() for text in reversed(chain) for line in text.splitlines()]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # The chain read from the exceptions themselves: runner.py runs with --tb=native, whose
    # report has no "E" lines. pytest's --tb=short reports cost 0.23 s a failure: the dp
    # layout's 69 failing tests took 21 s with them, 6 s with --tb=native.
    report = yield
    if call.excinfo is not None:
        report.exception_chain = _exception_chain(call.excinfo.value)
        # The failed test's locals would live on in reference cycles through these frames
        # until the garbage collector runs; a TemporaryDirectory among them, collected
        # inside a later test, warns (ResourceWarning) into that test's `pytest.warns`
        # block, which then passes or fails by the collector's timing (functional_test.py's
        # test_warning_for_mismatched_inputs_structure after csv_logger_test.py's failure).
        # Cleared now (the chain's frames too), they go while this test ends.
        error = call.excinfo.value
        while error is not None:
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__
    return report


def _failure_text(report) -> str:
    """The crash message, then every exception of the chain (or, for a collection error,
    the report's "E" lines). What a listed exception's message is searched in."""
    chain = getattr(report, "exception_chain", None)
    if chain is None:
        chain = [
            line[1:].strip() for line in str(report.longrepr).splitlines() if line.startswith("E ")
        ]
    return "\n".join([_crash_message(report), *chain])


def _first_line(report) -> str:
    text = _crash_message(report)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "?"
    if lines[0].endswith(":") and len(lines) > 1:  # "Items in the first set ...:" + items
        items = sorted(line.removeprefix("E").strip() for line in lines[1:6])
        return f"{lines[0]} {'; '.join(items)}"[:300]
    return lines[0][:300]


def pytest_runtest_setup(item):
    from keras_conformance import routing

    routing.reset_stats()


def pytest_collectreport(report):
    if report.failed:
        _results[report.nodeid + "::<collection>"] = {
            "outcome": "failed",
            "error": _first_line(report),
            "failure": _failure_text(report)[:FAILURE_CHARS],
        }


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed"})
    entry["seconds"] = round(entry.get("seconds", 0.0) + report.duration, 3)
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed"
    elif report.failed and entry["outcome"] != "failed":
        entry["outcome"] = "failed"
        entry["error"] = f"[{report.when}] {_first_line(report)}"
        entry["failure"] = _failure_text(report)[:FAILURE_CHARS]
    if report.when == "call" and hasattr(report, "wasxfail") and report.passed:
        entry["outcome"] = "xpassed"
    if report.when == "teardown":
        from keras_conformance import routing

        if _layout == "plain":
            entry["calls"] = routing.stats["keras"]
            return
        entry["routed_calls"] = routing.stats["routed"]
        entry["keras_calls"] = routing.stats["keras"]
        entry["keras_reasons"] = sorted(set(routing.stats["reasons"]))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KC_RESULTS")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
