"""Multi-turn rollout environments (`spec.environment`): the protocol, the built-ins and the
registry that resolves a job's entrypoint (docs/environments.md)."""

from lorarl.environments.base import (
    Environment,
    EnvironmentContractError,
    EnvStep,
    EpisodeItem,
    Message,
    item_messages,
)
from lorarl.environments.registry import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentFactory,
    UnknownEnvironmentError,
    check_environment,
    environment_factory,
    list_environments,
)
from lorarl.environments.single_turn import SingleTurn
from lorarl.environments.tool_calling import ToolCalling, parse_tool_calls
from lorarl.environments.tools import BUILTIN_TOOLS, Tool, ToolError

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_TOOLS",
    "EnvStep",
    "Environment",
    "EnvironmentContractError",
    "EnvironmentFactory",
    "EpisodeItem",
    "Message",
    "SingleTurn",
    "Tool",
    "ToolCalling",
    "ToolError",
    "UnknownEnvironmentError",
    "check_environment",
    "environment_factory",
    "item_messages",
    "list_environments",
    "parse_tool_calls",
]
