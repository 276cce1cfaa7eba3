"""Every shell block of README.md works as written on a clean checkout (issue 20).

One test per block, in README order, in one clean copy of the repository (tracked files only, the
built venvs symlinked in), each in a fresh bash with only `.venv` activated: no LORARL_ENGINE_PYTHON
or anything else the Makefile exports. A block marked `skip` in the README source is reported as a
skip with its reason; `cluster` blocks run, in README order, against one cluster of the
`readme_cluster` fixture. How blocks are marked: harness/readme/blocks.py.

The cluster blocks run against a real cluster (harness/readme/cluster.py): the control
plane built from Kubernetes' source, the process kubelet as its Node. Every `kubectl` command is
the real kubectl (apply, wait, get, describe, `rollout status` on what the Deployment controller
writes, `create token`); `helm install` is Helm's own install action through its SDK (no Helm
binary here); the operator and status API run as the chart's pods, and `curl` reaches the status
API, which checks the token with TokenReview and SubjectAccessReview against the Role the README
applies. The job's pods run under the process kubelet, so `kubectl wait ... Succeeded` means the
job trained to its last step. The one stand-in: `kubectl port-forward` is a loopback relay to the
status API Service (the kubelet has no streaming endpoint); the PVCs and their contents, which
the README says the admin provides, exist before the blocks run.
The status-api block must show the job's reward (`expect=`), not only exit 0.

The quickstart block runs `lorarl run examples/quickstart.yaml --local` with no interpreter
variable set, so it fails if the engine interpreter lookup breaks (e.g. resolving the venv's
python symlink, which leaves the venv: every engine then dies with "No module named 'vllm'").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.readme.blocks import Block, ClusterShell, clean_copy, parse_blocks, run_block

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BLOCKS = parse_blocks((ROOT / "README.md").read_text())


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv: run `make setup` first")
    return clean_copy(ROOT, tmp_path_factory.mktemp("readme") / "lorarl")


@pytest.fixture(scope="module")
def readme_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterShell]:
    """An empty cluster (control plane, process kubelet, the example's PVCs) that the README's own
    `helm install` installs the chart into; torn down after the module."""
    from harness.readme.cluster import readme_cluster as harness

    with harness(tmp_path_factory.mktemp("readme-cluster")) as shell:
        yield shell


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.kind == "skip":
        pytest.skip(f"README block {block.name!r} (line {block.line}): {block.reason}")
    checkout = request.getfixturevalue("checkout")
    cluster = None
    if block.kind == "cluster":
        cluster = request.getfixturevalue("readme_cluster")
    outcome = run_block(block, checkout, tmp_path, cluster)
    where = f"README block {block.name!r} (line {block.line})"
    if outcome.failed_command is not None:
        where += f", line {outcome.failed_command[0]}: `{outcome.failed_command[1]}`"
    assert outcome.code == block.exit, (
        f"{where} exited {outcome.code}, expected {block.exit}; output:\n{outcome.output[-6000:]}"
    )
    if block.expect:
        assert re.search(block.expect, outcome.output, re.DOTALL), (
            f"{where}: output does not match {block.expect!r}:\n{outcome.output[-6000:]}"
        )
