import pytest

from tests.support import RedisServer, start_sims


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
