"""tests/ mirrors gateway/ (docs/architecture.md, README's contributing notes): a test directory names the package it tests, so the tests of
a module are found where the module is; tests/lab/ mirrors the lab package gateway_lab/ the same way. Only
whole-stack tests (e2e/), the tier against real engines (engines/) and shared fakes (fakes/) stand apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APART = {"e2e", "engines", "fakes"}


def test_every_test_directory_mirrors_a_gateway_package():
    tests = ROOT / "tests"
    strays = []
    for d in sorted(p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = d.relative_to(tests)
        if rel.parts[0] in APART:
            continue
        package = ROOT / "gateway_lab" / rel.relative_to("lab") if rel.parts[0] == "lab" else ROOT / "gateway" / rel
        if not (package / "__init__.py").is_file():
            strays.append(str(rel))
    assert not strays, f"test directories with no gateway package of the same path: {strays}"


def test_no_test_files_left_outside_the_mirror():
    # the old unit/ and integration/ split is gone: a test lives beside the package it tests
    assert not list((ROOT / "tests").glob("unit/**/test_*.py"))
    assert not list((ROOT / "tests").glob("integration/**/test_*.py"))


# in a section's text: `sub/ (` opens a group of sub-package `sub`; `(` a note; `)` closes either; `x.py` or `sub/x.py`
# names a module (a whole token: `base` inside `baselines`, or `tokenizer` inside `tokenizers/`, names nothing)
TOKEN = re.compile(r"(?<![\w/.])(?:(\w+)/\s*\(|([\w/]+\.py)(?!\w))|([()])")


def _section_modules(text: str, package: str) -> set[str]:
    """The module paths (relative to gateway/) one section of the Layout names: `x.py` is its package's module,
    `sub/x.py` its sub-package's; everything inside `sub/ (...)` is named relative to `sub/`; any other
    parenthesis is a note and keeps the enclosing package."""
    stack, named = [package], set()
    for group, module, paren in TOKEN.findall(text):
        if module:
            named.add(stack[-1] + module)
        elif group or paren == "(":
            stack.append(stack[-1] + (f"{group}/" if group else ""))
        else:
            assert len(stack) > 1, f"unbalanced ')' in the Layout, section {package or 'gateway/'}"
            stack.pop()
    assert len(stack) == 1, f"unclosed '(' in the Layout, section {package or 'gateway/'}"
    return named


def layout_modules(layout: str, root: str = "gateway/") -> set[str]:
    """The modules the Layout's `gateway/` tree names, by path relative to gateway/. The tree runs from the
    `gateway/` line to the next unindented line; a line indented two spaces that starts with `pkg/` opens pkg's
    section, any other such line is gateway/'s own (top-level modules); deeper-indented lines continue the section
    above them."""
    lines = layout.splitlines()
    sections: dict[str, list[str]] = {}
    current = ""
    start = next(i for i, line in enumerate(lines) if line.split(" ", 1)[0] == root)
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        text = line.strip()
        if len(line) - len(line.lstrip()) == 2:
            head = text.split()[0]
            current = head if re.fullmatch(r"\w+/", head) else ""
            text = text[len(current):]
        sections.setdefault(current, []).append(text)
    return set().union(*(_section_modules(" ".join(texts), pkg) for pkg, texts in sections.items()))


def test_the_layout_rule_is_exact():
    """A name counts only as a whole token in its own package's section: no substring, no other package's file."""
    layout = "\n".join([
        "```", "gateway/",
        "  typed.py (the config base) tokenizer.py     top-level",
        "  api/       admin/ (routes.py)  ops.py (healthz)  openai/ (proxy.py, relay.py (the",
        "             stream), exchange.py)  middleware.py",
        "  routing/   policies/ (baselines)  engine.py",
        "  sim/       engine, radix_cache.py",
        "loadtests/   fleet.py", "```"])
    assert layout_modules(layout) == {"typed.py", "tokenizer.py", "api/admin/routes.py", "api/ops.py",
                                      "api/openai/proxy.py", "api/openai/relay.py", "api/openai/exchange.py",
                                      "api/middleware.py", "routing/engine.py", "sim/radix_cache.py"}


def test_the_architecture_layout_names_every_gateway_module():
    """The Layout section of docs/architecture.md is the map a new reader starts from: a module it does not name is one they cannot
    find, a name with no module sends them nowhere. Each module is named by its file name (`x.py`) in its package's
    section (sub-packages as `sub/ (x.py, ...)`), so a new module must be placed in the map when it is added."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = doc.index("## Layout")
    following = doc.find("\n## ", start + 1)
    layout = doc[start:following if following > 0 else len(doc)]
    for root in ("gateway", "gateway_lab"):
        package = ROOT / root
        modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
        named = layout_modules(layout, root + "/")
        assert not sorted(modules - named), f"{root}/ modules missing from the Layout in docs/architecture.md: {sorted(modules - named)}"
        assert not sorted(named - modules), f"The Layout in docs/architecture.md names {root}/ modules that do not exist: " \
            f"{sorted(named - modules)}"
