"""tests/gpu: every test here is marked `gpu` and skipped when CUDA is not available."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not has_cuda:
            item.add_marker(skip)
