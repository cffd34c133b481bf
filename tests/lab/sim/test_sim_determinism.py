"""The simulator's "deterministic per seed" output must hold across processes: Python's hash() of a str is salted
per process (PYTHONHASHSEED), so a draw seeded with it would change from run to run (and made tests flaky)."""

import subprocess
import sys

CODE = """
from gateway_lab.sim.profiles import profile
from gateway_lab.sim.replica import Replica
rep = Replica(profile("mi355x-glm52-tp4").with_overrides(seed=3), name="r")
print([rep.output_len(12345 + k, 0, 180, False, s) for k in range(40) for s in (None, "abc", 7)])
"""


def test_output_lengths_are_the_same_in_every_process():
    outs = {subprocess.run([sys.executable, "-c", CODE], env={"PYTHONHASHSEED": str(s), "PATH": ""}, capture_output=True,
                           text=True, check=True).stdout for s in (1, 2, 3)}
    assert len(outs) == 1
    lengths = eval(outs.pop())  # noqa: S307 - our own subprocess's repr of a list of tuples
    assert {f for _, f in lengths} == {"length", "stop"}  # the draw is real: some answers end early
