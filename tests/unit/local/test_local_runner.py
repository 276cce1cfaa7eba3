from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.api.validation import load_job_file
from lorarl.local import LocalRun
from lorarl.plan import LocalAddressing, plan

ROOT = Path(__file__).resolve().parents[3]


def container_threads(
    job_file: str, cpus: int, monkeypatch, tmp_path, container: str = "trainer", **training
) -> dict[str, str]:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    job = load_job_file(ROOT / "examples" / job_file)
    job.spec.training = job.spec.training.model_copy(update=training)
    run = LocalRun(job, tmp_path)
    run.plan = plan(run.job, LocalAddressing(30000))
    first = next(  # in a rollout pod, or in the trainer's when colocated (the demo)
        c for r in run.plan.roles for x in r.replicas for c in x.containers if c.name == container
    )
    return run._threads(first)


@pytest.mark.parametrize(
    ("job_file", "cpus", "container", "threads"),
    [
        ("demo.yaml", 2, "trainer", "2"),  # 1 rank: the update gets every core
        ("demo.yaml", 2, "engine", "2"),  # 1 engine: so does generation
        ("demo.yaml", 8, "trainer", "8"),
        ("quickstart.yaml", 8, "trainer", "4"),  # 2 ranks share the cores
        ("quickstart.yaml", 8, "engine", "4"),  # and so do 2 engines
        ("quickstart.yaml", 2, "trainer", "1"),
        ("quickstart.yaml", 1, "engine", "1"),  # never zero
    ],
)
def test_on_policy_phases_each_get_every_core(
    job_file, cpus, container, threads, monkeypatch, tmp_path
):
    # OpenMP's default wait (spin briefly, then sleep) is kept: PASSIVE measured slower.
    assert container_threads(job_file, cpus, monkeypatch, tmp_path, container) == {
        "OMP_NUM_THREADS": threads
    }


@pytest.mark.parametrize(
    ("job_file", "cpus", "threads"),
    [("demo.yaml", 2, "1"), ("demo.yaml", 8, "4"), ("quickstart.yaml", 8, "2")],
)
@pytest.mark.parametrize("container", ["trainer", "engine"])
def test_off_policy_phases_overlap_so_they_split_the_cores(
    job_file, cpus, threads, container, monkeypatch, tmp_path
):
    env = container_threads(job_file, cpus, monkeypatch, tmp_path, container, off_policy_steps=1)
    assert env["OMP_NUM_THREADS"] == threads


def test_the_sidecar_keeps_torchs_default(monkeypatch, tmp_path):
    assert container_threads("demo.yaml", 2, monkeypatch, tmp_path, "sidecar") == {}


def test_a_users_thread_setting_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    run = LocalRun(load_job_file(ROOT / "examples" / "demo.yaml"), tmp_path)
    run.plan = plan(run.job, LocalAddressing(30000))
    containers = [c for r in run.plan.roles for x in r.replicas for c in x.containers]
    assert {c.name for c in containers} >= {"trainer", "engine"}
    for container in containers:
        assert run._threads(container) == {}


def test_local_outputs_stay_in_the_run_directory(tmp_path):
    run = LocalRun(load_job_file(ROOT / "examples" / "quickstart.yaml"), tmp_path / "run")
    assert run.job.spec.training.output_dir == str((tmp_path / "run").resolve())


def _children(job_file: str, tmp_path: Path, **job_changes) -> tuple[LocalRun, dict]:
    job = load_job_file(ROOT / "examples" / job_file)
    for section, values in job_changes.items():
        setattr(job.spec, section, getattr(job.spec, section).model_copy(update=values))
    run = LocalRun(job, tmp_path / "run")
    run.run_dir.mkdir()
    run.plan = plan(run.job, LocalAddressing(30000))
    children = {
        f"{r.role}-{c.name}": run._child(r, c)
        for role in run.plan.roles
        for r in role.replicas
        for c in r.containers
    }
    return run, children


def test_a_local_run_locks_its_engines_with_a_fresh_key(tmp_path):
    run, children = _children("quickstart.yaml", tmp_path)
    key = run.engine_api_key
    assert len(key) >= 32 and key != LocalRun(run.job, tmp_path / "other").engine_api_key
    assert children["rollout-engine"].env["VLLM_API_KEY"] == key  # the `$(...)` expanded
    for name in ("rollout-engine", "rollout-sidecar", "trainer-trainer"):
        assert children[name].env["LORARL_ENGINE_API_KEY"] == key
    assert key not in " ".join(children["rollout-engine"].argv)  # vLLM: never on argv


