"""The shape the code keeps (CONVENTIONS.md): sizes a reader can hold, layers that point one way.

Read with Python's `ast` over the project's packages, as a newcomer's first look would:
no module over 600 lines, no class over 400, no function over 60 (Triton kernels aside: a
kernel is one fused loop and reads best whole), no import cycle among first-party modules,
libs/ importing neither services/ nor apps/, proto/ importing none of them, and no service
importing another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apps", "libs", "proto", "services")
# The coding domain's task data (starting code the agent fixes) is not project code.
TASK_DATA_FOLDER = "tasks"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int
    imports: set[str] = field(default_factory=set)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if TASK_DATA_FOLDER not in path.relative_to(ROOT).parts[:-1]:
                yield path


def load_modules() -> dict[str, Module]:
    modules = {}
    for path in project_files():
        source = path.read_text()
        name = module_name(path)
        modules[name] = Module(name, path, ast.parse(source), source.count("\n"))
    for module in modules.values():
        module.imports = imported_modules(module, set(modules))
    return modules


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that runs, at module level or in a function; not those for type checkers."""
    for node in ast.iter_child_nodes(tree):
        if is_type_checking_block(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from import_nodes(node)


def imported_modules(module: Module, known: set[str]) -> set[str]:
    """First-party modules `module` imports: `from a.b import c` names a.b.c when c is a
    module, else a.b."""
    found = set()
    for node in import_nodes(module.tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= (submodules & known) or {node.module}
    return {name for name in found if name in known and name != module.name}


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(modules[name].imports):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while (top := stack.pop()) != name:
                component.append(top)
            if component:
                found.append(sorted([name, *component]))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("triton" in ast.unparse(decorator) for decorator in node.decorator_list)


def span(node: ast.stmt) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return load_modules()


def test_no_module_is_over_600_lines(modules: dict[str, Module]) -> None:
    long = {m.name: m.lines for m in modules.values() if m.lines > MAX_MODULE_LINES}
    assert not long, f"split these modules (lines): {long}"


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def oversized(
    modules: dict[str, Module], kinds: tuple[type[Definition], ...], max_lines: int
) -> dict[str, int]:
    """Definitions of these kinds longer than `max_lines`, by qualified name; kernels aside."""
    return {
        f"{m.name}.{node.name}": span(node)
        for m in modules.values()
        for node in ast.walk(m.tree)
        if isinstance(node, Definition)
        and isinstance(node, kinds)
        and span(node) > max_lines
        and not (isinstance(node, ast.FunctionDef) and is_triton_kernel(node))
    }


def test_no_class_is_over_400_lines(modules: dict[str, Module]) -> None:
    long = oversized(modules, (ast.ClassDef,), MAX_CLASS_LINES)
    assert not long, f"split these classes into components (lines): {long}"


def test_no_function_but_triton_kernels_is_over_60_lines(modules: dict[str, Module]) -> None:
    long = oversized(modules, (ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, f"split these functions (lines): {long}"


def test_first_party_imports_have_no_cycle(modules: dict[str, Module]) -> None:
    assert cycles(modules) == []


def test_libs_import_neither_services_nor_apps(modules: dict[str, Module]) -> None:
    upward = {
        m.name: sorted(i for i in m.imports if i.startswith(("services", "apps")))
        for m in modules.values()
        if m.name.startswith("libs")
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_proto_imports_no_other_layer(modules: dict[str, Module]) -> None:
    upward = {
        m.name: sorted(i for i in m.imports if not i.startswith("proto"))
        for m in modules.values()
        if m.name.startswith("proto")
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_no_service_imports_another(modules: dict[str, Module]) -> None:
    def service_of(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if parts[0] == "services" and len(parts) > 1 else None

    crossing = {
        m.name: sorted(
            i for i in m.imports if service_of(i) and service_of(i) != service_of(m.name)
        )
        for m in modules.values()
        if service_of(m.name)
    }
    assert {name: found for name, found in crossing.items() if found} == {}
