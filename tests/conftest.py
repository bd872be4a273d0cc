"""Shared test setup: deliberate torch threading (2-core CI machines), GPU marker handling."""

from __future__ import annotations

import os

import pytest
import torch

# Oversubscribed threads cost ~10x on a 2-core machine; tests that start worker processes set their own.
torch.set_num_threads(int(os.environ.get("KEEPWARM_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
