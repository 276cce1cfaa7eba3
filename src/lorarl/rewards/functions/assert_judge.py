"""Assert-mode tests judged in a sandbox the solution cannot reach.

Anything a process running the solution says about its tests can be forged: the solution owns
that interpreter (it can read a nonce from its caller's frame, patch the harness, `os._exit(0)`
before the tests run). So the solution and the tests run in two separate sandboxes:

- the *solution* sandbox executes the completion and then serves calls over a pipe: the judge asks
  "call object 3 with (1, 2)" and gets back a plain value (None, bool, int, float, str, bytes and
  lists/tuples/dicts/sets of them, encoded as tagged JSON) or a reference to an object that stays
  in the solution sandbox (a class instance, a method);
- the *judge* sandbox executes the test code in a namespace of its own: its own copy of the
  builtins, and the solution's API bound to proxies. The API is the names the task declares
  (`entry_point` or `solution_api` in the sample's metadata) or, when it declares none, every
  name the solution defines; either way a name of a builtin is never taken from the solution (a
  solution's `set` or `abs` cannot stand in for the ones the tests call), and a module the
  solution imported reaches the tests only as the judge's own import of the standard-library
  module of the same name. It evaluates the asserts itself on the decoded values and writes one
  verdict per test, then a count, to a file descriptor only it holds (a file the caller opened;
  neither its own stdout nor anything the solution's sandbox can reach). It never runs solution
  code or unpickles anything.

The best a hostile solution can do is return values, i.e. answer the tests. Costs: two sandboxes
per sample, one pipe round trip per call; objects other than plain values cross only as proxies
that support calls and attribute access, and in-place changes to arguments are not seen. Not
held without a declared API: a test that uses a name the solution defines for it as something
other than a module (e.g. `math` bound to a class, in a test that never imports math) gets the
solution's object; tasks close that by declaring their entry points.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from lorarl.rewards.sandbox.run import Sandbox, SandboxLimits, SandboxResult

__all__ = ["AssertVerdict", "judge_asserts"]

_MAX_VERDICTS_BYTES = 4 * 1024 * 1024

# Shared by both sides: the value codec and line-based framing on raw fds.
_CODEC = r"""
import json as _json, os as _os, select as _select, time as _time

_MAX_MSG = 4 * 1024 * 1024

def _encode(v, ref, depth=0):
    if depth > 64:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [_encode(x, ref, depth + 1) for x in v]
    if t is tuple:
        return {"t": [_encode(x, ref, depth + 1) for x in v]}
    if t is dict:
        d = depth + 1
        return {"d": [[_encode(k, ref, d), _encode(x, ref, d)] for k, x in v.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_encode(x, ref, depth + 1) for x in v]}
    if t is bytes:
        return {"b": v.hex()}
    return {"r": ref(v)}

def _decode(v, deref, depth=0):
    if depth > 64:
        raise ValueError("value nested too deeply")
    if isinstance(v, list):
        return [_decode(x, deref, depth + 1) for x in v]
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag == "t":
        return tuple(_decode(i, deref, depth + 1) for i in x)
    if tag == "d":
        return {_decode(k, deref, depth + 1): _decode(i, deref, depth + 1) for k, i in x}
    if tag == "s":
        return {_decode(i, deref, depth + 1) for i in x}
    if tag == "f":
        return frozenset(_decode(i, deref, depth + 1) for i in x)
    if tag == "b":
        return bytes.fromhex(x)
    if tag == "r":
        return deref(int(x))
    raise ValueError("unknown tag %r" % tag)

def _send(fd, obj):
    data = (_json.dumps(obj) + "\n").encode()
    if len(data) > _MAX_MSG:
        data = (_json.dumps({"id": obj.get("id"), "error": "message too large"}) + "\n").encode()
    while data:
        data = data[_os.write(fd, data):]

class _Lines:
    def __init__(self, fd):
        self.fd, self.buf = fd, b""
    def get(self, deadline):
        while b"\n" not in self.buf:
            left = None if deadline is None else deadline - _time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("no answer in time")
            if not _select.select([self.fd], [], [], left)[0]:
                continue
            chunk = _os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("the other side is gone")
            self.buf += chunk
            if len(self.buf) > _MAX_MSG:
                raise ValueError("message too large")
        line, self.buf = self.buf.split(b"\n", 1)
        return _json.loads(line)

class _Sink:  # stands in for stdout: what a program prints never reaches a verdict channel
    def write(self, s):
        return len(s)
    def flush(self):
        pass
