"""`module:attr` entrypoints from the job's image, or `path/to/file.py:attr` from a file (a
volume, a mounted ConfigMap): reward functions and environment classes."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

_FILE_LOCK = threading.Lock()  # two reward workers loading one file get one module


def is_file_entrypoint(spec: str) -> bool:
    """`path/to/file.py:attr`: the part before the last ':' names a Python file. A dotted module
    whose last part is `py` would read the same; no one names a module that."""
    source, _, _ = spec.rpartition(":")
    return source.endswith(".py")


def split_entrypoint(spec: str) -> tuple[str, str]:
    """(module or file, attr). A file path may hold ':' itself, the attr never does."""
    if is_file_entrypoint(spec):
        source, _, attr = spec.rpartition(":")
    else:
        source, _, attr = spec.partition(":")
    return source, attr


def import_entrypoint(spec: str, kind: str, *, want: str = "callable") -> Callable[..., Any]:
    """The callable `attr` (dotted for nested ones) of a module or a `.py` file; ValueError
    naming `kind` and `spec`, in one line, when it does not import, lacks it, or it is not
    callable."""
    source, attr = split_entrypoint(spec)
    where = source if is_file_entrypoint(spec) else f"module {source!r}"
    if is_file_entrypoint(spec):
        module = _import_file(spec, kind, source)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as exc:
            raise ValueError(f"{kind} {spec!r}: cannot import module {source!r}: {exc}") from exc
        except Exception as exc:  # the module raised while it ran
            raise ValueError(
                f"{kind} {spec!r}: importing module {source!r} failed: {_one_line(exc, None)}"
            ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {spec!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is a {type(obj).__name__}, not {want}")
    return obj


def _import_file(spec: str, kind: str, path: str) -> ModuleType:
    """Executes the file once per process as its own module (what verl does with
    `custom_reward_function.path`). Its folder is appended to sys.path so it can import files
    beside it (a ConfigMap of several files); appended, so it never shadows an installed
    package. Any error while it runs is reported as one line with the file's line number."""
    file = Path(path).expanduser().absolute()
    if not file.is_file():
        raise ValueError(f"{kind} {spec!r}: no file {path} (paths are relative to {Path.cwd()})")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    name = f"lorarl_user_{file.stem}_{digest}"
    with _FILE_LOCK:
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, file)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{kind} {spec!r}: {path} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        if str(file.parent) not in sys.path:
            sys.path.append(str(file.parent))
        sys.modules[name] = module  # dataclasses and pickle look a module up by name
        try:
            module_spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[name]
            if not isinstance(exc, Exception):
                raise
            raise ValueError(
                f"{kind} {spec!r}: importing {path} failed: {_one_line(exc, file)}"
            ) from exc
    return module


def _one_line(exc: Exception, file: Path | None) -> str:
    """`NameError: name 'x' is not defined (line 3)`: where in the user's file it failed (with
    no file: the innermost frame's file and line)."""
    where = ""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        where = f" (line {exc.lineno})"
    else:
        tb = exc.__traceback__
        while tb is not None:
            frame_file = tb.tb_frame.f_code.co_filename
            if file is None:
                where = f" ({frame_file}, line {tb.tb_lineno})"
            elif Path(frame_file) == file:
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)  # str() repeats the line
    text = " ".join(str(message).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}{where}"
