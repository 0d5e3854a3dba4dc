"""The house's shape, read from the source with ``ast``: no import circles, the
gateway and the worker never import each other (both may import the execution
package below them, which imports neither), the offline packages import
no server, inside the gateway imports run down its declared layers (the list
in ``gateway/__init__.py``'s docstring), and no module outgrows one concept.

Every import counts, including those under ``TYPE_CHECKING`` and inside
functions: a circle hidden from the interpreter is still a circle for a reader.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infergate", "gateway", "workers", "execution", "splitter", "batchjobs", "serverkit", "protos", "loadtest", "models")
# A module holds one concept, as long as that concept needs (docs/architecture.md, "Modules"):
# past WARN_LINES it usually holds two, and the suite says so without failing; past MAX_LINES
# it certainly does.
WARN_LINES = 600
MAX_LINES = 1000
# Who may not import whom (importer package -> forbidden packages).
FORBIDDEN = {
    "gateway": {"workers", "loadtest", "batchjobs"},
    "workers": {"gateway", "splitter", "loadtest", "batchjobs"},
    # Model execution sits below both servers: the worker serves it, the gateway
    # may run it in-process; it imports neither.
    "execution": {"gateway", "workers", "splitter", "loadtest", "batchjobs"},
    "splitter": {"gateway", "workers", "execution", "loadtest", "batchjobs"},
    "batchjobs": {"gateway", "workers", "execution", "splitter"},
    "loadtest": {"gateway", "workers", "execution", "splitter", "batchjobs"},
    "serverkit": {"gateway", "workers", "execution", "splitter", "loadtest", "batchjobs"},
    "protos": {"gateway", "workers", "execution", "splitter", "loadtest", "batchjobs", "serverkit"},
    "models": {"gateway", "workers", "execution", "splitter", "loadtest", "batchjobs"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that ``name`` imports (the leaf module of each import)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif target in known:
                    found.add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve(tmp_path: Path) -> None:
    known = {"pkg.a", "pkg.sub.b", "pkg.sub"}
    path = tmp_path / "b.py"
    path.write_text("from .. import a\nfrom . import b\nfrom ..sub.b import x\n")
    assert imports_of("pkg.sub.c", path, known) == {"pkg.a", "pkg.sub.b"}


def test_no_import_circles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_they_may(package: str) -> None:
    bad = []
    for name, targets in import_graph().items():
        if name.split(".")[0] != package:
            continue
        for target in sorted(targets):
            if target.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{name} imports {target}")
    assert not bad, "\n".join(bad)


# ---- layers inside the gateway -----------------------------------------------------

# A layer line of the gateway's docstring: "3. ``types``: what it owns" (several
# names on one line, comma-separated, make one layer).
_LAYER_LINE = re.compile(r"^\s*\d+\.\s+((?:``[A-Za-z_]\w*``(?:,\s*)?)+):")


def declared_layers(doc: str) -> list[tuple[str, ...]]:
    """The layers a docstring declares, lowest first, each the names on its line."""
    return [tuple(re.findall(r"``(\w+)``", m.group(1))) for line in doc.splitlines()
            if (m := _LAYER_LINE.match(line))]


def gateway_layers() -> list[tuple[str, ...]]:
    return declared_layers(ast.get_docstring(ast.parse((ROOT / "gateway" / "__init__.py").read_text())) or "")


def layering_violations(graph: Mapping[str, set[str]], layers: Sequence[tuple[str, ...]],
                        paths: Mapping[str, str], root: str = "gateway") -> list[str]:
    """Every import inside ``root`` from a lower layer into a higher one, and every
    module of ``root`` in no layer; each names the files involved.

    A module's layer is its first name below ``root`` (``gateway.fleet.drain`` is
    in ``fleet``; ``gateway.core`` in ``core``); ``root`` itself is importable by all.
    """
    rank = {name: i for i, layer in enumerate(layers) for name in layer}

    def layer_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == root and len(parts) > 1 else None

    bad = []
    for importer, targets in sorted(graph.items()):
        if (low := layer_of(importer)) is None:
            continue
        if low not in rank:
            bad.append(f"{paths[importer]}: '{low}' is in no layer of {root}/__init__.py's docstring")
            continue
        for target in sorted(targets):
            high = layer_of(target)
            if high is not None and high in rank and rank[high] > rank[low]:
                bad.append(f"{paths[importer]} imports {paths[target]}: layer {rank[low] + 1} '{low}' "
                           f"may not import layer {rank[high] + 1} '{high}'")
    return bad


def test_layering_check_names_both_files_of_a_planted_violation() -> None:
    layers = [("low",), ("mid", "side"), ("high",)]
    graph = {
        "pkg.low.a": {"pkg.high.b", "pkg"},        # against the order
        "pkg.mid": {"pkg.side.c", "pkg.low.a"},    # the same layer, and a lower one
        "pkg.high.b": {"pkg.mid", "pkg.low.a"},    # lower ones
        "pkg.side.c": set(),
        "pkg.stray": {"pkg.low.a"},                 # in no layer
        "pkg": set(),
    }
    paths = {name: name.replace(".", "/") + ".py" for name in graph}
    assert layering_violations(graph, layers, paths, root="pkg") == [
        "pkg/low/a.py imports pkg/high/b.py: layer 1 'low' may not import layer 3 'high'",
        "pkg/stray.py: 'stray' is in no layer of pkg/__init__.py's docstring",
    ]


def test_layers_are_read_from_the_gateway_docstring() -> None:
    doc = "Intro.\n\n1. ``a``: owns a.\n2. ``b``, ``c``: own b and c.\n\n   3. not a layer\nMay import: ``x``.\n"
    assert declared_layers(doc) == [("a",), ("b", "c")]
    layers = gateway_layers()
    names = [name for layer in layers for name in layer]
    assert len(names) == len(set(names)), f"a layer named twice: {names}"
    assert names.index("frontends") < names.index("core") < names.index("app")


def test_gateway_imports_run_down_its_layers() -> None:
    paths = {name: str(path.relative_to(ROOT)) for name, path in project_modules().items()}
    bad = layering_violations(import_graph(), gateway_layers(), paths)
    assert not bad, "imports against the layers of gateway/__init__.py:\n" + "\n".join(bad)


def module_lengths() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in project_modules().items()
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}


def test_modules_hold_one_concept() -> None:
    lengths = module_lengths()
    long = [f"{name}: {n} lines" for name, n in sorted(lengths.items()) if WARN_LINES < n <= MAX_LINES]
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines, each likely two concepts (see docs/architecture.md, "
                      "Modules):\n" + "\n".join(long), stacklevel=1)
    too_long = [f"{name}: {n} lines" for name, n in sorted(lengths.items()) if n > MAX_LINES]
    assert not too_long, f"modules over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_test_files_stay_small() -> None:
    big = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "tests").rglob("test_*.py"))
           if (n := len(p.read_text().splitlines())) > 500]
    assert not big, "test files over 500 lines:\n" + "\n".join(big)


def test_every_package_says_what_it_owns() -> None:
    missing = []
    for package in PACKAGES:
        for init in sorted((ROOT / package).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            if not doc or len(doc) < 40:
                missing.append(str(init.relative_to(ROOT)))
    assert not missing, "packages without an opening docstring:\n" + "\n".join(missing)