"""

# Runs in the solution's sandbox: untrusted from the first line of the completion on.
_SERVER = (
    _CODEC
    + r"""
import signal as _signal, sys as _sys, json as _json2
_RECV, _SEND = int(_sys.argv[1]), int(_sys.argv[2])
_cfg = _json2.loads(_sys.stdin.read())
_objs = {}

def _ref(v):
    _objs[id(v)] = v
    return id(v)

class _CallTimeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _CallTimeout()

def _guarded(fn):
    _signal.setitimer(_signal.ITIMER_REAL, _cfg["per_test"])
    try:
        return fn()
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)

def _why(exc):
    if isinstance(exc, _CallTimeout):
        return "timed out after %g s" % _cfg["per_test"]
    return ("%s: %s" % (type(exc).__name__, exc))[:300]

_signal.signal(_signal.SIGALRM, _alarm)
_sys.stdout = _Sink()
_ns = {"__name__": "__solution__"}
try:
    _guarded(lambda: exec(compile(_cfg["solution"], "<solution>", "exec"), _ns))
    _names = {}
    for _k, _v in list(_ns.items()):
        if _k.startswith("__"):
            continue
        if type(_v).__name__ == "module":
            _names[_k] = {"module": _v.__name__}
        else:
            _names[_k] = {"value": _encode(_v, _ref)}
    _send(_SEND, {"ready": True, "names": _names})
except BaseException as _exc:
    _send(_SEND, {"ready": False, "error": _why(_exc)})
    raise SystemExit(0)

_lines = _Lines(_RECV)
while True:
    try:
        _req = _lines.get(None)
    except EOFError:
        break
    try:
        _target = _objs[_req["ref"]]
        if _req["op"] == "getattr":
            _out = _guarded(lambda: getattr(_target, _req["name"]))
        else:
            _args = _decode(_req["args"], _objs.__getitem__)
            _kw = _decode(_req["kwargs"], _objs.__getitem__)
            _out = _guarded(lambda: _target(*_args, **_kw))
        _send(_SEND, {"id": _req["id"], "value": _encode(_out, _ref)})
    except BaseException as _exc:
        _send(_SEND, {"id": _req.get("id"), "error": _why(_exc)})
"""
)

# Runs in the judge's sandbox: test code and plain values only; verdicts go to its own stdout.
_JUDGE = (
    _CODEC
    + r"""
import builtins as _builtins, signal as _signal, sys as _sys, importlib as _importlib
_RECV, _SEND, _OUT = int(_sys.argv[1]), int(_sys.argv[2]), int(_sys.argv[3])
_cfg = _json.loads(_sys.stdin.read())
_BUILTINS = dict(vars(_builtins))  # before any test runs: the tests get this copy
_PER_TEST = _cfg["per_test"]
_lines = _Lines(_RECV)
_next_id = [0]
_deadline = [None]

def _report(obj):
    data = (_json.dumps(obj) + "\n").encode()
    while data:
        data = data[_os.write(_OUT, data):]

class SolutionError(Exception):
    pass

class _TestTimeout(BaseException):
    pass

class _Remote:
    __slots__ = ("_ref",)
    def __init__(self, ref):
        object.__setattr__(self, "_ref", ref)
    def __call__(self, *args, **kwargs):
        return _rpc({"op": "call", "ref": self._ref, "args": _encode(list(args), _out_ref),
                     "kwargs": _encode(dict(kwargs), _out_ref)})
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _rpc({"op": "getattr", "ref": self._ref, "name": name})
    def __repr__(self):
        return "<solution object %d>" % self._ref

def _out_ref(v):
    if isinstance(v, _Remote):
        return v._ref
    raise TypeError("only plain values can be passed to the solution, not %s" % type(v).__name__)

def _rpc(req):
    _next_id[0] += 1
    req["id"] = _next_id[0]
    _send(_SEND, req)
    while True:
        try:
            msg = _lines.get(_deadline[0])
        except TimeoutError:
            raise _TestTimeout()
        except EOFError:
            raise SolutionError("the solution's process is gone")
        if isinstance(msg, dict) and msg.get("id") == req["id"]:
            break
    if "error" in msg:
        raise SolutionError(str(msg["error"])[:300])
    return _decode(msg["value"], _Remote)

def _alarm(signum, frame):
    raise _TestTimeout()

_signal.signal(_signal.SIGALRM, _alarm)
_sys.stdout = _Sink()
try:
    _ready = _lines.get(_time.monotonic() + _cfg["load_seconds"])
