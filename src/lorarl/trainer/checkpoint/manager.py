"""Atomic, self-verifying training checkpoints and the final adapter export.

Layout of one checkpoint (`step-000010/`):
  adapter/            PEFT adapter (adapter_model.safetensors + adapter_config.json); loadable by
                      `PeftModel.from_pretrained` and vLLM `--lora-modules` as is
  optimizer.pt        full (unsharded, FQN-keyed) optimizer state from DCP's
                      `get_optimizer_state_dict(full_state_dict=True)`: one file that resumes on
                      any world size, and LoRA optimizer state is small enough for rank 0 to hold
  state.json          step, world size, the job's UID (`job_uid`), and the caller's trainer
                      state (data position, metrics, ...)
  rng.pt              every rank's RNG states
  critic/             PPO only: the critic's PEFT adapter + value_head.safetensors + critic.json
  critic_optimizer.pt PPO only: the critic optimizer's full state, like optimizer.pt
  COMPLETE            written last: a manifest of every file's size and sha256

Everything is written into a hidden temp dir and renamed into place, so a crash leaves either the
old set of checkpoints or the new one, never a half-written `step-*`. Gathering is collective
(every rank calls `save`); only rank 0 touches the disk and it tells the others whether it
succeeded, so a disk error fails all ranks instead of hanging them.

A checkpoint belongs to the job that wrote it (its UID, LORARL_JOB_UID): a manager with a UID
refuses to resume from, replace or prune one another job wrote, naming both UIDs, and deletes
nothing then. One without a UID (written before checkpoints carried one) is taken as this
job's, with a warning, so a job running across the upgrade still resumes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.workloads import JOB_UID_ENV
from lorarl.sync.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter_dir
from lorarl.trainer.checkpoint.files import (
    TMP_PREFIX,
    CheckpointError,
    fsync_tree,
    rank,
    replace_dir,
    run_on_rank0,
    sha256,
    world,
    write_dir_atomically,
)
from lorarl.trainer.model.critic import (
    CRITIC_FILES,
    critic_config,
    critic_state_dict,
    has_critic,
    read_critic_dir,
    set_critic_state_dict,
    write_critic_dir,
)
from lorarl.trainer.model.loading import lora_config, lora_state_dict, set_lora_state_dict

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
ADAPTER_DIR = "adapter"
CRITIC_DIR = "critic"
CRITIC_OPTIMIZER = "critic_optimizer.pt"
STEP_RE = re.compile(r"^step-(\d{6,})$")
JOB_UID_KEY = "job_uid"  # in state.json


def job_uid_from_env(env: dict[str, str] | None = None) -> str | None:
    """This job's UID: set by the operator (the job's metadata.uid) and by `lorarl run
    --local` (the run directory's id); None where nothing set it (a bare trainer in tests)."""
    return (os.environ if env is None else env).get(JOB_UID_ENV) or None


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    trainer_state: dict[str, Any]
    rng_state: dict[str, Any]


# ---------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states in a form `torch.load(weights_only=True)` accepts."""
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, dict):  # only a non-MT19937 generator, which np.random never uses
        raise TypeError("numpy's global RNG is not MT19937")
    name, keys, pos, has_gauss, gauss = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_adapter(peft_model: PeftModel, out_dir: str | Path) -> Path:
    """Write the final adapter atomically (collective: every rank calls it, rank 0 writes)."""
    out_dir = Path(out_dir)
    tensors = lora_state_dict(peft_model)
    config = lora_config(peft_model)

    run_on_rank0(write_dir_atomically, out_dir, lambda tmp: write_adapter_dir(tensors, config, tmp))
    return out_dir


def _optimizer_options(load: bool) -> StateDictOptions:
    if load:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class _CriticPart:
    """What a checkpoint holds of the critic (gathered on every rank, written by rank 0)."""

    tensors: dict[str, torch.Tensor]
    config: LoraConfig
    optim_state: dict[str, Any] | None


def _load_optimizer(model: PeftModel, optimizer: torch.optim.Optimizer | None, file: Path) -> None:
    """Collective: rank 0 reads the full state, DCP broadcasts and shards it."""
    if optimizer is None:
        return
    optim_state: dict[str, Any] = {}
    if rank() == 0:
        optim_state = torch.load(file, weights_only=True)
    set_optimizer_state_dict(model, optimizer, optim_state, options=_optimizer_options(load=True))


