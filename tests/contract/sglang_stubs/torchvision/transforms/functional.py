"""`torchvision.transforms.functional` stand-in: the enum SGLang binds at import time."""

from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def pil_to_tensor(*args: object, **kwargs: object):
    raise NotImplementedError("torchvision stand-in (contract tests): pil_to_tensor")


def __getattr__(name: str):
    raise AttributeError(
        f"torchvision stand-in (contract tests): transforms.functional.{name} is not available"
    )
