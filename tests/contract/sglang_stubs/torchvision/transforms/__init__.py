"""`torchvision.transforms` stand-in: only the names bound at import time."""

from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str):
    raise AttributeError(
        f"torchvision stand-in (contract tests): transforms.{name} is not available"
    )
