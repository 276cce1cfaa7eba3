"""The colocated release/resume of vLLM's memory, judged by vLLM's own code (the engine env).

In the engine interpreter (`LORARL_ENGINE_PYTHON` / `.venv-engine`, where lorarl is importable):
vLLM's CLI parser reads the plan's argv (`--enable-sleep-mode` on for a colocated GPU job only);
vLLM's own router registration, under the env the plan gives the engine, serves `/sleep`,
`/wake_up` and `/is_sleeping`; and lorarl's `EngineMemory` calls them through vLLM's real
FastAPI routes, whose engine client records what they parsed (level 1, every tag woken).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lorarl.api.validation import parse_job
from lorarl.plan.engines import engine_env, vllm_command
from lorarl.trainer.fleet.engine_memory import CALLS

PROBE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from fastapi import FastAPI
from starlette.testclient import TestClient
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.api_server.routers import register_api_routers
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from lorarl.trainer.fleet.engine_memory import EngineMemory, EngineMemoryError

req = json.load(sys.stdin)
out = {"argv": {}}
parser = make_arg_parser(FlexibleArgumentParser())
for name, argv in req["argv"].items():
    args = parser.parse_args(argv)
    out["argv"][name] = [args.enable_sleep_mode, EngineArgs.from_cli_args(args).enable_sleep_mode]


class RecordingEngineClient:  # the calls vLLM's routes make on the engine, as they parsed them
    def __init__(self):
        self.calls = []

    async def sleep(self, level=1, mode="abort"):
        self.calls.append(["sleep", level, mode])

    async def wake_up(self, tags=None):
        self.calls.append(["wake_up", tags])
        return True

    async def is_sleeping(self):
        self.calls.append(["is_sleeping"])
        return False


args = parser.parse_args(req["argv"]["colocated"])
app = FastAPI()
app.state.args = args
register_api_routers(args, app, ("generate",), None)  # what the server does at start
out["routes"] = sorted([r.path, sorted(r.methods)] for r in app.routes
                       if getattr(r, "path", "").startswith(("/sleep", "/wake_up", "/is_sl")))
app.state.engine_client = engine = RecordingEngineClient()
client = TestClient(app)
memory = EngineMemory(True, "vllm", client, "key", lambda: ["http://testserver"], attempts=1)
try:
    memory.release()
    out["released"] = list(memory.released)
    memory.resume()
    out["is_sleeping"] = client.get("/is_sleeping").json()
except EngineMemoryError as exc:
    out["error"] = str(exc)
out["calls"] = engine.calls
sys.stdout.write("\nRESULT" + json.dumps(out))
"""


def job(placement: str, gpus: int):
    return parse_job({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "t"},
        "spec": {
            "model": {"path": "/m"}, "data": {"trainFiles": ["t.jsonl"]},
            "rollout": {"engine": "vllm", "placement": placement, "gpusPerReplica": gpus},
            "trainer": {"gpusPerReplica": gpus},
        },
    })  # fmt: skip


def probe(python: str, server_env: dict[str, str]) -> dict:
    argv = {
        name: vllm_command(job(p, g).spec, "/models/m", "0.0.0.0", 8000)[3:]  # after `-m <mod>`
        for name, (p, g) in {"colocated": ("colocated", 1), "separate": ("separate", 1),
                             "colocated_cpu": ("colocated", 0)}.items()
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({k: v for k, v in server_env.items() if not v.startswith("$(")})
    proc = subprocess.run(
        [python, "-c", PROBE], input=json.dumps({"argv": argv}), capture_output=True, text=True,
        timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("\nRESULT", 1)[1])


@pytest.fixture(scope="module")
def vllm(engine_python: str) -> dict:
    return probe(engine_python, engine_env(job("colocated", 1).spec))


@pytest.mark.slow
def test_vllm_parses_sleep_mode_on_for_colocated_gpu_engines_only(vllm: dict) -> None:
    assert vllm["argv"] == {
        "colocated": [True, True],
        "separate": [False, False],
        "colocated_cpu": [False, False],  # vLLM refuses sleep mode on CPU: never asked
    }


@pytest.mark.slow
def test_vllm_serves_the_memory_routes_under_the_plans_env(vllm: dict) -> None:
    """VLLM_SERVER_DEV_MODE=1 (lorarl.engines.vllm.vllm_server_env) is what registers them."""
    assert vllm["routes"] == [["/is_sleeping", ["GET"]], ["/sleep", ["POST"]],
                              ["/wake_up", ["POST"]]]  # fmt: skip
    release, resume = CALLS["vllm"]
    assert (release.path, resume.path) == ("/sleep", "/wake_up")


@pytest.mark.slow
def test_lorarl_release_and_resume_reach_vllms_engine_as_level_1_and_all_tags(vllm: dict) -> None:
    assert "error" not in vllm, vllm["error"]
    assert vllm["released"] == ["http://testserver"]
    assert vllm["calls"][:2] == [["sleep", 1, "abort"], ["wake_up", None]]
    assert vllm["is_sleeping"] == {"is_sleeping": False}


@pytest.mark.slow
def test_without_dev_mode_vllm_has_no_memory_routes_and_release_fails_loudly(
    engine_python: str,
) -> None:
    env = engine_env(job("colocated", 1).spec)
    del env["VLLM_SERVER_DEV_MODE"]
    found = probe(engine_python, env)
    assert found["routes"] == [] and found["calls"] == []
    assert "release of GPU memory failed" in found["error"] and "HTTP 404" in found["error"]
