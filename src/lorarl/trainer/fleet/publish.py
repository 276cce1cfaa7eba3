"""Trainer side of the weight sync: gather the LoRA tensors (collective), rank 0 broadcasts them
to every sidecar and waits for every acknowledgement."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal

import torch
from peft import PeftModel

from lorarl.api.reports.status import SyncStatus
from lorarl.sync.buckets import SyncHeader
from lorarl.sync.merge import lora_scaling
from lorarl.sync.names import group_lora_pairs
from lorarl.sync.transport import Registration, SyncResult, SyncSender
from lorarl.trainer.model.loading import lora_config, lora_state_dict

log = logging.getLogger(__name__)


class SyncFailed(RuntimeError):
    pass


class WeightPublisher:
    """Owned by rank 0: the sync sender and the header of each version. Which sidecars receive
    it is the caller's choice (`trainer/fleet/membership.py`: registered and reachable ones)."""

    def __init__(
        self,
        host: str,
        port: int,
        mode: Literal["merged", "adapter"],
        backend: str,
        timeout_s: float = 600.0,
        key: str | bytes | None = None,
        wire_dtype: torch.dtype | None = None,
    ):
        """`key`: the job's sync key; None reads LORARL_SYNC_KEY (missing: SyncKeyMissing).
        `wire_dtype`: what the adapter travels in (the trainer's compute dtype, bf16 on GPU:
        half the bytes of PEFT's fp32 master copy, and the engine computes in bf16 anyway);
        None ships the tensors as they are."""
        self.mode = mode
        self.wire_dtype = wire_dtype
        self._sender = SyncSender(host, port, backend=backend, timeout=timeout_s, key=key)

    @property
    def sender(self) -> SyncSender:
        return self._sender

    def publish(
        self,
        model: PeftModel,
        tensors: dict[str, torch.Tensor],
        version: int,
        members: Sequence[Registration] | None = None,
    ) -> SyncStatus:
        config = lora_config(model)
        header = SyncHeader(
            version=version,
            mode=self.mode,
            scaling=lora_scaling(config.lora_alpha, config.r, config.use_rslora),
            rank=config.r,
            alpha=config.lora_alpha,
            use_rslora=config.use_rslora,
            target_modules=tuple(sorted(group_lora_pairs(tensors))),
        )
        start = time.perf_counter()
        result = self._sender.send(for_the_wire(tensors, self.wire_dtype), header, members)
        self._check(result)
        return SyncStatus(
            version=version,
            seconds=time.perf_counter() - start,
            bytes=result.stats.bytes,
            mode=self.mode,
            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            members=len(result.acks),
        )

    def catch_up(self, members: Sequence[Registration] | None = None, force: bool = False) -> bool:
        """Bring joined or restarted sidecars to the latest version without stopping training;
        False (a no-op) when the membership is unchanged and nobody asked to rejoin. `force`:
        re-send anyway (an engine did not show the version its sidecar acknowledged)."""
        result = self._sender.catch_up(members, force=force)
        if result is None:
            return False
        if result.acks:
            log.info(
                "re-sent version %d to %d sidecar(s) in generation %d",
                result.version, len(result.acks), result.generation,
            )  # fmt: skip
            self._check(result)
        return True

    def service_rejoin(self) -> None:
        self.catch_up()

    def close(self) -> None:
        self._sender.close()

    @staticmethod
    def _check(result: SyncResult) -> None:
        """One refusing sidecar is left out of generation until it catches up (its /healthz says
        so); only when every sidecar refuses is there nothing left to train with."""
        if result.ok:
            return
        details = "; ".join(f"sidecar {a.rank}: {a.message}" for a in result.failed)
        if len(result.failed) == len(result.acks):
            raise SyncFailed(f"weight sync of version {result.version} failed: {details}")
        log.warning("weight sync of version %d: %s", result.version, details)


def for_the_wire(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype` (None: unchanged); the caller's dict is left as is."""
    if dtype is None:
        return tensors
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}


def gather_adapter(model: PeftModel) -> dict[str, torch.Tensor]:
    """Collective on every rank (FSDP's full_tensor); PEFT-named full LoRA tensors."""
    return lora_state_dict(model)
