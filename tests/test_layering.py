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
