"""No module of the runtime or its lab over 400 lines: a module that grows past it has more than one job."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 400


def test_no_module_over_the_limit():
    over = {str(p.relative_to(ROOT)): n for pkg in ("gateway", "gateway_lab") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"
