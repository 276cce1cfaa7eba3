"""The managed engine flags, judged by each engine's own argument parser.

`rollout.engineArgs` must not override a flag the plan sets; the list of those flags is
hand-written (lorarl.engines.flags), so this asks the real parsers (vLLM in the engine env,
SGLang in its own env) that every alias of a managed option is managed too (`-tp`,
`--device-memory-utilization`, SGLang's `--model` for `--model-path`, ...), that every managed
flag exists, that no other option is refused by mistake, and that both parsers take prefixes
(which is why abbreviations are refused).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorarl.engines.flags import managed_flags, overriding_arg
from tests.contract.conftest import sglang_python

STUBS = Path(__file__).resolve().parents[1] / "contract" / "sglang_stubs"
DUMP = (
    "import json, sys\n"
    "out = {'abbrev': parser.allow_abbrev,\n"
    "       'options': [a.option_strings for a in parser._actions if a.option_strings]}\n"
    "sys.stdout.write('\\nOPTIONS' + json.dumps(out))\n"
)
VLLM_PARSER = (
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = make_arg_parser(FlexibleArgumentParser())\n"
)
SGLANG_PARSER = (
    f"import sys; sys.path.insert(0, {str(STUBS)!r})\n"
    "import argparse\n"
    "from sglang.srt.server_args import ServerArgs\n"
    "parser = argparse.ArgumentParser()\n"
    "ServerArgs.add_cli_args(parser)\n"
)


def parser_options(python: str, build: str) -> dict:
    proc = subprocess.run([python, "-c", build + DUMP], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.rsplit("\nOPTIONS", 1)[1])


def check_against(engine: str, parsed: dict) -> None:
    assert parsed["abbrev"] is True  # prefixes are accepted: refusing them is needed
    options = {o for group in parsed["options"] for o in group}
    for cpu in (True, False):
        managed = set(managed_flags(engine, cpu=cpu))
        assert managed <= options, managed - options  # no stale name
        for group in parsed["options"]:
            if set(group) & managed:  # one alias managed: all of them refused
                assert all(overriding_arg(engine, [o], cpu=cpu) for o in group), group
        wrongly = [
            o for o in options - managed
            if o.startswith("--") and o != "--help" and overriding_arg(engine, [o], cpu=cpu)
        ]  # fmt: skip
        assert wrongly == [], f"refused but not managed: {wrongly}"


@pytest.mark.slow
def test_vllm_parser_agrees_with_the_managed_flags(engine_python: str) -> None:
    check_against("vllm", parser_options(engine_python, VLLM_PARSER))


@pytest.mark.slow
def test_sglang_parser_agrees_with_the_managed_flags() -> None:
    python = sglang_python()
    if not python.exists():
        pytest.skip(f"no SGLang env at {python} (see tests/contract/conftest.py)")
    check_against("sglang", parser_options(str(python), SGLANG_PARSER))
