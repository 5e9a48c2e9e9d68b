"""The library's modules import each other without a circle, and its packages import only
packages below them in :data:`LAYERS` (imports point down the pipeline).

The graph is read from the source (``ast``), so it also sees imports made inside
functions: a lazy import that only dodges a circle is still a circle.
"""

import ast
import pathlib
from typing import Dict, List, Set

import megatron_async

PACKAGE_ROOT = pathlib.Path(megatron_async.__file__).parent
PACKAGE = "megatron_async"

LAYERS = (
    ("__main__",),
    ("cli", "manager", "state_dict_saver", "filesystem_async"),
    ("mcore", "nvrx"),
    ("torch_ckpt", "local"),
    ("saver",),
    ("writer",),
    ("staging",),
    ("integrity",),
    ("checkpoint_dirs",),
    ("storage",),
    ("core",),
    ("buckets", "format"),
    ("errors",),
)
"""The library's subpackages and top-level modules, top to bottom: each imports only units
of the layers below its own. At the top the command line and the API a user imports (and
the modules that re-export the reference libraries' names), then the megatron-core
strategy and nvidia-resiliency-ext's surface, then the save pipeline from the saver down
to the storage backends and the async machinery, and at the bottom the models every stage
shares: the write buckets, the on-disk format and the errors. The package root
(``megatron_async/__init__.py``) is outside the layers: it is the package's map, whose
lazy names point into every layer, and every import of a submodule runs it first."""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}


def _imported(node: ast.AST, module: str, is_package: bool, known: Set[str]) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        submodule = f"{target}.{alias.name}"
        if submodule in known:
            found.append(submodule)
        elif target in known:
            found.append(target)
    return found


def import_graph() -> Dict[str, Set[str]]:
    """Every library module and the library modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_type_checking(node.test)
            for inner in ast.walk(node)
        }
        edges = set()
        for node in ast.walk(tree):
            if id(node) not in typing_only:
                edges.update(_imported(node, name, is_package, set(modules)))
        graph[name] = edges - {name}
    return graph


def _is_type_checking(test: ast.AST) -> bool:
    return isinstance(test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(test)


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_pipeline():
    graph = import_graph()
    assert "megatron_async.core.coordination" in graph["megatron_async.core.queue"]


def test_no_import_circle_among_library_modules():
    found = circles(import_graph())
    assert not found, "import circles (each list imports itself through the others):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def _unit(module: str) -> str:
    """The layer unit of a library module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """Every import of a unit in the same or a higher layer, and every unit not in a layer."""
    layer_of = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
    found = []
    for module, imported in sorted(graph.items()):
        unit = _unit(module)
        if not unit:
            continue  # the package root (see LAYERS)
        if unit not in layer_of:
            found.append(f"{module}: {unit!r} is in no layer of LAYERS (place it)")
            continue
        for target in sorted(imported):
            other = _unit(target)
            if other and other != unit and layer_of.get(other, -1) <= layer_of[unit]:
                found.append(f"{module} imports {target} ({other!r} is not below {unit!r})")
    return found


def test_no_package_imports_a_package_above_it():
    found = upward_imports(import_graph())
    assert not found, "imports that do not point down LAYERS:\n" + "\n".join(found)