def test_sglang_gets_the_key_through_its_environment_locally(tmp_path):
    """SGLang reads its key from no variable; a local run passes it through the environment to
    a launcher that appends `--api-key` in-process (tests/security/test_lows.py)."""
    run, children = _children("quickstart.yaml", tmp_path, rollout={"engine": "sglang"})
    engine = children["rollout-engine"]
    assert run.engine_api_key not in " ".join(engine.argv) and "--api-key" not in engine.argv
    assert engine.env["LORARL_ENGINE_API_KEY"] == run.engine_api_key


def test_engine_sockets_fit_the_unix_path_limit_in_a_deep_run_directory(tmp_path):
    """vLLM's engine core listens on <VLLM_RPC_BASE_PATH>/<uuid4> (ZMQ ipc), at most 107 bytes:
    a run directory 80 characters deep made `lorarl run` fail at engine start."""
    from lorarl.engines.vllm import vllm_rpc_base
    from lorarl.rollout.vllm_engine import vllm_launch_command

    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    _, children = _children("quickstart.yaml", deep)
    _, launched = vllm_launch_command(
        "/models/m", 8000, served_model_name="base", run_dir=deep / "run", python="python"
    )
    for env in (children["rollout-engine"].env, launched):
        assert len(env["TMPDIR"]) + 37 > 107  # the default would not fit
        socket = f"{env['VLLM_RPC_BASE_PATH']}/{'0' * 36}"
        assert len(socket.encode()) <= 107, socket
    assert vllm_rpc_base("/tmp/run/tmp") == "/tmp/run/tmp"  # short: the sockets stay inside


@pytest.mark.parametrize(("off_policy", "threads"), [(0, "8"), (1, "4")])
@pytest.mark.parametrize("container", ["trainer", "engine"])
def test_a_colocated_engine_counts_like_a_rollout_pods(
    container, off_policy, threads, monkeypatch, tmp_path
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    job = load_job_file(ROOT / "examples" / "demo.yaml")
    job.spec.rollout.placement = "colocated"
    job.spec.training.off_policy_steps = off_policy
    run = LocalRun(job, tmp_path)
    run.plan = plan(run.job, LocalAddressing(30000))
    (replica,) = run.plan.role("trainer").replicas  # no rollout role: the engine is in here
    assert run.plan.role("rollout") is None
    got = run._threads(next(c for c in replica.containers if c.name == container))
    assert got == {"OMP_NUM_THREADS": threads}


@pytest.mark.parametrize(
    ("variable", "leaf"),
    [("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "torchinductor")],
)
def test_every_local_engine_shares_one_compile_cache_the_user_can_move(
    tmp_path, monkeypatch, variable, leaf
):
    """vLLM and Inductor key their cache entries themselves, so runs share one root (a fresh
    vLLM root cost each engine start ~18 s of model-class inspection, a fresh Inductor one a
    graph compile on a GPU engine); the user's variable, then $XDG_CACHE_HOME, decide
    where it is, for a local run's engine and a launched server alike."""
    from lorarl.engines.vllm import inductor_cache_dir, vllm_cache_root
    from lorarl.rollout.vllm_engine import vllm_launch_command

    monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    roots = set()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _, children = _children("quickstart.yaml", tmp_path / name)
        _, launched = vllm_launch_command(
            "/m", 8000, served_model_name="m", run_dir=tmp_path / name / "own", python="python"
        )
        roots |= {children["rollout-engine"].env[variable], launched[variable]}
    assert roots == {str(tmp_path / "xdg" / "lorarl" / leaf)}
    monkeypatch.setenv(variable, str(tmp_path / "mine"))
    (tmp_path / "c").mkdir()
    _, children = _children("quickstart.yaml", tmp_path / "c")
    assert children["rollout-engine"].env[variable] == str(tmp_path / "mine")
    default = {"vllm": vllm_cache_root, "torchinductor": inductor_cache_dir}[leaf]
    assert default({}, "/home/u") == f"/home/u/.cache/lorarl/{leaf}"
