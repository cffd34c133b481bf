"""tests/ mirrors gateway/ (README, contributing notes): a test directory names the package it tests, so the tests of
a module are found where the module is. Only whole-stack tests (e2e/) and shared fakes (fakes/) stand apart."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APART = {"e2e", "fakes"}


def test_every_test_directory_mirrors_a_gateway_package():
    tests = ROOT / "tests"
    strays = []
    for d in sorted(p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = d.relative_to(tests)
        if rel.parts[0] in APART:
            continue
        if not (ROOT / "gateway" / rel / "__init__.py").is_file():
            strays.append(str(rel))
    assert not strays, f"test directories with no gateway package of the same path: {strays}"


def test_no_test_files_left_outside_the_mirror():
    # the old unit/ and integration/ split is gone: a test lives beside the package it tests
    assert not list((ROOT / "tests").glob("unit/**/test_*.py"))
    assert not list((ROOT / "tests").glob("integration/**/test_*.py"))


def test_the_readme_layout_names_every_gateway_module():
    """README's Layout section is the map a new reader starts from: a module it does not name is one they cannot
    find (checked by name, so a new module must be placed in the map when it is added)."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## Contributing")]
    unnamed = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "gateway").rglob("*.py"))
               if p.name != "__init__.py" and p.stem not in layout]
    assert not unnamed, f"modules missing from README's Layout: {unnamed}"
