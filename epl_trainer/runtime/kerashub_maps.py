"""KerasHub's own layout maps for `epl-plan --layout_map` (core/plan/kerashub_layouts.py
describes the variables; this asks KerasHub for their layouts).

`kerashub_layout(family, mesh)` calls the family backbone's `get_layout_map` on a
`keras.distribution.DeviceMesh` of device names that need not exist (Keras checks only
their count) and looks each path up the way Keras does (`layout_map[path]`: the exact
key, else the one regex that fully matches; no match is replicated). Its regexes are not
copied, so a new KerasHub release's map is the one planned. It imports keras and
keras_hub (and the Keras backend), which is why it lives outside `core/plan`, whose
arithmetic never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable

from epl_trainer.core.plan import kerashub_layouts


def kerashub_layout(family: str, mesh_shape) -> Callable[[str], tuple | None]:
    """path -> the layout's axes (None: replicated) under KerasHub's own layout map."""
    import keras
    import keras_hub

    shape = kerashub_layouts.check_mesh(mesh_shape)
    mesh = keras.distribution.DeviceMesh(
        shape, kerashub_layouts.MESH_AXES, devices=kerashub_layouts.device_names(shape)
    )
    backbone = kerashub_layouts.FAMILIES[family].backbone
    layout_map = getattr(keras_hub.models, backbone).get_layout_map(mesh)

    def layout_of(path: str):
        layout = layout_map[path]  # Keras's lookup: exact key, else one fullmatch
        return None if layout is None else tuple(layout.axes)

    return layout_of


def kerashub_placement(
    family: str, sizes: kerashub_layouts.DecoderSizes, mesh_shape
) -> kerashub_layouts.Placement:
    """The family's variables placed by its own KerasHub layout map on `mesh_shape`."""
    listed = kerashub_layouts.variables(family, sizes)  # size errors before keras loads
    layout_of = kerashub_layout(family, mesh_shape)
    return kerashub_layouts.place(family, listed, layout_of, mesh_shape)
