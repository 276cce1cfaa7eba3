"""The lorarl operator: kopf reconciles LoRARLJobs into pods, services and status.

`kopf run -m lorarl.operator` or `python -m lorarl.operator`: importing this package registers
the handlers (lorarl.operator.handlers). Pure parts: builders (plan -> objects), status and
decide (observed state -> status and actions), admission (webhook rules).
"""

from lorarl.operator import handlers

__all__ = ["handlers"]