# ---------------------------------------------------------------- manager


class CheckpointManager:
    """Saves, finds, prunes and restores checkpoints under one root directory."""

    def __init__(self, root: str | Path, keep_last: int = 3, job_uid: str | None = None) -> None:
        """`job_uid`: stamped into each checkpoint and required of every checkpoint this
        manager resumes from, replaces or prunes; None checks nothing (and stamps nothing)."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.job_uid = job_uid
        self._legacy_warned: set[Path] = set()

    @classmethod
    def from_job(cls, job: LoRARLJob, root: str | Path) -> CheckpointManager:
        """The job's checkpoints under `root`: training.keepCheckpoints of them, owned by the
        job's UID (LORARL_JOB_UID)."""
        return cls(root, job.spec.training.keep_checkpoints, job_uid=job_uid_from_env())

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    # ------------------------------------------------------------ save

    def save(
        self,
        step: int,
        peft_model: PeftModel,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        critic_optimizer: torch.optim.Optimizer | None = None,
        rng_state: dict[str, Any] | None = None,
    ) -> Path:
        """Collective: every rank calls it with the same step. Returns the checkpoint path.

        With a critic on the model (PPO) its adapter, value head and `critic_optimizer`'s state
        are saved too."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        state: dict[str, Any] = {
            "step": step,
            "world_size": world(),
            "time": time.time(),
            "trainer_state": trainer_state,
        }
        if self.job_uid is not None:
            state[JOB_UID_KEY] = self.job_uid
        try:
            state_text = json.dumps(state, indent=2, sort_keys=True)
        except TypeError as exc:
            raise ValueError(f"trainer_state must be JSON-serialisable: {exc}") from exc
        adapter = lora_state_dict(peft_model)
        optim_state = get_optimizer_state_dict(
            peft_model, optimizer, options=_optimizer_options(load=False)
        )
        critic: _CriticPart | None = None
        if has_critic(peft_model):
            critic_optim = None
            if critic_optimizer is not None:
                critic_optim = get_optimizer_state_dict(
                    peft_model, critic_optimizer, options=_optimizer_options(load=False)
                )
            critic = _CriticPart(
                critic_state_dict(peft_model), critic_config(peft_model), critic_optim
            )
        local_rng = rng_state if rng_state is not None else capture_rng_state()
        rngs: list[Any] = [local_rng]
        if dist.is_initialized():
            rngs = [None] * world()
            dist.all_gather_object(rngs, local_rng)
        config = lora_config(peft_model)
        return run_on_rank0(
            self._write, step, adapter, config, optim_state, state_text, rngs, critic
        )

    def _write(
        self,
        step: int,
        adapter: dict[str, torch.Tensor],
        config: LoraConfig,
        optim_state: dict[str, Any],
        state_text: str,
        rngs: list[Any],
        critic: _CriticPart | None,
    ) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        if final.exists():
            self._check_owner(final, "replace")
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            write_adapter_dir(adapter, config, tmp / ADAPTER_DIR)
            torch.save(optim_state, tmp / "optimizer.pt")
            (tmp / "state.json").write_text(state_text)
            torch.save({"world_size": len(rngs), "states": rngs}, tmp / "rng.pt")
            if critic is not None:
                write_critic_dir(critic.tensors, critic.config, tmp / CRITIC_DIR)
                if critic.optim_state is not None:
                    torch.save(critic.optim_state, tmp / CRITIC_OPTIMIZER)
            manifest = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            (tmp / COMPLETE).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
            fsync_tree(tmp)
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("saved checkpoint %s", final)
        self.prune()
        return final

    # ------------------------------------------------------------ owner

    def owner(self, path: Path) -> str | None:
        """The UID of the job that wrote the checkpoint at `path`; None when it records none
        (or its state.json cannot be read: `verify` reports that)."""
        try:
            uid = json.loads((path / "state.json").read_text()).get(JOB_UID_KEY)
        except (OSError, ValueError, AttributeError):
            return None
        return uid if isinstance(uid, str) and uid else None

    def _check_owner(self, path: Path, action: str) -> None:
        """Raise unless the checkpoint at `path` is this job's (see the module docstring)."""
        if self.job_uid is None:
            return
        owner = self.owner(path)
        if owner is None:
            if path not in self._legacy_warned:
                self._legacy_warned.add(path)
                log.warning(
                    "checkpoint %s records no job UID (written before checkpoints carried "
                    "one): taken as this job's (%s)",
                    path,
                    self.job_uid,
                )
            return
        if owner != self.job_uid:
            raise CheckpointError(
                f"checkpoint {path} was written by job UID {owner}, not by this job (UID "
                f"{self.job_uid}): refusing to {action} it. Another job writes to this "
                "training.outputDir: give this job a folder of its own (to start from that "
                "job's weights, set spec.lora.adapterPath to its adapter)"
            )

    # ------------------------------------------------------------ find / prune

    def _step_dirs(self) -> list[Checkpoint]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                found.append(Checkpoint(int(m.group(1)), p))
        return sorted(found, key=lambda c: c.step)

    def verify(self, path: Path) -> str | None:
        """Why `path` is not a usable checkpoint, or None when every file matches its manifest."""
        marker = path / COMPLETE
        if not marker.is_file():
            return f"no {COMPLETE} marker"
        try:
            manifest = json.loads(marker.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable {COMPLETE} marker ({exc})"
        for required in (
            "state.json",
            "optimizer.pt",
            "rng.pt",
            f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}",
            f"{ADAPTER_DIR}/{ADAPTER_CONFIG}",
        ):
            if required not in manifest:
                return f"manifest lacks {required}"
        if any(rel.startswith(f"{CRITIC_DIR}/") for rel in manifest):
            for name in CRITIC_FILES:
                if f"{CRITIC_DIR}/{name}" not in manifest:
                    return f"manifest lacks {CRITIC_DIR}/{name}"
        for rel, meta in manifest.items():
            f = path / rel
            if not f.is_file():
                return f"missing {rel}"
            if f.stat().st_size != meta["size"]:
                return f"{rel} has {f.stat().st_size} bytes, manifest says {meta['size']}"
            if sha256(f) != meta["sha256"]:
                return f"{rel} checksum mismatch"
        try:
            json.loads((path / "state.json").read_text())
            with safe_open(str(path / ADAPTER_DIR / ADAPTER_WEIGHTS), framework="pt") as st:
                st.keys()
        except Exception as exc:
            return f"unreadable file ({exc})"
        return None

    def complete(self) -> list[Checkpoint]:
        """Usable checkpoints, oldest first; broken ones are logged and skipped."""
        good = []
        for ckpt in self._step_dirs():
            reason = self.verify(ckpt.path)
            if reason is None:
                good.append(ckpt)
            else:
                log.warning("skipping checkpoint %s: %s", ckpt.path, reason)
        return good

    def latest(self) -> Checkpoint | None:
        """Newest usable checkpoint; checks newest first and stops at the first good one,
        which must be this job's (CheckpointError otherwise: see the module docstring)."""
        for ckpt in reversed(self._step_dirs()):
            reason = self.verify(ckpt.path)
            if reason is None:
                self._check_owner(ckpt.path, "resume from")
                return ckpt
            log.warning("skipping checkpoint %s: %s", ckpt.path, reason)
        return None

    def start_from(self, policy: str = "auto") -> Checkpoint | None:
        """The checkpoint a starting job continues from under `training.resume`:

        - auto: the newest usable one, None when there is none;
        - never: None; refuses (CheckpointError) when the folder holds a checkpoint this job did
          not write. This job's own (its UID) are still continued: they mean its pods restarted
          after a failure, which a new start would throw away;
        - required: the newest usable one; refuses when there is none.
        """
        if policy == "never":
            earlier = [c for c in self._step_dirs() if self._foreign(c.path)]
            if earlier:
                names = ", ".join(c.path.name for c in earlier[-3:])
                raise CheckpointError(
                    f"training.resume is never, but {self.root} already holds "
                    f"{len(earlier)} checkpoint(s) of an earlier run ({names}; newest step "
                    f"{earlier[-1].step}): to start over, move or delete that folder's step-* "
                    "folders or give this job a new training.outputDir; to continue that run, "
                    "set training.resume to auto"
                )
            return self.latest()  # only this job's own, from before a restart
        if policy not in ("auto", "required"):
            raise ValueError(f"resume policy must be auto, never or required, got {policy!r}")
        found = self.latest()
        if found is None and policy == "required":
            raise CheckpointError(
                f"training.resume is required, but {self.root} holds no usable checkpoint to "
                "continue from: point training.outputDir at the run to continue (the folder "
                "holding checkpoints/), or set training.resume to auto to start from step 0 "
                "when there is none"
            )
        return found

    def _foreign(self, path: Path) -> bool:
        """Whether the checkpoint at `path` was written by some other run than this job: any
        when this manager has no UID, else one recording another UID or none."""
        return self.job_uid is None or self.owner(path) != self.job_uid

    def start_from_shared(self, policy: str = "auto") -> Checkpoint | None:
        """Collective `start_from`: rank 0 decides for every rank, and its refusal fails all."""
        return run_on_rank0(self.start_from, policy)

    def latest_shared(self) -> Checkpoint | None:
        """Collective: rank 0's `latest()` on every rank, so all ranks resume from the same step
        even when only rank 0 can see the checkpoint volume; a refusal there fails every rank."""
        return run_on_rank0(self.latest)

    def prune(self) -> list[Path]:
        """Delete usable checkpoints beyond the newest `keep_last`, and stale temp dirs.

        Broken `step-*` dirs are left for a human to inspect (they are already skipped). If any
        to delete is another job's, nothing is deleted (CheckpointError).
        """
        removed = []
        old = self.complete()[: -self.keep_last]
        for ckpt in old:
            self._check_owner(ckpt.path, "delete")
        for ckpt in old:
            shutil.rmtree(ckpt.path)
            removed.append(ckpt.path)
        for p in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        return removed

    # ------------------------------------------------------------ load

    def load(
        self,
        ckpt: Checkpoint | str | Path,
        peft_model: PeftModel,
        optimizer: torch.optim.Optimizer | None,
        critic_optimizer: torch.optim.Optimizer | None = None,
    ) -> LoadedCheckpoint:
        """Collective: restore adapter weights, optimizer state and this rank's RNG, and with a
        critic on the model its adapter, value head and `critic_optimizer`'s state.

        Only rank 0 reads files (the checkpoint volume need not be shared); the rest comes over
        the process group.
        """
        path = ckpt.path if isinstance(ckpt, Checkpoint) else Path(ckpt)

        with_critic = has_critic(peft_model)

        def read() -> tuple[Any, ...]:
            reason = self.verify(path)
            if reason is not None:
                raise CheckpointError(f"checkpoint {path} is not usable: {reason}")
            self._check_owner(path, "resume from")
            tensors = load_file(str(path / ADAPTER_DIR / ADAPTER_WEIGHTS))
            state = json.loads((path / "state.json").read_text())
            rng = torch.load(path / "rng.pt", weights_only=True)
            critic = None
            if with_critic:
                if not (path / CRITIC_DIR).is_dir():
                    raise CheckpointError(
                        f"checkpoint {path} has no critic, but this job trains one (spec.critic)"
                    )
                if critic_optimizer is not None and not (path / CRITIC_OPTIMIZER).is_file():
                    raise CheckpointError(f"checkpoint {path} has no {CRITIC_OPTIMIZER}")
                critic = read_critic_dir(path / CRITIC_DIR)
            elif (path / CRITIC_DIR).is_dir():
                log.warning("checkpoint %s has a critic this job does not use: ignored", path)
            return tensors, state, rng, critic

        tensors, state, rng, critic = run_on_rank0(read)
        set_lora_state_dict(peft_model, tensors)
        if critic is not None:
            set_critic_state_dict(peft_model, critic)
        _load_optimizer(peft_model, optimizer, path / "optimizer.pt")
        if critic is not None:
            _load_optimizer(peft_model, critic_optimizer, path / CRITIC_OPTIMIZER)
        states = rng["states"]
        if len(states) != world():
            log.warning(
                "checkpoint %s has RNG for %d ranks, now %d: reusing by rank modulo",
                path,
                len(states),
                world(),
            )
        mine = states[rank() % len(states)]
        restore_rng_state(mine)
        return LoadedCheckpoint(int(state["step"]), state["trainer_state"], mine)
