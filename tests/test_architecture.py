"""The package's layers, checked from the source: no import cycles, nothing imports upward,
and `core/plan`, `deepspeed` and `config` stay free of TensorFlow (epl-plan and the
launcher need none).

Layers, lowest first (docs/architecture.md):

0. `config`: the typed config, pure Python;
1. `core.plan` (Plan, planner, schedules, estimates, combination rules; no TensorFlow),
   `core.comm` (TF's collectives) and `deepspeed` (a DeepSpeed JSON read into config
   keys and descriptions; pure Python);
2. `core.graph`: cutting and costing the Keras graph;
3. `core.engine` (state, steps, passes) and `annotations` (the user's scopes and marks);
4. `runtime`: the cluster, `epl.init`, the launcher, the watchdog, the absl flags,
   epl-plan;
5. `training` (the Keras-facing trainer, which builds what `deepspeed` describes),
   `layers`, the package's lobby.

A module may import its own layer or lower ones. `core` never imports `annotations`:
the trainer hands the engine plain data. The engine's parallelism folders (`zero/`,
`pipeline/`, `split/`, `precision/`, `update/`) are reached from outside only through
the surface their `__init__` lists (`core/engine/surface.py`), and the pipeline executor
reaches the other parallelisms only through the step's hooks.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "epl_trainer"

LAYERS = [  # (module prefix, layer); the longest matching prefix wins
    ("epl_trainer.config", 0),
    ("epl_trainer.core.plan", 1),
    ("epl_trainer.core.comm", 1),
    ("epl_trainer.deepspeed", 1),
    ("epl_trainer.core.graph", 2),
    ("epl_trainer.core.engine", 3),
    ("epl_trainer.annotations", 3),
    ("epl_trainer.runtime", 4),
    ("epl_trainer", 5),
]
ENGINE = "epl_trainer.core.engine"
PARALLELISMS = tuple(
    f"{ENGINE}.{name}" for name in ("zero", "pipeline", "split", "precision", "update")
)
TENSORFLOW = ("tensorflow", "keras")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def surface_of(package: str) -> dict[str, str]:
    """A parallelism folder's surface, read from its `lazy_surface(__name__, {...})`:
    exported name -> the folder's module that defines it."""
    tree = ast.parse(MODULES[package].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "lazy_surface":
            table = ast.literal_eval(node.args[1])
            return {name: f"{package}.{module}" for name, module in table.items()}
    return {}


SURFACES = {package: surface_of(package) for package in PARALLELISMS}


def imports_of(name: str) -> tuple[set[str], set[str]]:
    """(epl_trainer modules `name` imports, other top-level packages it imports).

    A name imported from a parallelism folder's surface counts as an import of the
    module that defines it (the folder's `__init__` loads it on first use)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    ours, others = set(), set()

    def add(module: str) -> None:
        if module.split(".")[0] == "epl_trainer":
            ours.add(module)
        else:
            others.add(module.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from package import module` imports the module, not the package.
                full = f"{base}.{alias.name}"
                add(full if full in MODULES else SURFACES.get(base, {}).get(alias.name, base))
    ours.discard(name)
    return {m for m in ours if m in MODULES and m != "epl_trainer"}, others


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    matches = [(len(prefix), layer) for prefix, layer in LAYERS if
               name == prefix or name.startswith(prefix + ".")]  # fmt: skip
    return max(matches)[1]


def test_the_layers_cover_the_package():
    assert len(MODULES) > 60
    for name in MODULES:
        assert layer_of(name) is not None


def test_no_import_cycles():
    edges = {name: ours for name, (ours, _) in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail("Import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*stack, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])


def test_nothing_imports_upward():
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, (ours, _) in GRAPH.items()
        for target in sorted(ours)
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_the_engine_does_not_import_the_annotation_api():
    wrong = [
        f"{name} imports {target}"
        for name, (ours, _) in GRAPH.items()
        if name.startswith("epl_trainer.core")
        for target in ours
        if target.startswith("epl_trainer.annotations")
    ]
    assert wrong == []


def test_core_plan_imports_no_tensorflow_even_indirectly():
    plan = [name for name in MODULES if name.startswith("epl_trainer.core.plan")]
    assert "epl_trainer.core.plan.rules" in plan and len(plan) >= 6
    for name in plan:
        ours, others = GRAPH[name]
        assert not others & set(TENSORFLOW), f"{name} imports {others & set(TENSORFLOW)}"
        outside = {m for m in ours if not m.startswith("epl_trainer.core.plan")}
        assert not outside, f"{name} imports {outside} (core/plan imports only core/plan)"


def reachable(name: str) -> set[str]:
    """`name` and every epl_trainer module it imports, directly or not."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH[module][0])
    return seen


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_deepspeed_and_config_import_nothing_above_them():
    """`deepspeed` turns a DeepSpeed config into data (config keys, descriptions of the
    optimizer, schedule and monitors) that `training` builds from: imports run one way,
    training -> deepspeed -> config. `config` is the floor: it imports only itself. Both
    stay free of TensorFlow, even indirectly (the flags and epl-plan read them)."""
    allowed = {
        "epl_trainer.deepspeed": ("epl_trainer.deepspeed", "epl_trainer.config"),
        "epl_trainer.config": ("epl_trainer.config",),
    }
    wrong = []
    for package, inside in allowed.items():
        modules = [name for name in MODULES if in_package(name, package)]
        assert len(modules) >= 4, package
        for name in modules:
            for target in sorted(reachable(name)):
                if not any(in_package(target, p) for p in inside):
                    wrong.append(f"{name} imports {target}")
                if GRAPH[target][1] & set(TENSORFLOW):
                    wrong.append(f"{name} imports TensorFlow (through {target})")
    assert wrong == []


def test_the_checks_see_a_violation():
    """The graph reader itself: a relative and a `from package import module` import."""
    assert "epl_trainer.core.engine.precision.amp" in GRAPH["epl_trainer.core.engine.builder"][0]
    assert "epl_trainer.core.comm.group" in GRAPH["epl_trainer.core.comm.fusion"][0]
    assert "tensorflow" in GRAPH["epl_trainer.core.comm.group"][1]
    assert layer_of("epl_trainer.core.engine.state") == 3
    assert layer_of("epl_trainer.training.trainer") == 5
    assert layer_of("epl_trainer.runtime.cluster") == 4
    assert "epl_trainer.deepspeed.translate" in GRAPH["epl_trainer.training.deepspeed_run"][0]
    assert layer_of("epl_trainer.deepspeed.translate") == 1
    assert layer_of("epl_trainer.config") == layer_of("epl_trainer.config.keys") == 0


def direct_imports(name: str) -> set[str]:
    """The epl_trainer modules `name` names in its import statements, as written."""
    tree = ast.parse(MODULES[name].read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {m for m in named if m in MODULES}


def folder_of(name: str) -> str | None:
    return next((p for p in PARALLELISMS if name == p or name.startswith(p + ".")), None)


def test_a_parallelism_is_reached_only_through_its_surface():
    """No module imports another folder's modules directly, only the names its
    `__init__` exports (tests may reach inside; the package may not)."""
    reaching_in = [
        f"{name} imports {target}"
        for name in MODULES
        for target in sorted(direct_imports(name))
        if folder_of(target)
        and target != folder_of(target)
        and folder_of(name) != folder_of(target)
    ]
    assert reaching_in == []


def test_surfaces_name_what_their_modules_define():
    for package, surface in SURFACES.items():
        assert surface, f"{package} lists no surface"
        for exported, module in surface.items():
            tree = ast.parse(MODULES[module].read_text())
            defined = {
                getattr(node, "name", None) or target.id
                for node in tree.body
                for target in ([node] if not isinstance(node, ast.Assign) else node.targets)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign))
                and isinstance(target, (ast.FunctionDef, ast.ClassDef, ast.Name))
            }
            assert exported in defined, f"{package} exports {exported!r}, not defined in {module}"


def test_the_pipeline_executor_reaches_other_parallelisms_only_through_hooks():
    pipeline = f"{ENGINE}.pipeline"
    wrong = [
        f"{name} imports {target}"
        for name, (ours, _) in GRAPH.items()
        if folder_of(name) == pipeline
        for target in sorted(ours)
        if folder_of(target) not in (None, pipeline)
    ]
    assert wrong == []
