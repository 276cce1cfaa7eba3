"""The sync sidecar as it runs in a rollout pod: `python -m lorarl.rollout.sidecar` with the env the
job plan renders, next to a test engine that speaks vLLM's HTTP API (weight-update routes
included), fed by a real SyncSender in this process over gloo on loopback. Generation after each
update is checked against a PeftModel carrying the same adapter."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import LINEAR_PARENTS, linear_modules, make_tiny_model
from lorarl.api.validation import load_job_file
from lorarl.local.env_refs import with_job_keys
from lorarl.local.ports import free_port_block
from lorarl.local.processes import Child
from lorarl.plan import JobPlan, LocalAddressing, plan
from lorarl.sync import transport
from lorarl.sync.buckets import Bucket, SyncHeader, pack
from lorarl.sync.transport import SyncResult, SyncSender

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
RANK, ALPHA = 4, 8.0
PROMPT = [5, 17, 30, 42, 8, 61, 3]
ENGINE_KEY = "engine-key-for-tests"
SYNC_KEY = "sync-key-for-tests"
N_TOKENS = 8
LEAVES = LINEAR_PARENTS
MODULES = tuple(linear_modules(LEAVES))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


# ----------------------------------------------------------------------------- updates


def lora_tensors(seed: int, rank: int = RANK, modules=MODULES, shapes=None) -> dict:
    """Random PEFT-named LoRA tensors, large enough to change what the tiny model generates."""
    shapes = shapes or module_shapes()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        out_f, in_f = shapes[m]
        out[f"base_model.model.{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        out[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    return out


def module_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of the tiny Llama's projections: hidden 128, one 64-wide kv head, mlp 256."""
    dims = {
        "q_proj": (128, 128),
        "k_proj": (64, 128),
        "v_proj": (64, 128),
        "o_proj": (128, 128),
        "gate_proj": (256, 128),
        "up_proj": (256, 128),
        "down_proj": (128, 256),
    }
    return {m: dims[m.rsplit(".", 1)[1]] for m in MODULES}


def header_for(version: int, mode: str, tensors: dict, rank: int = RANK) -> SyncHeader:
    modules = sorted({n.removeprefix("base_model.model.").split(".lora_")[0] for n in tensors})
    return SyncHeader(
        version=version,
        mode=mode,
        scaling=ALPHA / rank,
        rank=rank,
        alpha=ALPHA,
        target_modules=tuple(modules),
    )


def payload_bytes(tensors: dict, sender: SyncSender) -> int:
    return sum(b.spec.nbytes for b in pack(tensors, sender.bucket_bytes))


# ----------------------------------------------------------------------------- processes


def write_job(path: Path, model_dir: Path, mode: str, replicas: int) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = f"sync-{mode}"
    doc["spec"]["model"] = {"path": str(model_dir), "dtype": "float32"}
    doc["spec"]["lora"] = {"rank": RANK, "alpha": ALPHA}
    doc["spec"]["rollout"].update(replicas=replicas, syncMode=mode)
    path.write_text(yaml.safe_dump(doc))
    return path


