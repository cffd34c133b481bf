"""The runtime never imports its lab: nothing under gateway/ imports gateway_lab (the simulator, replay, the demo),
not even lazily inside a function. A deployment ships the runtime's behaviour alone, and a figure the lab measures
is a figure of the shipped code, not of code that exists only in the lab."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_runtime_never_imports_the_lab():
    offenders = sorted(
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / "gateway").rglob("*.py")
        for m in imported_modules(p)
        if m == "gateway_lab" or m.startswith("gateway_lab.")
    )
    assert not offenders, f"runtime modules importing the lab: {offenders}"


def test_the_rule_sees_lazy_imports(tmp_path: Path):
    """The check must catch an import inside a function, the usual way such a dependency sneaks back in."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from gateway_lab.sim import server\n    import gateway_lab.replay\n")
    assert imported_modules(f) == {"gateway_lab.sim", "gateway_lab.replay"}


# the parts the pipeline orchestrates: none of them knows the request path or the APIs above it
BELOW_THE_PIPELINE = ("backends", "control", "dispatch", "flow", "kvevents", "observability", "prediction", "prefix",
                      "recording", "routing", "settings", "tenancy", "tokenizers")
# what the pipeline may use of api/: the one place errors become responses (it imports nothing else of api/)
RENDERER = "gateway.api.error_handlers"


def test_the_pipeline_sits_between_the_apis_and_the_parts_it_orchestrates():
    """gateway/pipeline/ is the one request path of every API: the adapters in api/ call it and it never calls them
    (an arrow up would let one API's detail leak into every API's path); the parts it orchestrates (tenancy/,
    routing/, dispatch/, ...) import neither it nor api/, so each stays usable alone (the simulator, the admin API's
    previews, unit tests). Lazy imports count too."""
    up = sorted(f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "gateway" / "pipeline").rglob("*.py")
                for m in imported_modules(p) if m.startswith("gateway.api") and m != RENDERER)
    assert not up, f"pipeline modules importing the API layer above them: {up}"
    assert not [m for m in imported_modules(ROOT / "gateway" / "api" / "error_handlers.py")
                if m.startswith(("gateway.api", "gateway.pipeline"))]
    down = sorted(f"{p.relative_to(ROOT)}: {m}" for pkg in BELOW_THE_PIPELINE for p in (ROOT / "gateway" / pkg).rglob("*.py")
                  for m in imported_modules(p) if m.startswith(("gateway.pipeline", "gateway.api")))
    assert not down, f"modules below the pipeline importing it or the API layer: {down}"


def module_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (what runs at import time; an import inside a
    function is a deliberate late edge and does not make a cycle at import)."""
    mods = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod].update(n for n in names if n in mods and n != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle_among_the_runtimes_modules():
    """Every module of gateway/ can be imported on its own: no two modules import each other, directly or around a
    loop, at import time."""
    assert cycles(module_graph(ROOT / "gateway")) == []


def test_the_cycle_rule_finds_a_loop(tmp_path: Path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import x\n")
    (pkg / "b.py").write_text("import p.c\nx = 1\n")
    (pkg / "c.py").write_text("from p import a\n")
    (pkg / "d.py").write_text("def f():\n    from p import a\n")  # late: not an import-time edge
    assert cycles(module_graph(pkg)) == [["p.a", "p.b", "p.c"]]
