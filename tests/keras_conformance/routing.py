"""Routes `keras.Model.fit` / `evaluate` / `predict` through `epl_trainer.EPLTrainer`.

One trainer per model object, built from the compiled model at its first routed call and
rebuilt after the model is compiled again. A model whose `train_step`, `test_step`,
`predict_step` or `compute_loss` is not Keras's own keeps Keras's path, so does an
uncompiled model (Keras's own error) and any call made while a routed call runs (the
trainer's own use of Keras). If `EPLTrainer(...)` refuses the model, the call raises
`RoutingRefused` with the reason: no silent fallback.
"""

from __future__ import annotations

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
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")
ROUTED_METHODS = ("fit", "evaluate", "predict")

# Calls in the running test (plugin.py resets and reads them per test).
stats = {"routed": 0, "keras": 0, "reasons": []}
_local = threading.local()


class RoutingRefused(Exception):
    """EPLTrainer's constructor refused the model. Not a RuntimeError (nor a ValueError):
    a Keras test expecting one of those from `fit` must not pass on a refusal."""


def _keras_own_steps(model, keras) -> str | None:
    """None if every step method is Keras's; else the name of the first overridden one."""
    for name in STEP_METHODS:
        if getattr(type(model), name, None) is not getattr(keras.Model, name):
            return name
    return None


def count_calls() -> None:
    """The plain run's patch: counts `fit` / `evaluate` / `predict` calls (in
    `stats["keras"]`) and changes nothing else. A test that makes none cannot be routed;
    the routed runs skip it (runner.py)."""
    import keras

    def counted(original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            stats["keras"] += 1
            return original(self, *args, **kwargs)

        return method

    for name in ROUTED_METHODS:
        setattr(keras.Model, name, counted(getattr(keras.Model, name)))


def install(layout: str) -> None:
    import keras

    import epl_trainer

    config = LAYOUTS[layout]
    originals = {name: getattr(keras.Model, name) for name in (*ROUTED_METHODS, "compile")}

    @functools.wraps(originals["compile"])
    def compile(self, *args, **kwargs):
        result = originals["compile"](self, *args, **kwargs)
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
            overridden = _keras_own_steps(self, keras)
            reason = None
            if getattr(_local, "active", False):
                reason = "nested"
            elif overridden:
                reason = f"overrides {overridden}"
            elif not getattr(self, "compiled", False):
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
                return getattr(trainer_for(self), name)(**arguments)
            finally:
                _local.active = False

        return method

    # On the class that defines compile (Keras's Trainer): Keras's loading compares
    # `type(model).compile` with `Trainer.compile` to spot a custom compile, and would
    # then skip compiling a loaded or unpickled model.
    owner = next(c for c in type.mro(keras.Model) if "compile" in vars(c))
    owner.compile = compile
    for name in ROUTED_METHODS:
        setattr(keras.Model, name, routed(name))
