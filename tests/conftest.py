"""Test configuration: deterministic hypothesis, and the device every test runs on."""

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run, no wall-clock deadline
# (CI machines are slow and shared).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Scripts that made reference data with a peer library (which the suite does not
# install): not test modules, and --doctest-modules must not import them.
collect_ignore_glob = ["data/*"]


def pytest_configure(config: pytest.Config) -> None:
    """In CI (``CI`` set) the fused kernels' interpreter tests must run, not skip.

    Triton is the ``fused`` extra, apart from ``test`` (about 1 GB): without it
    ``tests/test_fused*.py`` skip on a user's machine, but CI installs it (``.ci/run``),
    and a CI run without it is an error rather than a quietly smaller suite.
    """
    if os.environ.get("CI") and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError(
            "CI is set but triton is not installed: the fused kernels' tests would skip "
            '(pip install -e ".[fused]")'
        )


# Under pytest-xdist (-n auto) every core runs a worker: one torch thread each, so the
# workers do not oversubscribe the cores. Results do not depend on the thread count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when available (the GPU check), otherwise the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def float64_default():
    """Run the test with float64 as torch's default dtype (exactness tests), then restore."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
