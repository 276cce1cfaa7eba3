"""The local backend: a JobPlan as processes on loopback."""

from lorarl.local.runner import LocalRun, RunFailed, RunResult

__all__ = ["LocalRun", "RunFailed", "RunResult"]
