"""Shared fixtures: GPU-marked tests skip themselves unless an sm_90 GPU is present."""
import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 GPU (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
