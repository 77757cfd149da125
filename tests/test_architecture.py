"""The package's shape: imports only run downwards and never in a circle; every error in one place.

Layers, top to bottom: the programs (daemon) → reading a run back (report) → the cycle runner
(cycle) and the dry run of a job (plan) → the config → engines →
protocols → the pure tables (state) and logging → leaf utilities (errors, units, levels, durable,
runtime, torch_quiet), and errors.py under all. A package may import its own modules and
anything below it, never above.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import timeshare
from timeshare import errors
from timeshare.engines.registry import ENGINES

PACKAGE = Path(timeshare.__file__).parent
# The entry points, by exact name: a prefix "timeshare" would hold every module, and "every
# module has a layer" could not fail.
ENTRY_POINTS = {"timeshare": 8, "timeshare.__main__": 8}
LAYERS = {
    "timeshare.daemon": 7,
    "timeshare.report": 6,  # what a run did, read back from its directory
    "timeshare.cycle": 5,
    "timeshare.capacity": 5,  # whether a job fits its cluster, from its config alone (a dry run)
    "timeshare.config": 4,
    "timeshare.engines": 3,
    "timeshare.protocols": 2,
    "timeshare.task": 2,  # the job's data, tokenizer and stop set, engine-free (engines import it)
    "timeshare.rewards": 2,  # the built-in reward functions a job names (task/reward_function.py)
    "timeshare.state": 1,
    "timeshare.logs": 1,
    "timeshare.torch_quiet": 0,  # torch's C++ log level for the fronts, set before torch loads
    "timeshare.errors": -1,  # the root of every error: below everything
    "timeshare.units": 0,
    "timeshare.timing": 0,  # spans: what a process did when (the trace's raw material)
    "timeshare.levels": 0,
    "timeshare.durable": 0,
    "timeshare.runtime": 0,
    "timeshare.rotating": 0,  # a file several processes append lines to, rotated at a size
    "timeshare.cluster": 0,  # [cluster], from the file or a launcher (config reads it)
}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every timeshare module `name` imports, wherever the import stands (lazy and
    TYPE_CHECKING ones included); `from package import module` counts as the module."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def layer(module: str) -> tuple[str, int]:
    if module in ENTRY_POINTS:
        return module, ENTRY_POINTS[module]
    owners = [p for p in LAYERS if module == p or module.startswith(f"{p}.")]
    if not owners:
        raise LookupError(f"{module} belongs to no layer: place it in LAYERS")
    owner = max(owners, key=len)
    return owner, LAYERS[owner]


def test_every_module_has_a_layer() -> None:
    for module in graph():
        layer(module)  # raises for a module outside every layer


def test_a_module_outside_every_layer_is_named() -> None:
    with pytest.raises(LookupError, match=r"timeshare\.newcomer belongs to no layer"):
        layer("timeshare.newcomer")
    assert layer("timeshare.engines.vllm.engine") == ("timeshare.engines", 3)


def test_imports_run_downwards() -> None:
    upwards = []
    for module, imported in graph().items():
        owner, level = layer(module)
        for target in imported:
            target_owner, target_level = layer(target)
            if target_owner != owner and target_level >= level:
                upwards.append(f"{module} -> {target}")
    assert upwards == [], "imports that do not run downwards:\n" + "\n".join(sorted(upwards))


def test_no_module_imports_itself_in_a_circle() -> None:
    edges = graph()
    cycles = [component for component in _strongly_connected(edges) if len(component) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def engine_packages() -> set[str]:
    """The package of every registered engine (where its spec module lives)."""
    return {entry.spec.partition(":")[0].rpartition(".")[0] for entry in ENGINES.values()}


def engine_package(module: str) -> str | None:
    """The registered engine's package `module` belongs to, if any."""
    for package in engine_packages():
        if module == package or module.startswith(f"{package}."):
            return package
    return None


def test_every_engine_is_a_package_of_its_own() -> None:
    modules = module_names()
    for package in engine_packages():
        assert package.startswith("timeshare.engines."), package
        assert modules.get(package, Path()).name == "__init__.py", f"{package}: no __init__.py"


def test_no_engine_package_imports_another() -> None:
    # An engine is a plug-in: what engines share (the task, GRPO, the model's keys, the
    # contract) lives in timeshare/engines/ itself, never in another engine's package.
    crossing = []
    for module, imported in graph().items():
        own = engine_package(module)
        if own is None:
            continue
        for target in imported:
            other = engine_package(target)
            if other is not None and other != own:
                crossing.append(f"{module} -> {target}")
    assert crossing == [], "engine packages importing each other:\n" + "\n".join(crossing)


def test_the_shared_engine_modules_name_no_engine() -> None:
    # timeshare/engines/*.py serve every engine: only the registry names them (as strings).
    named = [
        f"{module} -> {target}"
        for module, imported in graph().items()
        if module.startswith("timeshare.engines.") and engine_package(module) is None
        for target in imported
        if engine_package(target) is not None
    ]
    assert named == [], "shared engine modules importing an engine:\n" + "\n".join(named)


def test_every_error_lives_in_errors_py_under_the_root_and_says_when() -> None:
    defined_elsewhere = []
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="timeshare."):
        if info.name.endswith("__main__") or info.name == errors.__name__:
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            is_error = inspect.isclass(value) and issubclass(value, BaseException)
            if is_error and value.__module__ == info.name and not name.startswith("_"):
                defined_elsewhere.append(f"{info.name}.{name}")
    assert defined_elsewhere == []
    for name, value in vars(errors).items():
        is_error = inspect.isclass(value) and issubclass(value, BaseException)
        if is_error and value.__module__ == errors.__name__:
            assert issubclass(value, errors.TimeshareError), name
            assert value.__doc__ and "aised" in value.__doc__, f"{name}: say when it is raised"


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root, targets in edges.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components
