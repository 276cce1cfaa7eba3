"""Exceptions of the weight-sync protocol.

One base class so a sidecar or trainer can catch every sync failure in one place, and subclasses
so tests and callers can tell a bad adapter (the sender's bug) from a broken wire (retry).
"""

from __future__ import annotations


class SyncError(Exception):
    """Base class of every weight-sync failure."""


class LoraNameError(SyncError, ValueError):
    """A tensor name is not a LoRA name we can map to a Hugging Face base weight."""


class UnsupportedLoraError(SyncError, NotImplementedError):
    """A LoRA variant the sync cannot apply (embedding LoRA, DoRA, LoRA bias)."""


class MissingLoraPairError(SyncError, ValueError):
    """A module has lora_A without lora_B (or the reverse)."""


class UpdateValidationError(SyncError, ValueError):
    """An update disagrees with the base model (shape, rank, unknown module)."""


class SyncTransportError(SyncError, RuntimeError):
    """The process group or its store failed (peer died, timeout); the group must be re-formed."""


class SyncClosed(SyncError):
    """The sender closed the sync channel; no more updates will come."""


class SyncKeyMissing(SyncError):
    """The job's sync key (LORARL_SYNC_KEY) is not set: the channel cannot be authenticated."""


class SyncRefused(SyncError):
    """An update was refused before it reached the engine (bad MAC, lying header, digest
    mismatch); the receiver has reported why and keeps serving."""
