"""A griffe extension: the public names `epl_trainer/__init__.py` exports lazily.

The package's `__init__` imports nothing eagerly (so `epl-launch` and the config start
without TensorFlow); a module `__getattr__` looks each public name up in the `_EXPORTS`
dict {name: defining module}. Griffe reads source statically and does not run
`__getattr__`, so it sees none of those names. This extension reads the same dict from
the source, as a literal, and adds each name to the package as an alias of
`<module>.<name>`, so the API reference can say `::: epl_trainer.EPLTrainer` and keeps
working when the defining module moves (the dict is the one place that says where).
"""

import ast

import griffe

PACKAGE = "epl_trainer"
EXPORTS = "_EXPORTS"


def _exports_literal(module_node: ast.Module) -> dict[str, str]:
    """The `_EXPORTS = {...}` assignment of the module, evaluated as a literal."""
    for statement in module_node.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == EXPORTS for target in statement.targets
        ):
            return ast.literal_eval(statement.value)
    raise ValueError(f"{PACKAGE}/__init__.py has no {EXPORTS} = {{...}} literal")


class LazyExports(griffe.Extension):
    """Adds `epl_trainer.<name>` aliases for every entry of `_EXPORTS`."""

    def on_module_members(self, *, node, mod, **kwargs) -> None:
        if mod.path != PACKAGE or not isinstance(node, ast.Module):
            return
        for name, module in _exports_literal(node).items():
            mod.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=mod))
