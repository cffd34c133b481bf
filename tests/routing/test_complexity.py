"""Every function in gateway/routing/ stays at cyclomatic grade C or better (radon): a policy's decision is a
sequence of small named rules a reader can check one at a time, not one branching function (the default policy's
decide once graded F, 41 paths)."""

from pathlib import Path

from radon.complexity import cc_rank, cc_visit

ROUTING = Path(__file__).resolve().parents[2] / "gateway" / "routing"


def test_no_routing_function_above_grade_c() -> None:
    worse = []
    for path in sorted(ROUTING.rglob("*.py")):
        for block in cc_visit(path.read_text()):
            if cc_rank(block.complexity) > "C":
                worse.append(f"{path.relative_to(ROUTING)}:{block.lineno} {block.name} {cc_rank(block.complexity)}"
                             f"({block.complexity})")
    assert not worse, f"above grade C: {worse}"
