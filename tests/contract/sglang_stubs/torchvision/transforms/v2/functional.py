"""`torchvision.transforms.v2.functional` stand-in: bound at import time, never called."""

from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str):
    raise AttributeError(
        f"torchvision stand-in (contract tests): transforms.v2.functional.{name} is not available"
    )