@dataclass
class Rollout:
    """The rollout role of a plan as processes: engine i and sidecar i per replica."""

    plan: JobPlan
    engines: list[Child]
    sidecars: list[Child]
    engine_urls: list[str]
    sidecar_urls: list[str]
    # the engines only answer requests with the job's key, as in a pod
    http: httpx.Client = field(
        default_factory=lambda: httpx.Client(
            timeout=30.0, headers={"Authorization": f"Bearer {ENGINE_KEY}"}
        )
    )

    def status(self, i: int) -> dict[str, Any]:
        return self.http.get(f"{self.sidecar_urls[i]}/status").json()

    def healthz(self, i: int) -> int:
        try:
            return self.http.get(f"{self.sidecar_urls[i]}/healthz").status_code
        except httpx.HTTPError:
            return 0

    def greedy(self, i: int, model: str = "base") -> tuple[list[int], list[float]]:
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": N_TOKENS,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        resp = self.http.post(f"{self.engine_urls[i]}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        return ids, lp["token_logprobs"]

    def kill(self, child: Child) -> None:
        """SIGKILL the whole process group, like a container runtime killing a crashed pod."""
        os.killpg(child.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def stop(self) -> None:
        for child in [*self.sidecars, *self.engines]:
            child.stop(grace_s=5)
        self.http.close()


def start_rollout(
    job_path: Path,
    run_dir: Path,
    model_dir: Path,
    engine_python: str | None = None,
    only: set[int] | None = None,
) -> Rollout:
    """Start every engine and sidecar of the plan's rollout role (or the replicas in `only`;
    the others are started later, as scaling would) with the env the plan renders.

    The engine is the test engine, or with `engine_python` the plan's real vLLM command."""
    job = load_job_file(str(job_path))
    base = free_port_block(LocalAddressing.ports_needed(job.spec.rollout.replicas))
    jp = plan(job, LocalAddressing(base), config_path=str(job_path))
    engines, sidecars, engine_urls, sidecar_urls = [], [], [], []
    for replica in jp.role("rollout").replicas:
        engine, sidecar = replica.containers
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "LORARL_ADAPTER_DIR": str(run_dir / "adapters" / replica.name),
        }
        port = engine.ports["engine"]
        test_engine = [sys.executable, "-m", "harness.engines.hf_engine_server"]
        test_engine += ["--model", str(model_dir), "--port", str(port)]
        test_engine += ["--served-model-name", "base"]
        engines.append(
            Child(
                name=f"{replica.name}-engine",
                argv=[engine_python, *engine.command[1:]] if engine_python else test_engine,
                env={**env, **with_job_keys(engine.name, engine.env, ENGINE_KEY, SYNC_KEY)},
                log_path=run_dir / "logs" / f"{replica.name}-engine.log",
            )
        )
        sidecars.append(
            Child(
                name=f"{replica.name}-sidecar",
                argv=[sys.executable, *sidecar.command[1:]],
                env={
                    **env,
                    **with_job_keys(sidecar.name, sidecar.env, ENGINE_KEY, SYNC_KEY),
                    "LORARL_SYNC_TIMEOUT": "60",
                },
                log_path=run_dir / "logs" / f"{replica.name}-sidecar.log",
            )
        )
        engine_urls.append(f"http://{HOST}:{port}")
        sidecar_urls.append(f"http://{HOST}:{sidecar.ports['sidecar']}")
    rollout = Rollout(jp, engines, sidecars, engine_urls, sidecar_urls)
    for i, (engine, sidecar) in enumerate(zip(engines, sidecars, strict=True)):
        if only is None or i in only:
            engine.start()
            sidecar.start()
    return rollout


