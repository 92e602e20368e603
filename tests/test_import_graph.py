"""The import graph of flowrl/ and rewards/ together has no cycle: no module imports, directly or through others, a
module that imports it back (the trainer <-> policies <-> text backend and image base <-> family cycles of old), and
flowrl -> rewards -> flowrl counts like any other (rewards.registry uses flowrl.core.registry; flowrl builds rewards).
The nodes are modules, not packages. Imports inside functions (lazy ones) count too: they were how those cycles hid.

The packages meet through public names only: no flowrl module imports a private module or name of rewards
(`rewards._common`, `rewards.registry._checked`), no rewards module a private one of flowrl, and no subpackage of
flowrl a private one of another (`flowrl.families._loading` from `flowrl.plan`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowrl", "rewards")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def import_statements(path: Path, root: Path = ROOT) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of each import of flowrl or rewards in `path`, at import time or in a function, not under
    `if TYPE_CHECKING:` (never run): `import M` gives (M, ()), `from M import a, b` gives (M, (a, b)), relative
    imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.extend((a.name, ()) for a in node.names if ours(a.name))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if ours(target):
                    found.append((target, tuple(a.name for a in node.names)))
            else:
                visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(path.read_text()).body)
    return found


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """The flowrl and rewards modules (and `from M import name` targets M.name) that `path` imports."""
    found = set()
    for target, names in import_statements(path, root):
        found.add(target)
        found.update(f"{target}.{n}" for n in names)  # `from pkg import module`
    return found


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(root)
    return {name: {t for t in imports_of(path, root) if t in found and t != name} for name, path in found.items()}


def private(dotted: str) -> bool:
    """Whether a dotted name has a private part (`_x`; dunders such as `__version__` are public)."""
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def package_of(module: str, root: Path = ROOT) -> str:
    """The package a module belongs to for the private-name rule: `rewards`; a subpackage of flowrl (`flowrl.plan`,
    `flowrl.families`, ...); or `flowrl` itself for its top-level modules."""
    parts = module.split(".")
    if parts[0] == "flowrl" and len(parts) > 1 and (root / "flowrl" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def private_imports(root: Path = ROOT) -> set[tuple[str, str]]:
    """(importing module, dotted name) for each private module or name of one package that a module of another
    imports: rewards and flowrl, and flowrl's subpackages among themselves; within a package private names are its
    own business."""
    found = set()
    for name, path in modules(root).items():
        for target, names in import_statements(path, root):
            if package_of(target, root) == package_of(name, root):
                continue
            for dotted in [f"{target}.{n}" for n in names] or [target]:
                if private(dotted):
                    found.add((name, dotted))
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
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


def test_no_import_cycle_in_flowrl_and_rewards():
    graph = import_graph()
    assert len(graph) > 50 and "flowrl.train" in graph and "rewards.weighted" in graph
    assert "flowrl.core.registry" in graph["rewards.registry"]  # the edges between the packages are in the graph
    assert "rewards" in graph["flowrl.preflight"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_packages_import_only_each_others_public_names():
    found = sorted(private_imports())
    assert not found, "imports of the other package's private modules or names (make them public): " + ", ".join(
        f"{module} imports {name}" for module, name in found
    )


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_private_import_finder_finds_them(tmp_path):
    """Modules, names and relative forms; a package's own private names and dunders pass."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "flowrl" / "a.py").write_text(
        "import rewards._common\nfrom rewards import _wire, get\nfrom flowrl import _own\n"
        "from flowrl import __version__\n"
        "def f():\n    from rewards.registry import _checked\n"
    )
    (tmp_path / "rewards" / "b.py").write_text("from . import _common\nfrom flowrl.video import _frames, aggregate\n")
    # flowrl's subpackages among themselves: a private module or name of another is flagged, its own are not
    for sub in ("plan", "families"):
        (tmp_path / "flowrl" / sub).mkdir()
        (tmp_path / "flowrl" / sub / "__init__.py").write_text("")
    (tmp_path / "flowrl" / "plan" / "m.py").write_text(
        "from flowrl.families._loading import _read, public\nfrom ._own import x\nfrom flowrl.families import ok\n"
    )
    assert private_imports(tmp_path) == {
        ("flowrl.a", "rewards._common"),
        ("flowrl.a", "rewards._wire"),
        ("flowrl.a", "rewards.registry._checked"),
        ("rewards.b", "flowrl.video._frames"),
        ("flowrl.plan.m", "flowrl.families._loading._read"),
        ("flowrl.plan.m", "flowrl.families._loading.public"),
    }


def test_the_core_and_the_families_package_import_no_backend_library():
    """flowrl.core never imports diffusers or transformers; nor does importing flowrl.families (its family modules
    import diffusers lazily, inside the functions that need it)."""
    import subprocess
    import sys

    code = (
        "import sys, flowrl.core, flowrl.families; flowrl.families.family_names(); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
