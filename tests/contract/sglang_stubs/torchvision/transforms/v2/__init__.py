"""`torchvision.transforms.v2` stand-in: only the names bound at import time."""

from torchvision.transforms.v2 import functional

__all__ = ["functional"]


def __getattr__(name: str):
    raise AttributeError(
        f"torchvision stand-in (contract tests): transforms.v2.{name} is not available"
    )
