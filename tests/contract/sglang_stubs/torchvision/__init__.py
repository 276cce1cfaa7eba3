"""Import-only stand-in for torchvision in the SGLang contract env
(docs/architecture.md#measured-facts).

SGLang's `io_struct` reaches torchvision through a multimodal config chain at import time, but
the PyPI torchvision build is CUDA-linked and must not be installed next to the CPU torch. Only
the names those imports bind exist here; using anything else fails loudly, so a contract check
can never silently depend on image code.
"""

__version__ = "0.0.0+lorarl.stub"


def __getattr__(name: str):
    raise AttributeError(f"torchvision stand-in (contract tests): {name!r} is not available")
