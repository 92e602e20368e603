"""The package's import graph has no cycle: no module imports, directly or through others, a module that imports
it back (the trainer <-> policies <-> text backend and image base <-> family cycles of old). Imports inside
functions (lazy ones) count too: they were how those cycles hid."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flowrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The flowrl modules (and `from M import name` targets M.name) that `path` imports anywhere, at import time
    or in a function; not under `if TYPE_CHECKING:` (never run)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("flowrl"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if target.startswith("flowrl"):
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
            else:
                visit(list(ast.iter_child_nodes(node)))
    visit(ast.parse(path.read_text()).body)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {t for t in imports_of(path) if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_inside_flowrl():
    graph = import_graph()
    assert len(graph) > 30 and "flowrl.trainer" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_and_the_families_package_import_no_backend_library():
    """flowrl.core never imports diffusers or transformers; nor does importing flowrl.families (its family modules
    import diffusers lazily, inside the functions that need it)."""
    import subprocess
    import sys

    code = ("import sys, flowrl.core, flowrl.families; flowrl.families.family_names(); "
            "print(sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
