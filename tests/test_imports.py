"""The import graph of the project's packages: no import cycles, and every import goes down the layer table.

Every `import` / `from ... import` statement counts wherever it stands (module level, inside a function, under
`if TYPE_CHECKING`), so a cycle hidden by function-level imports fails here too. `from pkg import name` where
`pkg/__init__.py` exports `name` lazily (its `_EXPORTS` table) counts as an import of the module defining it, and
importing `a.b.c` also imports the package `a.b` (its `__init__.py` runs) unless the importer is inside it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("unsloth_jax", "pallas_kernels", "bench")

# The layers, top to bottom (docs/ARCHITECTURE.md, "Layers", says the same): a module may import modules of its
# own layer and of any layer below it, never of a layer above. A path ending in "/" is a folder (its modules at
# any depth), any other path one file.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("bench", ("bench/",)),
    ("cli", ("unsloth_jax/cli.py", "unsloth_jax/__main__.py", "unsloth_jax/doctor.py")),
    ("api", ("unsloth_jax/api.py", "unsloth_jax/__init__.py", "unsloth_jax/chat_templates.py")),
    ("train", ("unsloth_jax/train/",)),
    ("distributed", ("unsloth_jax/distributed.py",)),
    ("hf", ("unsloth_jax/hf/",)),
    ("lora", ("unsloth_jax/lora.py", "unsloth_jax/vocab.py")),
    ("quant", ("unsloth_jax/quant.py",)),
    ("inference", ("unsloth_jax/inference/", "unsloth_jax/generation.py")),
    ("families", ("unsloth_jax/families/",)),
    ("data", ("unsloth_jax/data/",)),
    ("models", ("unsloth_jax/models/", "unsloth_jax/config.py")),
    ("ops", ("unsloth_jax/ops.py",)),
    ("backend", ("unsloth_jax/backend.py", "unsloth_jax/validation.py", "unsloth_jax/errors.py")),
    ("kernels", ("pallas_kernels/",)),
)
# Rules the order above must keep (importer layer, layers it must never import); checked against LAYERS so a
# reordering that loosens one fails.
RULES = {
    "kernels": ("backend", "ops", "models", "data", "families", "inference", "quant", "lora", "hf", "distributed",
                "train", "api", "cli"),
    "models": ("train", "api", "cli", "hf", "inference", "families"),
    "families": ("train", "api", "cli", "hf", "inference"),
    "hf": ("api", "train", "cli"),
    "train": ("api", "cli"),
    "inference": ("train", "api", "cli"),
}


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


MODULES = _module_files()


def _lazy_exports(package: str) -> dict[str, str]:
    """A package `__init__.py`'s `_EXPORTS = {"name": "module", ...}` table (PEP 562 lazy exports), or {}."""
    f = MODULES.get(package)
    if f is None or f.name != "__init__.py":
        return {}
    for node in ast.parse(f.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def _project_module(name: str) -> str | None:
    """The project module that `import name` loads last (the longest prefix of `name` that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement anywhere in `module`'s file."""
    f = MODULES[module]
    is_pkg = f.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            found += [(t, node.lineno) for a in node.names if (t := _project_module(a.name))]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            exports = _lazy_exports(source)
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:
                    target = f"{source}.{a.name}"
                elif a.name in exports:
                    target = exports[a.name]
                else:
                    target = _project_module(source)
                if target:
                    found.append((target, node.lineno))
    # importing a.b.c runs a/b/__init__.py (and a/__init__.py) unless the importer is inside that package
    with_parents = []
    for target, line in found:
        parts = target.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name in MODULES and name != module and not module.startswith(name + "."):
                with_parents.append((name, line))
    return with_parents


GRAPH = {m: imports(m) for m in MODULES}


def _rel(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def layer_of(module: str) -> str | None:
    rel = _rel(module)
    best, best_len = None, -1
    for name, paths in LAYERS:
        for p in paths:
            if (rel == p or (p.endswith("/") and rel.startswith(p))) and len(p) > best_len:
                best, best_len = name, len(p)
    return best


def _cycles() -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # a shortest path back to comp[0] from one of its imports (breadth first)
        members, start = set(comp), comp[0]
        prev: dict[str, str] = {}
        frontier = [start]
        while start not in prev:
            nxt = []
            for v in frontier:
                for w, _ in GRAPH[v]:
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while prev[path[-1]] != start:
            path.append(prev[path[-1]])
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def _edge(a: str, b: str) -> str:
    line = min(line for t, line in GRAPH[a] if t == b)
    return f"{_rel(a)}:{line} imports {b}"


def test_every_module_has_a_layer():
    missing = [_rel(m) for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules in no layer (add them to LAYERS here and to docs/ARCHITECTURE.md): {missing}"


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join(c) + "\n    " + "\n    ".join(_edge(a, b) for a, b in zip(c, c[1:])) for c in cycles)


def test_imports_go_down_the_layers():
    rank = {name: k for k, (name, _) in enumerate(LAYERS)}
    bad = []
    for m, edges in GRAPH.items():
        lm = layer_of(m)
        for target, line in edges:
            lt = layer_of(target)
            if lm and lt and rank[lt] < rank[lm]:
                bad.append(f"{_rel(m)}:{line} imports {target}: layer {lm!r} may not import layer {lt!r} (above it)")
    assert not bad, "imports against the layering (tests/test_imports.py LAYERS):\n" + "\n".join(sorted(set(bad)))


def test_layer_table_keeps_the_rules():
    rank = {name: k for k, (name, _) in enumerate(LAYERS)}
    assert len(rank) == len(LAYERS)
    for layer, forbidden in RULES.items():
        for other in forbidden:
            assert rank[other] < rank[layer], f"LAYERS lets {layer!r} import {other!r}, which the layering forbids"
    assert rank["inference"] > rank["train"]  # train may import inference
    for allowed in ("models", "ops", "data"):  # inference may import these (config.py is in models)
        assert rank[allowed] > rank["inference"]
    below_api = [name for name, _ in LAYERS[rank["api"] + 1:]]
    assert "cli" not in below_api and "api" not in below_api


def test_architecture_doc_lists_the_same_layers():
    """docs/ARCHITECTURE.md's numbered layer list names the same files, in the same order, as LAYERS."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    doc = [tuple(re.findall(r"`([^`]+)`", line)) for line in section.splitlines() if re.match(r"\d+\. ", line)]
    assert doc == [paths for _, paths in LAYERS], (
        "docs/ARCHITECTURE.md's numbered layer list differs from tests/test_imports.py LAYERS:\n"
        f"doc:    {doc}\nLAYERS: {[paths for _, paths in LAYERS]}")
