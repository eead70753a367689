"""Keras conformance (issue #28, item 1; issue #45, item 9): Keras's own tests, run with
`fit` / `evaluate` / `predict` routed through `EPLTrainer` on 2 logical CPU devices
(tests/keras_conformance/).

Files: every `keras/src/callbacks/*_test.py` that calls `fit`,
`keras/src/models/{model,functional,sequential}_test.py`, and the `trainers/`, its data
adapters' and `losses/` test files that call `fit`, `evaluate` or `predict`
(`EPL_CONFORMANCE_GROUPS` picks "callbacks", "models" and/or "trainers"). Each layout is
one test, a fresh pytest subprocess on copies of the installed wheel's test files: "dp"
(`cluster.virtual_devices: 2`, data parallel) and "pipeline" (auto.auto_parallel, 2 stages,
2 micro-batches); `EPL_CONFORMANCE_LAYOUTS` picks others. The plain-Keras outcomes come
from tests/keras_conformance/plain_baseline.json when it was recorded with the installed
keras version (`python -m keras_conformance.runner --record`), else from a plain run
first; only the tests passing plain that call `fit`, `evaluate` or `predict` there are run
routed (less `runner.DESELECTED`: trainer_test.py's eager and XLA variants).

The assertion (keras_conformance/verdict.py): every such test passes routed with at least
one routed call, or is listed in `keras_conformance/exceptions.py` with its reason and the
message it must show: `EXCEPTIONS` (fails routed, its failure text matching the message)
or `EXPECTED_UNROUTED` (passes with every call on Keras's path, its fallback reasons
matching). A listed test that now passes routed, fails with another message, or is no
longer run must leave or change its entry. The counts per file and layout, the listed
exceptions by reason and the problems are printed (run with `-s`).
"""

import os
import re
import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest
from keras_conformance import exceptions, routing, runner, verdict  # tests/ is on sys.path

LAYOUTS = tuple(os.environ.get("EPL_CONFORMANCE_LAYOUTS", "dp,pipeline").split(","))
GROUPS = tuple(
    os.environ.get(
        "EPL_CONFORMANCE_GROUPS", f"{runner.CALLBACKS},{runner.MODELS},{runner.TRAINERS}"
    ).split(",")
)
DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "keras-conformance.md"


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_keras_conformance(layout):
    directory = Path(tempfile.mkdtemp(prefix=f"keras_conformance_{layout}_"))
    report, text, path = runner.run(directory, layouts=(layout,), groups=GROUPS)
    print(text)
    print(f"\nKeras conformance report JSON: {path}")

    assert report["baseline_passed"] > 0, "no Keras test passed on plain Keras"
    problems = report["layouts"][layout]["problems"]
    assert not problems, (
        f"{layout}: {len(problems)} Keras tests disagree with keras_conformance/exceptions.py "
        "(see verdict.py):\n" + "\n".join(f"{node}: {why}" for node, why in problems.items())
    )


# The judging itself, on made-up results (fast).

FAILING = "x_test.py::T::test_fails"
UNROUTED = "x_test.py::T::test_unrouted"


@pytest.fixture
def lists(monkeypatch):
    """Empty lists to fill per test (the module's own ones stay untouched)."""
    monkeypatch.setattr(exceptions, "EXCEPTIONS", {})
    monkeypatch.setattr(exceptions, "EXPECTED_UNROUTED", {})
    return exceptions


def routed_pass():
    return {"outcome": "passed", "routed_calls": 2, "keras_calls": 0, "keras_reasons": []}


def unrouted_pass(reason="predict: not compiled"):
    return {"outcome": "passed", "routed_calls": 0, "keras_calls": 1, "keras_reasons": [reason]}


def failure(text):
    return {"outcome": "failed", "error": f"[call] {text.splitlines()[0]}", "failure": text}


def judged(layout, results, files=("x_test.py",)):
    return verdict.judge(layout, sorted(results), results, files)


def test_an_unrouted_pass_fails_unless_listed_with_its_reason(lists):
    results = {UNROUTED: unrouted_pass(), "x_test.py::T::test_ok": routed_pass()}
    first = judged("dp", results)
    assert first.counts() == {"routed": 1, "unrouted": 0, "listed": 0, "failed": 1}
    assert "not in EXPECTED_UNROUTED" in first.problems()[UNROUTED]

    lists.EXPECTED_UNROUTED["predicts uncompiled"] = lists.Listed(
        (lists.ALL,), r"^predict: not compiled$", [UNROUTED]
    )
    second = judged("dp", results)
    assert second.counts() == {"routed": 1, "unrouted": 1, "listed": 0, "failed": 0}
    assert second.problems() == {}

    other = judged("dp", {UNROUTED: unrouted_pass("fit: nested")})
    assert "falls back for another reason" in other.problems()[UNROUTED]
    routed_now = judged("dp", {UNROUTED: routed_pass()})
    assert "now routed: remove from the unrouted list" in routed_now.problems()[UNROUTED]


