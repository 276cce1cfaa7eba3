"""The LoRARLJob API: pydantic models are the source of truth for the CRD and for validation."""

from lorarl.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION, LoRARLJob, ObjectMeta
from lorarl.api.spec import RESERVED_ENV, LoRARLJobSpec
from lorarl.api.status import Condition, LoRARLJobStatus

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