def wait_for(
    what: str, predicate: Callable[[], Any], timeout: float = 60.0, children: list[Child] = ()
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for child in children:
            if child.poll() is not None:
                raise AssertionError(f"{child.name} died while waiting for {what}:\n{child.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.name}\n{c.tail()}" for c in children)
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")
        time.sleep(0.1)


def wait_ready(rollout: Rollout, sender: SyncSender, timeout: float = 90.0) -> None:
    """Every sidecar up (it answers once its engine is) and registered in the sender's store."""
    children = [*rollout.engines, *rollout.sidecars]
    for i in range(len(rollout.sidecars)):
        wait_for(f"sidecar {i} /healthz", lambda i=i: rollout.healthz(i) != 0, timeout, children)
    count = len(rollout.sidecars)
    wait_for(
        f"{count} sidecars registered",
        lambda: len(sender.registered()) == count,
        timeout,
        children,
    )


# ----------------------------------------------------------------------------- reference


def peft_greedy(model_dir: Path, tensors: dict | None, rank: int = RANK):
    """Greedy tokens and their logprobs from a PeftModel carrying `tensors` (None: base model)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tensors is not None:
        config = LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=sorted(LEAVES))
        model = get_peft_model(model, config)
        result = set_peft_model_state_dict(model, tensors)
        assert not result.unexpected_keys, result.unexpected_keys
    ids, lps = list(PROMPT), []
    with torch.no_grad():
        for _ in range(N_TOKENS):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(PROMPT) :], lps


def assert_serves(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0], f"greedy tokens {got[0]} != reference {want[0]}"
    diff = max(abs(a - b) for a, b in zip(got[1], want[1], strict=True))
    assert diff < 1e-4, f"logprobs differ from the PeftModel by {diff:.2e}"


# ----------------------------------------------------------------------------- fixture


@dataclass
class Pod:
    rollout: Rollout
    sender: SyncSender
    model_dir: Path
    mode: str
    base_greedy: tuple[list[int], list[float]]
    version: int = 0
    sent_bytes: int = 0

    def model_name(self, version: int) -> str:
        return f"lorarl-v{version}" if self.mode == "adapter" else "base"

    def send(self, tensors: dict, rank: int = RANK) -> SyncResult:
        self.version += 1
        self.sent_bytes += payload_bytes(tensors, self.sender)
        return self.sender.send(tensors, header_for(self.version, self.mode, tensors, rank))


@pytest.fixture(scope="module", params=["merged", "adapter"])
def pod(request, tmp_path_factory) -> Iterator[Pod]:
    mode = request.param
    run_dir = tmp_path_factory.mktemp(f"sidecar-{mode}")
    model_dir = make_tiny_model(run_dir / "model", "llama", init_std=0.1)
    job_path = write_job(run_dir / "job.yaml", model_dir, mode, replicas=1)
    rollout = start_rollout(job_path, run_dir, model_dir)
    sender = None
    try:
        sender = SyncSender(HOST, rollout.plan.sync.port, backend="gloo", timeout=60, key=SYNC_KEY)
        wait_ready(rollout, sender)
        yield Pod(rollout, sender, model_dir, mode, peft_greedy(model_dir, None))
    finally:
        if sender is not None:
            sender.close()
        rollout.stop()


# ----------------------------------------------------------------------------- tests


def test_good_versions_are_applied_and_served(pod: Pod) -> None:
    assert pod.rollout.status(0)["version"] is None
    assert pod.rollout.status(0)["replica"] == "rollout-0"
    assert pod.rollout.healthz(0) == 503  # no trainer weights on it yet: not safe to sample
    for seed in (11, 12, 13):
        tensors = lora_tensors(seed)
        result = pod.send(tensors)
        assert result.ok, result.failed
        assert [a.version for a in result.acks] == [pod.version]

        status = pod.rollout.status(0)
        assert status["version"] == pod.version
        assert status["updates"] == pod.version
        assert status["lastError"] is None
        assert status["bytesReceived"] == pod.sent_bytes
        phases = {
            "merged": {"receive", "validate", "merge", "push"},
            "adapter": {"receive", "validate", "write", "load"},
        }[pod.mode]
        assert set(status["seconds"]) == phases
        assert all(v >= 0 for v in status["seconds"].values())

        want = peft_greedy(pod.model_dir, tensors)
        shift = max(abs(a - b) for a, b in zip(want[1], pod.base_greedy[1], strict=True))
        assert want[0] != pod.base_greedy[0] or shift > 1e-2, "the adapter changes nothing"
        assert_serves(pod.rollout.greedy(0, pod.model_name(pod.version)), want)
        if pod.mode == "adapter" and pod.version > 1:
            old = {"model": pod.model_name(pod.version - 1), "prompt": PROMPT, "max_tokens": 1}
            resp = pod.rollout.http.post(f"{pod.rollout.engine_urls[0]}/v1/completions", json=old)
            assert resp.status_code == 404, "the previous adapter version is still loaded"


BAD_UPDATES = {
    "wrong shapes": ["layers.0.self_attn.k_proj", "[4, 130]", "must be [r, in] = [4, 128]"],
    "unknown module": ["model.layers.1.mlp.foo_proj", "not in the base model"],
    "wrong rank": ["header rank 2 != expected rank 4"],
}


def bad_tensors(case: str) -> tuple[dict, int]:
    good = lora_tensors(99)
    if case == "wrong shapes":
        name = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
        return {**good, name: torch.zeros(RANK, 130)}, RANK
    if case == "unknown module":
        extra = "model.layers.1.mlp.foo_proj"
        return {**good, **lora_tensors(1, modules=[extra], shapes={extra: (128, 128)})}, RANK
    return lora_tensors(99, rank=2), 2


def test_bad_updates_are_rejected_and_the_last_good_version_stays(pod: Pod) -> None:
    good = lora_tensors(21)
    assert pod.send(good).ok
    good_version = pod.version
    before = pod.rollout.greedy(0, pod.model_name(good_version))
    assert_serves(before, peft_greedy(pod.model_dir, good))
    rejected = pod.rollout.status(0)["rejected"]

    for case, words in BAD_UPDATES.items():
        tensors, rank = bad_tensors(case)
        result = pod.send(tensors, rank)
        assert not result.ok, f"{case}: the sidecar accepted a bad update"
        (ack,) = result.failed
        assert ack.version == pod.version and not ack.ok
        status = pod.rollout.status(0)
        for word in words:
            assert word in ack.message, f"{case}: {word!r} not in ack {ack.message!r}"
            assert word in status["lastError"], f"{case}: {word!r} not in {status['lastError']}"
        assert status["version"] == good_version
        rejected += 1
        assert status["rejected"] == rejected
        assert pod.rollout.greedy(0, pod.model_name(good_version)) == before, case

    recovered = lora_tensors(22)
    assert pod.send(recovered).ok, "a good update after rejected ones must apply"
    assert pod.rollout.status(0)["lastError"] is None
    assert_serves(
        pod.rollout.greedy(0, pod.model_name(pod.version)), peft_greedy(pod.model_dir, recovered)
    )


def test_a_header_that_lies_is_refused_and_the_sidecar_keeps_serving(pod: Pod, monkeypatch) -> None:
    """A header whose offsets do not fit its bucket (issue 16): the old sidecar process died on
    it; now it nacks with the reason, counts a rejection, and applies the next good update."""
    assert pod.send(lora_tensors(31)).ok
    good_version, rejected = pod.version, pod.rollout.status(0)["rejected"]
    real_pack = transport.pack

    def lying_pack(*args, **kwargs) -> list[Bucket]:
        first, *rest = real_pack(*args, **kwargs)
        entries = (first.spec.entries[0].model_copy(update={"offset": 1 << 30}),)
        lie = first.spec.model_copy(update={"entries": entries + first.spec.entries[1:]})
        return [Bucket(lie, first.buffer), *rest]

    monkeypatch.setattr(transport, "pack", lying_pack)
    result = pod.send(lora_tensors(32))
    (ack,) = result.failed
    assert not ack.ok and "exceed the bucket" in ack.message, ack.message
    # The receiver nacks before it raises, so the sidecar counts the refusal just after.
    status = wait_for("the refusal in /status", lambda: _counted(pod, rejected + 1), timeout=10)
    assert "exceed the bucket" in status["lastError"] and status["version"] == good_version
    monkeypatch.undo()
    recovered = lora_tensors(33)
    assert pod.send(recovered).ok
    assert_serves(
        pod.rollout.greedy(0, pod.model_name(pod.version)), peft_greedy(pod.model_dir, recovered)
    )


def _counted(pod: Pod, rejected: int) -> dict[str, Any] | None:
    status = pod.rollout.status(0)
    return status if status["rejected"] == rejected else None
