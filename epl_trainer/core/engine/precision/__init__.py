"""Mixed precision and loss scaling (`amp`), and updates applied only when every lane's
gradients are finite (`finite`)."""

from epl_trainer.core.engine.surface import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(
    __name__,
    {
        "MinLossScaleError": "amp",
        "min_scale_error": "amp",
        "apply_mixed_precision": "amp",
        "unscale_gradients": "amp",
        "apply_amp": "finite",
        "apply_nonfinite_guard": "finite",
    },
)
