import pytest

from harness import close_pools


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(items):
    """A test module's ``SLOW_VARIANTS`` (test ids such as "test_x[tcp]"): variants of a case whose
    other variants run in ``make test``, moved to ``make test-slow`` for make test's time budget
    (where a module-wide parametrization cannot carry a per-variant mark)."""
    for item in items:
        if item.name in getattr(item.module, "SLOW_VARIANTS", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_pools()
