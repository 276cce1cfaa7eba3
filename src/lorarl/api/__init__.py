"""The LoRARLJob API: pydantic models are the source of truth for the CRD and for validation."""

from lorarl.api.reports.status import Condition, LoRARLJobStatus
from lorarl.api.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION, LoRARLJob, ObjectMeta
from lorarl.api.spec.job import RESERVED_ENV, LoRARLJobSpec

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "RESERVED_ENV",
    "VERSION",
    "Condition",
    "LoRARLJob",
    "LoRARLJobSpec",
    "LoRARLJobStatus",
    "ObjectMeta",
]
