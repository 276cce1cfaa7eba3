"""`torchvision.io` stand-in: the names transformers' image utils bind at import time."""

from enum import Enum


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(*args: object, **kwargs: object):
    raise NotImplementedError("torchvision stand-in (contract tests): decode_image")


def decode_jpeg(*args: object, **kwargs: object):
    raise NotImplementedError("torchvision stand-in (contract tests): decode_jpeg")
