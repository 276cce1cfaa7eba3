"""The sync channel's key: where it comes from (the job's Secret, a local run's own key), who gets
it (trainer and sidecar only), what a process without it does, and what its MACs bind."""

from __future__ import annotations

import faulthandler
import importlib
import json
from pathlib import Path

import pytest
import yaml

from lorarl.api.validation import parse_job
from lorarl.local import LocalRun
from lorarl.operator import builders
from lorarl.plan import LocalAddressing, plan
from lorarl.sync.auth import BadMessage, Registration, Signer, key_from_env
from lorarl.sync.errors import SyncKeyMissing
from lorarl.sync.transport import SyncReceiver, SyncSender

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


# -- what a MAC binds ------------------------------------------------------------------------


def test_an_announcement_verifies_only_for_its_own_operation_and_key() -> None:
    signer = Signer(b"job-key")
    raw = signer.announcement("sync", 2, 7, ("0:ab", "3:cd"))
    assert signer.open_announcement(raw, 7) == ("sync", 2, 7, ("0:ab", "3:cd"))
    with pytest.raises(BadMessage, match="carries seq 7"):
        signer.open_announcement(raw, 8)  # replayed under another key
    forged = json.loads(raw) | {"generation": 3}
    with pytest.raises(BadMessage, match="bad MAC"):
        signer.open_announcement(json.dumps(forged), 7)
    with pytest.raises(BadMessage, match="bad MAC"):
        Signer(b"other-job").open_announcement(raw, 7)
    renumbered = json.loads(signer.announcement("close", 0, 1)) | {"seq": 2}
    with pytest.raises(BadMessage, match="bad MAC"):
        signer.open_announcement(json.dumps(renumbered), 2)
    # The member list decides who forms the group: it is signed like the rest.
    joined = json.loads(raw) | {"members": ["0:ab", "3:cd", "9:ee"]}
    with pytest.raises(BadMessage, match="bad MAC"):
        signer.open_announcement(json.dumps(joined), 7)
    odd = json.loads(raw) | {"members": ["0:ab", {"x": 1}]}
    with pytest.raises(BadMessage, match="members must be a list of member tokens"):
        signer.open_announcement(json.dumps(odd), 7)


def test_a_registration_verifies_only_at_its_own_index_and_key() -> None:
    signer = Signer(b"job-key")
    member = Registration(
        3, "ab12", "http://job-rollout-3.job:30000", "http://job-rollout-3.job:8001"
    )
    raw = signer.registration(member)
    assert signer.open_registration(raw, 3) == member
    with pytest.raises(BadMessage, match="carries index 3"):
        signer.open_registration(raw, 4)  # copied to another replica's slot
    redirected = json.loads(raw) | {"engine": "http://elsewhere:30000"}
    with pytest.raises(BadMessage, match="bad MAC"):
        signer.open_registration(json.dumps(redirected), 3)
    with pytest.raises(BadMessage, match="bad MAC"):
        Signer(b"other-job").open_registration(raw, 3)
    with pytest.raises(BadMessage, match="incarnation must be a hex string"):
        signer.open_registration(json.dumps(json.loads(raw) | {"incarnation": "a:b/c"}), 3)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a JSON object"),
        (json.dumps({"op": "reboot", "generation": 0, "seq": 0}), "op must be one of"),
        (json.dumps({"op": "sync", "generation": True, "seq": 0}), "generation must be"),
        (json.dumps({"op": "sync", "generation": 0, "seq": "0"}), "seq must be"),
        (json.dumps({"op": "sync", "generation": 0, "seq": 0, "mac": 5}), "members must be"),
        (json.dumps({"op": "sync", "generation": 0, "seq": 0, "members": [], "mac": 5}), "bad MAC"),
        (b" " * 200_000, "more than 131072"),
    ],
)
def test_malformed_announcements_raise_bad_message_with_the_reason(raw, reason) -> None:
    with pytest.raises(BadMessage, match=reason):
        Signer(b"k").open_announcement(raw, 0)