def test_a_listed_exception_must_fail_with_its_message(lists):
    lists.EXCEPTIONS["the trainer refuses it"] = lists.Listed(
        ("dp",), r"RoutingRefused: .*needs a loss", [FAILING]
    )
    as_listed = judged("dp", {FAILING: failure("RoutingRefused: EPLTrainer needs a loss.")})
    assert as_listed.counts()["listed"] == 1 and as_listed.problems() == {}

    other = judged("dp", {FAILING: failure("AssertionError: 3 != 4")})
    assert other.counts()["failed"] == 1
    assert "fails with another message" in other.problems()[FAILING]
    assert "AssertionError: 3 != 4" in other.problems()[FAILING]

    passes = judged("dp", {FAILING: routed_pass()})
    assert passes.problems()[FAILING].startswith("now passes: remove from the list")
    # Listed for dp only: on the pipeline layout the same failure is unlisted.
    pipeline = judged("pipeline", {FAILING: failure("RoutingRefused: EPLTrainer needs a loss.")})
    assert "fails routed" in pipeline.problems()[FAILING]


def test_a_seed_dependent_exception_may_pass(lists):
    reason = exceptions.NONFINITE_STOPS
    lists.EXCEPTIONS[reason] = lists.Listed((lists.ALL,), r"NonFiniteLossError", [FAILING])
    assert reason in exceptions.SEED_DEPENDENT
    assert judged("dp", {FAILING: routed_pass()}).problems() == {}


def test_a_listed_test_not_run_routed_is_a_problem(lists):
    gone = "x_test.py::T::test_renamed_by_keras"
    lists.EXCEPTIONS["some reason"] = lists.Listed((lists.ALL,), "x", [gone])
    assert "not among the tests run routed" in judged("dp", {}).problems()[gone]
    # A file that this run did not select (EPL_CONFORMANCE_GROUPS) is not judged.
    assert judged("dp", {}, files=("y_test.py",)).problems() == {}


def test_a_layouts_own_entry_wins_and_a_test_listed_twice_is_refused(lists):
    lists.EXCEPTIONS["everywhere"] = lists.Listed((lists.ALL,), "x", [FAILING])
    lists.EXCEPTIONS["pipeline only"] = lists.Listed(("pipeline",), "y", [FAILING])
    assert judged("dp", {FAILING: failure("x")}).counts()["listed"] == 1
    assert judged("pipeline", {FAILING: failure("y")}).counts()["listed"] == 1
    assert (
        "fails with another message"
        in judged("pipeline", {FAILING: failure("x")}).problems()[FAILING]
    )
    lists.EXCEPTIONS["pipeline again"] = lists.Listed(("pipeline",), "z", [FAILING])
    with pytest.raises(ValueError, match="listed twice for layout 'pipeline'"):
        judged("pipeline", {FAILING: failure("y")})


def test_every_listed_message_is_a_regex_and_every_reason_on_the_docs_page():
    page = " ".join(DOCS_PAGE.read_text().lower().split())
    for lists in (exceptions.EXCEPTIONS, exceptions.EXPECTED_UNROUTED):
        for reason, entry in lists.items():
            re.compile(entry.message)
            assert entry.nodes, f"no test listed for {reason!r}"
            assert " ".join(reason.lower().split()) in page, f"the docs page lacks {reason!r}"


def test_deselection_keeps_one_execution_mode():
    test = "trainer_test.py::TestTrainer::test_fit_flow"
    assert runner.deselected(f"{test}_eager") and runner.deselected(f"{test}_jit")
    assert not runner.deselected(f"{test}_graph_fn")
    assert not runner.deselected(f"{test}_non_jit")
    assert not runner.deselected("model_test.py::ModelTest::test_fit_jit")  # trainer_test only


# The routing's check that a model's own step methods ran (fast, no patching of Keras).


class OwnTrainStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return super().train_step(data)


class OwnComputeLoss(OwnTrainStep):
    train_step = keras.Model.train_step

    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs)


class FakeTrainer:
    """Stands in for EPLTrainer: `fit` runs the model's train_step if told to."""

    def __init__(self, runs_train_step):
        self.runs_train_step = runs_train_step

    def fit(self, model, x):
        if self.runs_train_step:
            model.train_step((x, x[:, :1]))
        return "history"


def test_own_methods_names_those_keras_would_run():
    assert routing.own_methods(OwnTrainStep(), "fit") == ["train_step"]
    assert routing.own_methods(OwnTrainStep(), "evaluate") == []
    # compute_loss is Keras's train_step's to call: required while train_step is Keras's.
    assert routing.own_methods(OwnComputeLoss(), "fit") == ["compute_loss"]
    assert routing.own_methods(keras.Sequential([keras.layers.Dense(1)]), "predict") == []


def test_a_routed_call_that_skips_the_models_train_step_raises():
    model = OwnTrainStep()
    model.compile("sgd", "mse")
    x = np.ones((4, 2), "float32")
    arguments = {"model": model, "x": x}

    def call(runs_train_step):
        trainer = FakeTrainer(runs_train_step)
        return routing.call_running_own_methods(lambda m: trainer, "fit", model, arguments)

    routing.reset_stats()
    with pytest.raises(routing.OwnStepNotRun, match="without running the model's own train_step"):
        call(False)
    assert call(True) == "history"
    # Once run in a test, a later call may reuse what the trainer traced (no Python call).
    assert call(False) == "history"
    routing.reset_stats()  # the next test
    with pytest.raises(routing.OwnStepNotRun):
        call(False)