except BaseException as _exc:
    _ready = {"ready": False, "error": "no answer from the solution (%s)" % type(_exc).__name__}
if not (isinstance(_ready, dict) and _ready.get("ready") is True):
    _why = _ready.get("error") if isinstance(_ready, dict) else None
    _report({"solution_error": str(_why or "the solution did not load")[:300]})
    raise SystemExit(0)
_API = _cfg["api"]
_STDLIB = getattr(_sys, "stdlib_module_names", frozenset())

def _binding(name, desc):  # what the tests see for one of the solution's names (None: nothing)
    if not isinstance(name, str) or name.startswith("__") or name in _BUILTINS:
        return None
    if not isinstance(desc, dict):
        return None
    if "module" in desc:
        # Only the judge's own import of the stdlib module of this very name (`import math`,
        # `import xml.dom.minidom as minidom`): a solution's "module" is a claim, not a module.
        module = str(desc["module"])
        if name != module.rsplit(".", 1)[-1] or module.split(".")[0] not in _STDLIB:
            return None
        return _importlib.import_module(module)
    if _API is not None and name not in _API:
        return None
    return _decode(desc["value"], _Remote)

_ns = {"__name__": "__tests__", "__builtins__": _BUILTINS}
for _k, _desc in _ready.get("names", {}).items():
    try:
        _v = _binding(_k, _desc)
    except BaseException:
        continue
    if _v is not None:
        _ns[_k] = _v
for _i, _test in enumerate(_cfg["tests"]):
    _deadline[0] = _time.monotonic() + _PER_TEST + 0.5
    _signal.setitimer(_signal.ITIMER_REAL, _PER_TEST + 1.0)
    try:
        exec(compile(_test, "<test %d>" % _i, "exec"), _ns)
        _err = None
    except _TestTimeout:
        _err = "timed out after %g s" % _PER_TEST
    except BaseException as _exc:
        _err = ("%s: %s" % (type(_exc).__name__, _exc))[:300]
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    _report({"test": _i, "error": _err})
_report({"done": len(_cfg["tests"])})
"""
)


@dataclass(frozen=True)
class AssertVerdict:
    errors: dict[int, str | None]  # test index -> None (passed) or why it failed
    solution_error: str | None
    judge: SandboxResult
    solution: SandboxResult


def judge_asserts(
    code: str,
    tests: Sequence[str],
    limits: SandboxLimits,
    per_test: float,
    api: Sequence[str] | None = None,
) -> AssertVerdict:
    """Run `code` and `tests` in two sandboxes joined by two pipes; the judge's channel decides.

    `api`: the names of the solution the tests may use (None: every name it defines but the
    builtins'). The verdicts come from a file only the judge's sandbox gets a descriptor of; what
    either sandbox prints is never read as a verdict.
    """
    to_solution_r, to_solution_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    fds = [to_solution_r, to_solution_w, to_judge_r, to_judge_w]
    with tempfile.TemporaryFile(dir=limits.temp_root) as verdicts:
        try:
            solution = Sandbox(
                _SERVER,
                limits=limits,
                stdin=json.dumps({"solution": code, "per_test": per_test}),
                pass_fds=(to_solution_r, to_judge_w),
            )
            try:
                judge = Sandbox(
                    _JUDGE,
                    limits=limits,
                    stdin=json.dumps(
                        {
                            "tests": list(tests),
                            "per_test": per_test,
                            "load_seconds": per_test + 1.0,
                            "api": None if api is None else list(api),
                        }
                    ),
                    pass_fds=(to_judge_r, to_solution_w, verdicts.fileno()),
                )
            except BaseException:
                solution.kill()
                solution.wait()
                raise
        finally:
            for (
                fd
            ) in fds:  # the sandboxes hold their own ends: EOF reaches each when the other ends
                os.close(fd)
        judged = judge.wait()
        solution.kill()
        served = solution.wait()
        verdicts.seek(0)
        lines = verdicts.read(_MAX_VERDICTS_BYTES).decode("utf-8", errors="replace").splitlines()
    errors: dict[int, str | None] = {}
    solution_error = None
    for line in lines:
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if not isinstance(report, dict):
            continue
        if "solution_error" in report:
            solution_error = str(report["solution_error"])
        elif isinstance(report.get("test"), int) and 0 <= report["test"] < len(tests):
            err = report.get("error")
            errors[report["test"]] = None if err is None else str(err)
    return AssertVerdict(errors, solution_error, judged, served)
