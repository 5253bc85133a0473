"""No import circles: every module of a package must be importable before its importers.

Imports inside functions count (a lazy import only hides a circle); imports under
`if TYPE_CHECKING:` do not, since they never run.
"""

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST):
    """Import nodes that can run: everything except the body of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> modules of `package` it imports, for every .py under root/package.

    `root` is the directory holding the top-level package. `from pkg import name` adds an
    edge to pkg (its __init__ runs) and, when `name` is a submodule, to that submodule.
    """
    files = {
        _module_name(p, root): p for p in sorted((root / package.replace(".", "/")).rglob("*.py"))
    }

    def nearest_module(name: str) -> str | None:
        # `import a.b.c` runs a, a.b and a.b.c; each is an edge when it is a module here.
        return name if name in files else None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        # Importing this module has already run every enclosing package's __init__, so a
        # plain `import pkg.x` or `from pkg.x import y` adds no ordering on pkg itself.
        ancestors = _ancestors(module)
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    edges.update(
                        m for i in range(1, len(parts) + 1) if (m := nearest_module(".".join(parts[:i])))
                    )
                edges -= ancestors
                continue
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            parts = source.split(".")
            edges.update(
                m
                for i in range(1, len(parts))
                if (m := nearest_module(".".join(parts[:i]))) and m not in ancestors
            )
            names_a_submodule = True
            for alias in node.names:
                if (sub := nearest_module(f"{source}.{alias.name}")) is not None:
                    edges.add(sub)
                else:
                    names_a_submodule = False
            if (m := nearest_module(source)) is not None and (
                m not in ancestors or not names_a_submodule
            ):
                # A name read from an enclosing package's __init__ needs that __init__ to
                # have run to its end first: an edge even though the package is an ancestor.
                edges.add(m)
        edges.discard(module)
        graph[module] = edges
    return graph


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def successors(v: str):
        return sorted(w for w in graph.get(v, ()) if w in graph)

    for start in sorted(graph):
        if start in index:
            continue
        # Iterative Tarjan: deep package graphs would exceed the recursion limit.
        work = [(start, iter(successors(start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(successors(w))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def describe_cycle(graph: dict[str, set[str]], component: list[str]) -> str:
    """One line per module of the component: the modules of the component it imports."""
    members = set(component)
    return "\n".join(
        f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in component
    )


def _assert_acyclic(root: Path, package: str):
    graph = import_graph(root, package)
    cycles = import_cycles(graph)
    report = "\n\n".join(describe_cycle(graph, c) for c in cycles)
    assert not cycles, f"{len(cycles)} import circle(s) in {package}:\n{report}"


def test_finds_a_circle_through_a_lazy_import_and_ignores_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n"
    )
    (pkg / "e.py").write_text("from . import d\n")
    (pkg / "f.py").write_text("from pkg import VALUE\nimport pkg.sub\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set()
    assert graph["pkg.e"] == {"pkg.d"}
    # A name read from the enclosing package's __init__ orders that __init__ first.
    assert graph["pkg.f"] == {"pkg", "pkg.sub"}
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_a_package_init_importing_a_module_that_reads_it_is_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.m import g\nVALUE = 1\n")
    (pkg / "m.py").write_text("from pkg import VALUE\n\ndef g():\n    return VALUE\n")
    assert import_cycles(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.m"]]


def test_sglang_has_no_import_circles():
    _assert_acyclic(REPO_ROOT / "python", "sglang")


def test_dsv4_kernels_have_no_import_circles():
    _assert_acyclic(REPO_ROOT / "sgl-kernel" / "python", "dsv4_kernels")


def test_configs_are_a_leaf():
    """Config dataclasses, presets and their loading import nothing of the runtime: the model,
    the pools and the planners all depend on configs, never the other way."""
    graph = import_graph(REPO_ROOT / "python", "sglang")
    configs = {m: deps for m, deps in graph.items() if m.startswith("sglang.srt.configs")}
    assert {"sglang.srt.configs.deepseek_v4", "sglang.srt.configs.presets", "sglang.srt.configs.loader"} <= set(configs)
    outside = {m: sorted(d for d in deps if not d.startswith("sglang.srt.configs")) for m, deps in configs.items()}
    assert all(not deps for deps in outside.values()), outside
