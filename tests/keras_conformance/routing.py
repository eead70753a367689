"""Routes Keras's `fit` / `evaluate` / `predict` through `epl_trainer.EPLTrainer`.

Patched on the class that defines them (the backend's Trainer), so that Keras's own
trainer tests' models, a layer mixed in with that Trainer, are routed as a `keras.Model`
is. One trainer per model object, built from the model at its first routed call and
rebuilt after the model is compiled again. `fit` / `evaluate` on an uncompiled model keep
Keras's path (Keras's own error), so does any call made while a routed call runs (the
trainer's own use of Keras); the plugin records each such fallback with its reason.
`predict` on an uncompiled model is routed: Keras predicts without `compile`. If
`EPLTrainer(...)` refuses the model, the call raises `RoutingRefused` with the reason: no
silent fallback.

A model with its own `train_step`, `test_step`, `predict_step`, `compute_loss` or
`compute_metrics` is routed too, and the routed call must run that method: one that
returns without it having run in the test raises `OwnStepNotRun` (a trainer training the
compiled loss instead could otherwise pass the test by luck).
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading

LAYOUTS = {
    "dp": {"cluster.virtual_devices": 2},
    "pipeline": {
        "cluster.virtual_devices": 2,
        "auto.auto_parallel": True,
        "pipeline.num_stages": 2,
        "pipeline.num_micro_batch": 2,
    },
}
ROUTED_METHODS = ("fit", "evaluate", "predict")
# The model's methods each routed call must run when the model defines its own. Keras's
# `compute_loss` / `compute_metrics` run from its `train_step` / `test_step`: required
# only while those are Keras's own (a model's own step need not call them).
OWN_METHODS = {
    "fit": ("train_step", "compute_loss", "compute_metrics"),
    "evaluate": ("test_step", "compute_loss", "compute_metrics"),
    "predict": ("predict_step",),
}
STEP_OF = {"fit": "train_step", "evaluate": "test_step"}

# Calls in the running test (plugin.py resets and reads them per test).
stats = {"routed": 0, "keras": 0, "reasons": [], "own_calls": collections.Counter()}
_local = threading.local()


class RoutingRefused(Exception):
    """EPLTrainer's constructor refused the model. Not a RuntimeError (nor a ValueError):
    a Keras test expecting one of those from `fit` must not pass on a refusal."""


class OwnStepNotRun(Exception):
    """A routed call returned without running a method the model defines itself."""


def trainer_class():
    """The class defining Keras's `fit` / `evaluate` / `predict` (the backend's Trainer)."""
    import keras

    return next(c for c in type.mro(keras.Model) if "fit" in vars(c))


def own_methods(model, call: str) -> list[str]:
    """The methods `call` must run that `model` defines itself (not Keras's)."""
    import keras

    def own(name):
        return getattr(type(model), name, None) is not getattr(keras.Model, name)

    step = STEP_OF.get(call)
    return [
        name
        for name in OWN_METHODS[call]
        if own(name) and (name == step or step is None or not own(step))
    ]


def defining_class(model, name: str) -> type:
    return next(c for c in type(model).__mro__ if name in vars(c))


def watch_own_methods(model, names) -> None:
    """Wraps each of `model`'s `names`, once, on the class that defines it, to count its
    calls in `stats["own_calls"]` by (class, name). The wrapper stays: a trainer that took
    the method when it was built, or traced it into a graph in an earlier call of the same
    test (a graph reused runs no Python), has still run it through the wrapper."""
    for name in names:
        owner = defining_class(model, name)
        original = vars(owner)[name]
        if getattr(original, "_kc_watched", False):
            continue

        def counted(*args, _original=original, _key=(owner, name), **kwargs):
            stats["own_calls"][_key] += 1
            return _original(*args, **kwargs)

        wrapper = functools.wraps(original)(counted)
        wrapper._kc_watched = True
        setattr(owner, name, wrapper)


def call_running_own_methods(trainer_for, name: str, model, arguments: dict):
    """`trainer_for(model).<name>(**arguments)`; raises OwnStepNotRun if, by its end, one of
    the model's own methods that Keras's `name` would run (`own_methods`) has not run in
    this test."""
    required = own_methods(model, name)
    watch_own_methods(model, required)  # before the trainer is built: it may keep them
    result = getattr(trainer_for(model), name)(**arguments)
    calls = {m: stats["own_calls"][(defining_class(model, m), m)] for m in required}
    not_run = [method for method, count in calls.items() if not count]
    if not_run:
        raise OwnStepNotRun(
            f"EPLTrainer.{name} returned without running the model's own "
            f"{', '.join(not_run)} (defined by {type(model).__name__}) in this test. "
            f"Received: calls {calls}"
        )
    return result


def reset_stats() -> None:
    """Before each test (plugin.py)."""
    stats.update(routed=0, keras=0, reasons=[], own_calls=collections.Counter())


def count_calls() -> None:
    """The plain run's patch: counts `fit` / `evaluate` / `predict` calls (in
    `stats["keras"]`) and changes nothing else. A test that makes none cannot be routed;
    the routed runs skip it (runner.py)."""
    owner = trainer_class()

    def counted(original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            stats["keras"] += 1
            return original(self, *args, **kwargs)

        return method

    for name in ROUTED_METHODS:
        setattr(owner, name, counted(getattr(owner, name)))


def install(layout: str) -> None:
    import keras

    import epl_trainer

    config = LAYOUTS[layout]
    owner = trainer_class()
    originals = {name: getattr(owner, name) for name in ROUTED_METHODS}
    original_compile = keras.Model.compile

    @functools.wraps(original_compile)
    def compile(self, *args, **kwargs):
        result = original_compile(self, *args, **kwargs)
        self.__dict__["_kc_compile_generation"] = self.__dict__.get("_kc_compile_generation", 0) + 1
        return result

    def trainer_for(model):
        generation = model.__dict__.get("_kc_compile_generation", 0)
        cached = model.__dict__.get("_kc_trainer")
        if cached is not None and cached[0] == generation:
            return cached[1]
        try:
            trainer = epl_trainer.EPLTrainer(model, config=dict(config))
        except Exception as error:
            raise RoutingRefused(
                f"EPLTrainer refused the model: {type(error).__name__}: {error}"
            ) from error
        model.__dict__["_kc_trainer"] = (generation, trainer)
        return trainer

    def routed(name):
        original = originals[name]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            reason = None
            if getattr(_local, "active", False):
                reason = "nested"
            elif name != "predict" and not getattr(self, "compiled", False):
                reason = "not compiled"
            if reason:
                stats["keras"] += 1
                stats["reasons"].append(f"{name}: {reason}")
                return original(self, *args, **kwargs)
            # Keras's defaults (shuffle=True, return_dict=False, ...), passed explicitly.
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.pop("self")
            arguments.update(arguments.pop("kwargs", {}))
            stats["routed"] += 1
            _local.active = True
            try:
                return call_running_own_methods(trainer_for, name, self, arguments)
            finally:
                _local.active = False

        return method

    # On the class that defines compile (Keras's Trainer): Keras's loading compares
    # `type(model).compile` with `Trainer.compile` to spot a custom compile, and would
    # then skip compiling a loaded or unpickled model.
    compile_owner = next(c for c in type.mro(keras.Model) if "compile" in vars(c))
    compile_owner.compile = compile
    for name in ROUTED_METHODS:
        setattr(owner, name, routed(name))
