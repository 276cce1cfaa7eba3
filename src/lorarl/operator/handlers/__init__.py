"""kopf handlers, one concern per module; importing this package registers them."""

from lorarl.operator.handlers import create, pods, scale, setup, suspend, timer, webhook

__all__ = ["create", "pods", "scale", "setup", "suspend", "timer", "webhook"]