def test_a_header_mac_binds_generation_and_operation_and_is_not_an_announcement() -> None:
    signer = Signer(b"job-key")
    sealed = signer.seal_header(b'{"version": 1}', generation=1, seq=4)
    assert signer.open_header(sealed, 1, 4) == b'{"version": 1}'
    for generation, seq in ((1, 5), (2, 4)):
        with pytest.raises(BadMessage, match="bad MAC"):
            signer.open_header(sealed, generation, seq)
    with pytest.raises(BadMessage, match="too short"):
        signer.open_header(sealed[:32], 1, 4)
    announcement = json.loads(signer.announcement("sync", 1, 4))
    value = json.loads(signer.value("seq", 4))
    assert announcement["mac"] != value["mac"]
    assert signer.open_value("seq", json.dumps(value)) == 4
    with pytest.raises(BadMessage, match="bad MAC"):
        signer.open_value("formed", json.dumps({"formed": 4, "mac": value["mac"]}))


# -- no key, no start ------------------------------------------------------------------------


def test_a_sync_end_without_the_key_refuses_before_touching_the_network(monkeypatch) -> None:
    monkeypatch.delenv("LORARL_SYNC_KEY", raising=False)
    with pytest.raises(SyncKeyMissing, match="LORARL_SYNC_KEY is not set"):
        key_from_env()
    with pytest.raises(SyncKeyMissing, match="LORARL_SYNC_KEY"):
        SyncSender("127.0.0.1", 0, backend="gloo")
    with pytest.raises(SyncKeyMissing, match="LORARL_SYNC_KEY"):
        SyncReceiver("127.0.0.1", 1, 0, backend="gloo", timeout=0.1)
    with pytest.raises(SyncKeyMissing, match="must not be empty"):
        SyncSender("127.0.0.1", 0, backend="gloo", key="")
    monkeypatch.setenv("LORARL_SYNC_KEY", "from-the-secret")
    assert key_from_env() == b"from-the-secret"


@pytest.mark.parametrize("program", ["lorarl.rollout.sidecar", "lorarl.trainer.__main__"])
def test_a_sync_process_without_the_key_exits_with_one_line_naming_it(
    program: str, monkeypatch, capsys
) -> None:
    monkeypatch.delenv("LORARL_SYNC_KEY", raising=False)
    monkeypatch.setenv("LORARL_SYNC_WORLD_SIZE", "3")  # a trainer with sidecars
    main = importlib.import_module(program).main
    faulthandler.disable()  # pytest's own; the process must turn it on for a native crash
    assert main(["--config", str(QUICKSTART)]) == 2
    assert faulthandler.is_enabled()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "LORARL_SYNC_KEY is not set" in lines[0], lines


# -- who gets the key ------------------------------------------------------------------------


def _sync_key_refs(pod: dict) -> dict[str, object]:
    return {
        c["name"]: next(
            (e.get("valueFrom") for e in c["env"] if e["name"] == "LORARL_SYNC_KEY"), None
        )
        for c in pod["spec"]["containers"]
    }


def quickstart_with_reward_service():
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["reward"]["service"] = {}
    return parse_job(doc)


def test_the_job_secret_carries_the_sync_key_to_trainer_and_sidecars_only() -> None:
    job = quickstart_with_reward_service()
    p = plan(job)
    secret = builders.engine_key_secret(p, "engine", "sync")
    assert secret["stringData"][builders.SYNC_KEY_KEY] == "sync"
    ref = {"secretKeyRef": {"name": builders.secret_name(job.name), "key": "sync-key"}}
    assert _sync_key_refs(builders.pod(p, job, "trainer", 0)) == {"trainer": ref}
    assert _sync_key_refs(builders.pod(p, job, "rollout", 0)) == {"engine": None, "sidecar": ref}
    assert _sync_key_refs(builders.pod(p, job, "reward", 0)) == {"reward": None}


def test_a_local_run_gives_its_own_sync_key_to_trainer_and_sidecars_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_SYNC_KEY", "a-key-in-the-users-shell")
    run = LocalRun(quickstart_with_reward_service(), tmp_path / "run")
    run.run_dir.mkdir()
    run.plan = plan(run.job, LocalAddressing(30000))
    children = {
        f"{r.role}-{c.name}": run._child(r, c)
        for role in run.plan.roles
        for r in role.replicas
        for c in r.containers
    }
    assert len(run.sync_key) >= 32 and run.sync_key != run.engine_api_key
    have = {name: child.env.get("LORARL_SYNC_KEY") for name, child in children.items()}
    assert have == {
        "trainer-trainer": run.sync_key,
        "rollout-engine": None,
        "rollout-sidecar": run.sync_key,
        "reward-reward": None,
    }
