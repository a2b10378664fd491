import pytest

from harness import close_pools


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_pools()
