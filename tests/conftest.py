import pytest
from hypothesis import HealthCheck, settings

from tests.support import RedisServer, start_sims

# Generated-input tests judge what the code does with an input, never how fast the input was made: Hypothesis's
# timing checks (a per-example deadline, "input generation is slow") fail on a machine whose cores are busy.
settings.register_profile("gateway", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gateway")


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server for the whole run (the machine's shared one on 6379 is never touched)."""
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def sims():
    """Two simulated MI355X replicas at 20x speed, on loopback."""
    st, reps = start_sims(2)
    yield st, reps
    st.stop()
