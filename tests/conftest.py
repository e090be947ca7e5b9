"""Test-wide settings: one torch thread (when torch is installed), no network for Hugging Face and derandomized
hypothesis (fixed seeds); a local Ray cluster per module for the fleet tests that ask for ``ray_cluster``, all of
which run in one worker of a parallel run (``pytest -n``), so that no two Ray clusters start at once."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    # Property tests run derandomized by default (each test's examples come from a seed fixed by the test itself),
    # so a failure, or a mutant's kill, never depends on luck and reruns the same. HYPOTHESIS_PROFILE=random draws
    # fresh examples each run, for exploring.
    settings.register_profile("derandomized", derandomize=True, database=None)
    settings.register_profile("random", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray of 4 CPUs (scheduling tokens, not cores) for one module's fleet tests."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` every test that starts a Ray cluster runs in the same worker."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
