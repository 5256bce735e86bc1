"""Fixtures that more than one module of the pipelines tests use.

The toy world model tests (``test_toy_world_model.py``, ``test_toy_world_motion.py``): ``model``, ``small`` and
``bare``, one model each per module, and ``one_intra_op_thread``, which each of those modules holds for all its
tests (``pytestmark``). torch is imported when one of them is first used, not by every pipelines test.

The lease driver tests (``test_lease_driver.py``, ``test_lease_rotation_and_idle.py``): ``log``, a fresh log of
the lease's transitions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from .lease_helpers import Log

if TYPE_CHECKING:
    from pipelines.toy_world.model import ToyWorldModel


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """As the service runs its stages (one intra-op thread each): small tensors gain nothing from more."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> ToyWorldModel:
    from pipelines.toy_world.model import ToyWorldConfig, ToyWorldModel

    return ToyWorldModel(ToyWorldConfig())


@pytest.fixture(scope="module")
def small() -> ToyWorldModel:
    from pipelines.toy_world.model import ToyWorldConfig, ToyWorldModel

    from .toy_world_helpers import SMALL

    return ToyWorldModel(ToyWorldConfig(**SMALL))


@pytest.fixture(scope="module")
def bare() -> ToyWorldModel:
    """Ground and sky only: for checks about the ground's motion."""
    from pipelines.toy_world.model import ToyWorldConfig, ToyWorldModel

    return ToyWorldModel(ToyWorldConfig(object_density=0.0))


@pytest.fixture
def log() -> Log:
    return Log()
