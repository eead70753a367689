"""Each routed test's verdict against the lists of exceptions.py, for one layout.

A test that runs routed ends in one of four counts:

- `routed`: passed, and at least one of its `fit` / `evaluate` / `predict` calls went
  through EPLTrainer;
- `unrouted`: passed with every call on Keras's own path, and listed in
  `EXPECTED_UNROUTED` with a pattern its fallback reasons match;
- `listed`: failed, and listed in `EXCEPTIONS` with a pattern its failure text matches;
- `failed`: anything else that fails.

And every disagreement with the lists is a problem, so that the lists stay true: a failure
or an unrouted pass that is not listed, a listed test failing with another message or
falling back for another reason, a listed test that now passes routed ("now passes: remove
from the list"), and a listed test that is not among the tests run routed.
"""

from __future__ import annotations

import dataclasses
import re

from keras_conformance import exceptions

COUNTS = ("routed", "unrouted", "listed", "failed")


@dataclasses.dataclass
class Verdict:
    count: str  # one of COUNTS
    problem: str | None = None  # why the test fails the conformance check, if it does


@dataclasses.dataclass
class LayoutVerdicts:
    verdicts: dict[str, Verdict]  # node id -> its verdict
    stale: dict[str, str]  # listed node id -> why it is not among the tests run routed

    def problems(self) -> dict[str, str]:
        found = {node: v.problem for node, v in self.verdicts.items() if v.problem}
        found.update(self.stale)
        return dict(sorted(found.items()))

    def counts(self) -> dict[str, int]:
        totals = dict.fromkeys(COUNTS, 0)
        for verdict in self.verdicts.values():
            totals[verdict.count] += 1
        return totals


def fallback_text(result: dict) -> str:
    """The reasons the test's calls took Keras's own path, one a line ("predict: not
    compiled"); what an `EXPECTED_UNROUTED` pattern is searched in."""
    return "\n".join(result.get("keras_reasons", []))


def failure_text(result: dict) -> str:
    """The failure's exception and message; what an `EXCEPTIONS` pattern is searched in."""
    return result.get("failure") or result.get("error") or result["outcome"]


def judge_test(node: str, result: dict, excepted, unrouted) -> Verdict:
    """The verdict of one routed test. `excepted` / `unrouted`: its (reason, pattern) in
    EXCEPTIONS / EXPECTED_UNROUTED for this layout, or None."""
    passed = result["outcome"] == "passed"
    went_through = bool(result.get("routed_calls"))
    if passed and went_through:
        if excepted and excepted[0] not in exceptions.SEED_DEPENDENT:
            return Verdict("routed", f"now passes: remove from the list ({excepted[0]})")
        if unrouted:
            return Verdict("routed", f"now routed: remove from the unrouted list ({unrouted[0]})")
        return Verdict("routed")
    if passed:
        fallbacks = fallback_text(result) or "no call at all"
        if excepted:
            return Verdict(
                "failed", f"listed as failing ({excepted[0]}) but passes without a routed call"
            )
        if not unrouted:
            return Verdict(
                "failed",
                f"passed without a routed call and is not in EXPECTED_UNROUTED. "
                f"Received: fallbacks {fallbacks!r}",
            )
        if not re.search(unrouted[1], fallbacks):
            return Verdict(
                "failed",
                f"listed as unrouted ({unrouted[0]}) but falls back for another reason. "
                f"Received: fallbacks {fallbacks!r}, expected to match {unrouted[1]!r}",
            )
        return Verdict("unrouted")
    failure = failure_text(result)
    if excepted and re.search(excepted[1], failure):
        return Verdict("listed")
    if excepted:
        return Verdict(
            "failed",
            f"listed ({excepted[0]}) but fails with another message. Received: "
            f"{failure[:500]!r}, expected to match {excepted[1]!r}",
        )
    listed_as = f" (listed as unrouted: {unrouted[0]})" if unrouted else ""
    return Verdict("failed", f"fails routed{listed_as}: {result.get('error') or failure[:300]}")


def judge(layout: str, routed_tests, results: dict, selected_files) -> LayoutVerdicts:
    """The verdicts of `routed_tests` (node ids run routed) from their `results`, and the
    listed tests of `selected_files` that were not run routed."""
    excepted = exceptions.for_layout(layout, exceptions.EXCEPTIONS)
    unrouted = exceptions.for_layout(layout, exceptions.EXPECTED_UNROUTED)
    both = sorted(set(excepted) & set(unrouted))
    if both:
        raise ValueError(
            f"Listed both as an exception and as expected unrouted for layout {layout!r}. "
            f"Received: {both}"
        )
    missing = {"outcome": "missing", "error": "not run routed"}
    verdicts = {
        node: judge_test(node, results.get(node, missing), excepted.get(node), unrouted.get(node))
        for node in routed_tests
    }
    run = set(routed_tests)
    files = set(selected_files)
    stale = {
        node: f"listed ({entry[0]}) but not among the tests run routed: gone from keras, not "
        "a plain pass that calls fit / evaluate / predict, or deselected (runner.DESELECTED)"
        for node, entry in {**excepted, **unrouted}.items()
        if node.split("::")[0] in files and node not in run
    }
    return LayoutVerdicts(verdicts, stale)
