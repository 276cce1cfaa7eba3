"""`lorarl import verl|skyrl|rlinf FILE`: a verl or SkyRL launch script, or an RLinf YAML config,
as a LoRARLJob manifest.

The script is read as bash only as far as these scripts go: line continuations, comments,
`VAR=value` / `export VAR=value` assignments and `$VAR`, `${VAR}`, `${VAR:-default}` expansions;
the trainer's command (`python3 -m verl.trainer.main_ppo ...`, `uv run ... -m
skyrl_train.entrypoints.main_base ...`) gives the Hydra overrides `key=value`. An RLinf config is
YAML: its nested keys become dotted names, as Hydra's overrides name them. Each parameter is
looked up in lorarl.api.porting's table (the one `lorarl validate`'s hints and docs/porting.md
use) and converted (`CONVERSIONS`: units, value names); what cannot be carried becomes a comment
in the manifest saying why. The manifest is validated before it is written: a value lorarl
refuses is dropped to a comment too, so the result always validates.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from lorarl.api.porting import FOREIGN_NAMES, RLINF, SKYRL, VERL, ForeignName

FRAMEWORKS = {"verl": VERL, "skyrl": SKYRL, "rlinf": RLINF}
_MODULES = {VERL: ("verl.trainer.main_ppo",), SKYRL: ("skyrl_train.entrypoints.main_base",)}
_TABLE: dict[tuple[str, str], ForeignName] = {(e.framework, e.name): e for e in FOREIGN_NAMES}

# What the frameworks default to where the script does not say (only those the import needs).
_DEFAULT_KL_COEF = {VERL: 0.001, SKYRL: 0.001}
_DEFAULT_KL_LOSS = {VERL: False, SKYRL: True}  # use_kl_loss
# Where each framework's preprocessed data keeps the answer (RLinf's configs name their own).
_ANSWER_KEY = {VERL: "reward_model.ground_truth", SKYRL: "reward_spec.ground_truth"}
_OUTPUT_CLAIM = {"claimName": "rl-outputs", "mountPath": "/output"}


class ScriptError(ValueError):
    """The file is not a script this importer can read (no trainer command in it)."""


@dataclass
class Imported:
    manifest: dict[str, Any]
    # spec field path ("spec.training.miniBatchSize") -> why/how it was converted
    notes: dict[str, list[str]] = field(default_factory=dict)
    # (parameter as written, its value, why it is not in the manifest)
    uncarried: list[tuple[str, str, str]] = field(default_factory=list)
    framework: str = VERL

    def note(self, path: str, text: str) -> None:
        self.notes.setdefault(path, []).append(text)

    def skip(self, key: str, raw: str, why: str) -> None:
        self.uncarried.append((key, raw, why))


# --- reading the script --------------------------------------------------------------------------

_VAR = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_0-9]+)(?::?-(?P<default>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z_0-9]*|[0-9@*]))"
)
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z_0-9]*)=(.*)$")


def _expand(text: str, env: Mapping[str, str], missing: set[str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        if name in env:
            return env[name]
        if m.group("default") is not None:
            return _expand(m.group("default"), env, missing)
        if name in "@*":
            return ""
        missing.add(name)
        return m.group(0)

    return _VAR.sub(sub, text)


def _logical_lines(text: str) -> list[str]:
    """Lines with continuations joined and comments dropped (a `#` that starts a word)."""
    joined = re.sub(r"\\\r?\n", " ", text)
    out = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split("#", 1)[0].split()
        if words:
            out.append(line.strip())
    return out


def read_overrides(
    text: str, framework: str, env: Mapping[str, str] | None = None
) -> tuple[list[tuple[str, str]], set[str]]:
    """The trainer command's Hydra overrides `(key, value as written)`, variables expanded; and
    the variables the script uses without setting (left as written)."""
    variables = dict(env or {})
    missing: set[str] = set()
    for line in _logical_lines(text):
        assign = _ASSIGN.match(line)
        if assign:
            try:
                value = " ".join(shlex.split(assign.group(2), comments=True))
            except ValueError:
                value = assign.group(2)
            variables[assign.group(1)] = _expand(value, variables, set())
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        modules = _MODULES[framework]
        at = next((i for i, w in enumerate(words) if w in modules), None)
        if at is None:
            continue
        overrides = []
        for word in words[at + 1 :]:
            word = _expand(word, variables, missing)
            if "=" not in word or word.startswith("-"):
                continue  # `$@` (gone), a flag such as --config-path
            key, _, value = word.partition("=")
            overrides.append((key.lstrip("+~"), value))
        return overrides, missing
    names = " or ".join(_MODULES[framework])
    raise ScriptError(f"no `python -m {names}` command found: is this a {framework} script?")


_INTERPOLATION = re.compile(r"^\$\{(\.*)([A-Za-z_][\w.]*)\}$")


def read_config(text: str) -> list[tuple[str, str, Any]]:
    """An RLinf (Hydra YAML) config's settings `(dotted key, value as written, value)`: nested
    keys flattened, Hydra's own sections (`defaults`, `hydra`) and nulls (unset) left out, and a
    `${other.key}` reference replaced by that key's value."""
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScriptError(f"not YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ScriptError("not a YAML mapping: is this an RLinf config?")
    flat: dict[str, Any] = {}

    def walk(node: dict[Any, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, f"{name}.")
            elif value is not None:
                flat[name] = value

    walk({k: v for k, v in tree.items() if k not in ("defaults", "hydra")}, "")
    if not any(k.startswith(("actor.", "rollout.", "runner.")) for k in flat):
        raise ScriptError("no actor, rollout or runner section: is this an RLinf config?")
    out = []
    for key, value in flat.items():
        for _ in range(8):  # a reference to a reference
            m = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if m is None:
                break
            dots, target = m.groups()
            if dots:  # relative: `${.x}` is a sibling, each further dot one level up
                parent = key.split(".")[: -len(dots)]
                target = ".".join([*parent, target])
            if target not in flat:
                break
            value = flat[target]
        out.append((key, _scalar(value), value))
    return out


def hydra_value(raw: str) -> Any:
    """A Hydra override's value as Hydra types it: null, booleans, numbers, [lists], strings."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        return float(text)
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [hydra_value(part) for part in _split_list(inner)] if inner else []
    return text


def _split_list(inner: str) -> list[str]:
    try:
        loaded = yaml.safe_load(f"[{inner}]")
        return [str(x) for x in loaded]
    except yaml.YAMLError:
        return [p.strip() for p in inner.split(",")]


# --- conversions ---------------------------------------------------------------------------------


@dataclass
class _Ctx:
    values: dict[str, Any]  # every override, typed
    out: Imported


def _set(ctx: _Ctx, path: str, value: Any) -> None:
    node = ctx.out.manifest
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _get(ctx: _Ctx, path: str, default: Any = None) -> Any:
    node: Any = ctx.out.manifest
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _group_size(ctx: _Ctx) -> int | None:
    for key in (
        "actor_rollout_ref.rollout.n",
        "generator.n_samples_per_prompt",
        "algorithm.group_size",
    ):
        if isinstance(ctx.values.get(key), int):
            return ctx.values[key]
    return None


Conversion = Callable[[_Ctx, ForeignName, Any], "Any | str"]


class _Skip(Exception):
    """Raised by a conversion: the value cannot be carried (the message says why)."""


def _plain(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if isinstance(value, str) and value.startswith("$"):
        raise _Skip(f"{value} is a shell variable the script does not set")
    return value


def _as_list(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    return value if isinstance(value, list) else [value]


def _model(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    from lorarl.api.spec.job import is_hub_id

    if isinstance(value, str) and is_hub_id(value):
        ctx.out.note(
            "spec.model.path",
            f"{value} is a hub id: an init container downloads it before each pod starts "
            "(set spec.model.volume to a claim the pods share to download it once, "
            "spec.model.revision to pin a commit, spec.model.hub.tokenSecret for a gated model)",
        )
    return value


def _prompts_to_samples(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    group = _group_size(ctx)
    if not isinstance(value, int) or group is None:
        raise _Skip(
            "counts prompts, lorarl's miniBatchSize counts samples, and the script "
            "gives no group size to convert with"
        )
    ctx.out.note(e.field or "", f"{e.name}={value} prompts x groupSize {group}")
    return value * group


def _epochs(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if "trainer.total_training_steps" in ctx.values:
        raise _Skip("total_training_steps is given and wins (as in verl)")
    steps = ctx.values.get("runner.max_steps")
    if isinstance(steps, int) and steps > 0:
        raise _Skip("max_steps is given and wins (as in RLinf)")
    ctx.out.note(
        e.field or "",
        f"{e.name}={value}: the trainer runs ceil(epochs x rows / promptsPerStep) steps, where "
        f"{e.framework} drops each epoch's last partial batch (a few steps fewer)",
    )
    return value


_OFFLOAD_KEYS = (
    "fsdp_config.param_offload", "fsdp_config.optimizer_offload",
    "megatron.param_offload", "megatron.grad_offload", "megatron.optimizer_offload",
)  # fmt: skip


def _offload(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    both = [k for k in ctx.values if k.endswith(_OFFLOAD_KEYS)
            and k.startswith("actor_rollout_ref.actor.")]  # fmt: skip
    on = any(ctx.values[k] is True for k in both)
    if on and value is not True:
        raise _Done  # the other one turns offload on (lorarl offloads both together)
    if on and not all(ctx.values[k] is True for k in both):
        ctx.out.note(e.field or "", f"{e.name}=True: {e.note}")
    return on


def _dynamic_bsz(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    switch = _DYNAMIC_BSZ[e.framework]
    if ctx.values.get(switch) is not True:
        raise _Skip(f"applies with {switch.rsplit('.', 1)[-1]}=True only")
    return value


_DYNAMIC_BSZ = {VERL: "actor_rollout_ref.actor.use_dynamic_bsz",
                RLINF: "runner.enable_dynamic_batch_size"}  # fmt: skip


def _steps(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value == -1:
        raise _Done  # unset: the epochs count
    return value


def _seq_length(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if isinstance(ctx.values.get("algorithm.sampling_params.max_new_tokens"), int):
        raise _Done  # max_new_tokens says it
    prompt = ctx.values.get("data.max_prompt_length")
    if not isinstance(value, int) or not isinstance(prompt, int):
        raise _Skip("prompt and response together, and the config gives no max_prompt_length")
    ctx.out.note(e.field or "", f"{e.name}={value} - data.max_prompt_length={prompt}")
    return value - prompt


def _new_tokens(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if isinstance(value, str) and value.startswith("${"):
        if "runner.seq_length" in ctx.values:
            raise _Done  # RLinf's own formula, seq_length - max_prompt_length: _seq_length's
        raise _Skip("a Hydra interpolation the import cannot resolve")
    return value


def _minibatches(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    prompts, group = ctx.values.get("data.rollout_batch_size"), _group_size(ctx)
    if not isinstance(value, int) or value < 1 or not isinstance(prompts, int) or group is None:
        raise _Skip("splits each step's samples, and the config gives no rollout_batch_size "
                    "and group_size to size them with")  # fmt: skip
    ctx.out.note(
        e.field or "", f"{e.name}={value}: {prompts} prompts x groupSize {group} / {value} samples"
    )
    return prompts * group // value


def _top_k(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if isinstance(value, int) and value >= 100_000:  # more than any vocabulary: off
        ctx.out.note(e.field or "", f"{e.name}={value}: more than the vocabulary, so off (-1)")
        return -1
    return value


def _beta(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    prefix = e.name.rsplit(".", 1)[0]
    if e.name.endswith("beta2") and f"{prefix}.adam_beta1" in ctx.values:
        raise _Done  # carried with beta1
    beta1 = ctx.values.get(f"{prefix}.adam_beta1", 0.9)
    beta2 = ctx.values.get(f"{prefix}.adam_beta2", 0.999)
    return [beta1, beta2]


def _placement(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value != "all":
        raise _Skip("placing roles on named GPU ranges: lorarl's placement is colocated or "
                    "separate (spec.rollout.placement)")  # fmt: skip
    return "colocated"


_REWARD_TYPES = {"math": "math_answer", "gsm8k": "gsm8k"}


def _reward_type(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value not in _REWARD_TYPES:
        raise _Skip("an RLinf reward: write it for lorarl as reward.entrypoint (docs/rewards.md)")
    return _REWARD_TYPES[value]


_RESUME = {"auto": "auto", "latest": "auto", "disable": "never", None: "never"}


def _resume(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value not in _RESUME:
        raise _Skip("resuming from a given checkpoint path: lorarl resumes from outputDir only")
    if _RESUME[value] == "never":
        ctx.out.note(e.field or "", f"{e.name}={value}: never refuses to start over another "
                     "run's checkpoints instead of ignoring them")  # fmt: skip
    return _RESUME[value]


_ALGORITHMS = {
    "grpo": "grpo", "gae": "ppo", "ppo": "ppo", "rloo": "rloo", "reinforce_plus_plus":
    "reinforce_pp", "reinforce_pp": "reinforce_pp", "reinpp": "reinforce_pp", "dr_grpo": "dr_grpo",
    "dapo": "dapo",
}  # fmt: skip


def _algorithm(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value not in _ALGORITHMS:
        raise _Skip(f"lorarl's algorithms are {', '.join(sorted(set(_ALGORITHMS.values())))}")
    return _ALGORITHMS[value]


_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": None, "mse": "mse", "k2": "k2", "k3": "k3",
                  "low_var_kl": "low_var_kl"}  # fmt: skip


def _kl_estimator(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if _KL_ESTIMATORS.get(value) is None:
        raise _Skip("lorarl's estimators are k1, k2, k3, low_var_kl, mse")
    return _KL_ESTIMATORS[value]


def _kl_switch(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value is False:
        ctx.out.note("spec.algorithm.kl.coef", f"{e.name}=False: no KL loss")
        return 0.0
    coef_key = e.name.replace("use_kl_loss", "kl_loss_coef")
    if coef_key in ctx.values:
        raise _Done  # kl_loss_coef carries it
    coef = _DEFAULT_KL_COEF[e.framework]
    ctx.out.note("spec.algorithm.kl.coef", f"{e.name}=True with the framework's default {coef}")
    return coef


def _kl_coef(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    switch = e.name.replace("kl_loss_coef", "use_kl_loss")
    if ctx.values.get(switch, _DEFAULT_KL_LOSS[e.framework]) is not True:
        raise _Skip(f"{switch} is not True, so the framework ignores it")
    return value


def _scheduler(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value in ("constant", "cosine"):
        return value
    if value == "constant_with_warmup":
        return "constant"
    raise _Skip("lorarl's schedules are constant and cosine")


def _engine(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value in ("vllm", "sglang"):
        return value
    raise _Skip("lorarl's engines are vllm and sglang")


def _tp(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if (
        ctx.values.get("trainer.placement.colocate_all") is True
        or ctx.values.get("cluster.component_placement.actor,rollout,reward") == "all"
    ):
        return value
    _set(ctx, "spec.rollout.gpusPerReplica", value)
    ctx.out.note(
        "spec.rollout.gpusPerReplica", "one engine per rollout pod, on tensorParallelSize GPUs"
    )
    return value


def _gpus(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    ctx.out.note(
        e.field or "",
        f"{e.name}={value}: the trainer's GPUs; {e.framework} runs the engines on them too, "
        "lorarl gives them pods of their own (spec.rollout) unless rollout.placement is colocated",
    )
    return value


def _clip(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if "clip_ratio_high" not in " ".join(ctx.values):
        _set(ctx, "spec.algorithm.clipRatioHigh", value)
    return value


_BACKENDS = ("tensorboard", "mlflow", "wandb")


def _backends(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    names = value if isinstance(value, list) else [value]
    kept = [n for n in names if n in _BACKENDS]
    dropped = [str(n) for n in names if n not in _BACKENDS and n != "console"]
    if dropped:
        ctx.out.skip(e.name, ",".join(dropped), "lorarl's backends are " + ", ".join(_BACKENDS))
    if not kept:
        raise _Done
    return kept


_LOSS_REDUCTION = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean",
                   "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}  # fmt: skip


def _loss_reduction(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value not in _LOSS_REDUCTION:
        raise _Skip("lorarl's aggregations are " + ", ".join(_LOSS_REDUCTION.values()))
    return _LOSS_REDUCTION[value]


def _entrypoint(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    prefix = e.name.rsplit(".", 1)[0]
    path, name = ctx.values.get(f"{prefix}.path"), ctx.values.get(f"{prefix}.name")
    if e.name.endswith(".name"):
        if path is None:
            raise _Skip("names a function in custom_reward_function.path, which is not given")
        raise _Done  # carried with the path
    name = name or "compute_score"  # verl's default
    ctx.out.note(
        "spec.reward.entrypoint",
        f"{prefix}.path={path}, name={name}; in a cluster the "
        "file must be in the pods: reward.configMap or a claim (docs/rewards.md)",
    )
    return f"{path}:{name}"


# Megatron's fused module names, as verl's Megatron LoRA names them, in Hugging Face's names.
_MEGATRON_MODULES = {
    "linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
    "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"],
}  # fmt: skip


def _modules(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    names = value if isinstance(value, list) else [value]
    out = [hf for n in names for hf in _MEGATRON_MODULES.get(n, [n])]
    if out != names:
        ctx.out.note(
            e.field or "", f"{e.name}={_scalar(names)}: Megatron's fused layers, in the "
            "Hugging Face module names lorarl's adapter uses"
        )  # fmt: skip
    return out


_MULTI_TURN = "actor_rollout_ref.rollout.multi_turn.enable"


def _multi_turn(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value is not True:
        raise _Done
    tools = ctx.values.get("actor_rollout_ref.rollout.multi_turn.tool_config_path")
    ctx.out.note(
        "spec.environment.entrypoint",
        f"{e.name}=True: tool_calling, whose tools are built in (params.tools: calculator, "
        "python)" + (f"; the script's tools ({tools}) need an environment class of your own "
        "(module:Class, docs/environments.md)" if tools else ""),
    )  # fmt: skip
    return "tool_calling"


def _environment(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if ctx.values.get(_MULTI_TURN) is not True:
        raise _Skip(f"applies with {_MULTI_TURN}=True only")
    return value


# verl's multi-turn settings that are params of the tool_calling environment.
_ENV_PARAMS = {
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "max_calls_per_turn",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "max_response_chars",
}


def _env_param(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    _environment(ctx, e, value)
    _set(ctx, f"spec.environment.params.{_ENV_PARAMS[e.name]}", value)
    raise _Done


def _dump(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    ctx.out.note(
        e.field or "",
        f"{e.name}={value}: every step stores training.samplesPerStep samples (prompt, "
        "completion, reward, advantage) in outputDir/samples.jsonl, not every rollout",
    )
    return 1


def _colocate(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    return "colocated" if value is True else "separate"


def _env_class(ctx: _Ctx, e: ForeignName, value: Any) -> Any:
    if value != "gsm8k":
        raise _Skip(
            "a SkyRL environment class: write its reward (reward.entrypoint) or "
            "environment (spec.environment) for lorarl"
        )
    return "gsm8k"


class _Done(Exception):
    """Raised by a conversion that set what it needed itself (or left it to another key)."""


CONVERSIONS: dict[str, tuple[Conversion, str]] = {
    "": (_plain, "as written"),
    "list": (_as_list, "a single name becomes a one-item list"),
    "model": (_model, "as written; a hub id gets a comment on its cache and revision"),
    "prompts": (_prompts_to_samples, "x groupSize (prompts to samples)"),
    "epochs": (_epochs, "not with a step count (total_training_steps, max_steps)"),
    "offload": (_offload, "on when either is true"),
    "dynamic_bsz": (_dynamic_bsz, "only with use_dynamic_bsz=True"),
    "resume": (_resume, "auto, latest: auto; disable, null: never"),
    "algorithm": (_algorithm, "gae: ppo, reinforce_plus_plus: reinforce_pp"),
    "kl_estimator": (_kl_estimator, "kl: k1; abs has none"),
    "kl_switch": (_kl_switch, "False: coef 0; True: coef from kl_loss_coef"),
    "scheduler": (_scheduler, "constant or cosine"),
    "engine": (_engine, "vllm or sglang (hf has none)"),
    "tp": (_tp, "also rollout.gpusPerReplica"),
    "gpus": (_gpus, "trainer GPUs only"),
    "clip": (_clip, "both clipRatioLow and clipRatioHigh"),
    "backends": (_backends, "console dropped (always on)"),
    "loss_reduction": (_loss_reduction, "token_mean: token-mean, ..."),
    "entrypoint": (_entrypoint, "path.py:name (name defaults to compute_score)"),
    "colocate": (_colocate, "true: colocated"),
    "env_class": (_env_class, "gsm8k only"),
    "modules": (
        _modules,
        "Megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2: the Hugging Face names",
    ),
    "multi_turn": (_multi_turn, "True: tool_calling"),
    "environment": (_environment, "with multi_turn.enable=True"),
    "env_param": (_env_param, "with multi_turn.enable=True, as tool_calling's param"),
    "dump": (_dump, "samplesInterval 1 (samples, not every rollout)"),
    "steps": (_steps, "-1: unset (the epochs count)"),
    "seq_length": (_seq_length, "minus data.max_prompt_length (unless max_new_tokens is set)"),
    "new_tokens": (_new_tokens, "as written (from seq_length where it refers to it)"),
    "minibatches": (_minibatches, "rollout_batch_size x group_size / n_minibatches samples"),
    "top_k": (_top_k, "100000 or more: off (-1)"),
    "beta": (_beta, "[adam_beta1, adam_beta2]"),
    "placement": (_placement, "all: colocated"),
    "reward_type": (_reward_type, "math: math_answer"),
}
_SPECIAL = {"kl_loss_coef": _kl_coef}
# Conversions that write their own comment (the table's note would repeat it).
_OWN_NOTES = ("prompts", "epochs", "model", "gpus", "entrypoint", "offload", "resume", "modules",
              "multi_turn", "dump", "seq_length", "minibatches", "top_k")  # fmt: skip


# --- building the manifest -----------------------------------------------------------------------


def import_script(
    text: str,
    framework: str,
    *,
    name: str | None = None,
    default_name: str = "imported-job",
    env: Mapping[str, str] | None = None,
    cluster: bool = True,
) -> Imported:
    """The manifest a launch script (an RLinf config) becomes; `framework` is "verl", "skyrl"
    or "rlinf"."""
    fw = FRAMEWORKS[framework]
    missing: set[str] = set()
    if fw == RLINF:
        settings = read_config(text)
        overrides = [(k, raw) for k, raw, _ in settings]
        values = {k: v for k, _, v in settings}
    else:
        overrides, missing = read_overrides(text, fw, env)
        values = {k: hydra_value(v) for k, v in overrides}
    out = Imported(manifest={}, framework=fw)
    ctx = _Ctx(values, out)
    for var in sorted(missing):
        out.skip(
            f"${var}",
            "",
            "the script uses it without setting it: values with it were "
            "left out (set it in the environment of `lorarl import`)",
        )
    for key, raw in overrides:
        if any(f"${v}" in raw or f"${{{v}" in raw for v in missing):
            out.skip(key, raw, "holds an unset shell variable")
            continue
        entry = _TABLE.get((fw, key))
        if (
            isinstance(values[key], str)
            and values[key].startswith("${")
            and not (entry and entry.convert == "new_tokens")
        ):
            out.skip(key, raw, "a Hydra interpolation the import cannot resolve")
            continue
        if entry is None:
            out.skip(key, raw, f"no lorarl setting known for this {fw} parameter")
            continue
        if entry.field is None:
            out.skip(key, raw, entry.note)
            continue
        if entry.field.startswith("spec.critic.") and _algo(values) not in ("gae", "ppo"):
            out.skip(key, raw, "a critic setting, and the algorithm has no critic (ppo only)")
            continue
        convert = _SPECIAL.get(key.rsplit(".", 1)[-1]) or CONVERSIONS[entry.convert][0]
        try:
            value = convert(ctx, entry, values[key])
        except _Skip as exc:
            out.skip(key, raw, str(exc))
            continue
        except _Done:
            continue
        _set(ctx, entry.field, value)
        if entry.note and entry.convert not in _OWN_NOTES:
            out.note(entry.field, f"{key}: {entry.note}")
    _defaults(ctx, fw, name, default_name, cluster)
    _settle(out, cluster)
    return out


def _algo(values: dict[str, Any]) -> Any:
    for key in ("algorithm.adv_estimator", "trainer.algorithm.advantage_estimator",
                "algorithm.adv_type"):  # fmt: skip
        if key in values:
            return values[key]
    return None


def _job_name(ctx: _Ctx, name: str | None, default_name: str) -> str:
    from lorarl.api.resource import MAX_NAME_LENGTH

    raw = (
        name
        or ctx.values.get("trainer.experiment_name")
        or ctx.values.get("trainer.run_name")
        or ctx.values.get("runner.experiment_name")
    )
    slug = re.sub(r"[^a-z0-9]+", "-", str(raw or default_name).lower()).strip("-")
    slug = slug[:MAX_NAME_LENGTH].rstrip("-")
    return slug if slug and slug[0].isalpha() else f"job-{slug}"[:MAX_NAME_LENGTH].rstrip("-")


def _defaults(ctx: _Ctx, fw: str, name: str | None, default_name: str, cluster: bool) -> None:
    """What the manifest needs and the script leaves to the framework's defaults."""
    job = _job_name(ctx, name, default_name)
    out = ctx.out
    m = out.manifest
    spec = m.setdefault("spec", {})
    out.manifest = {"apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob",
                    "metadata": {"name": job}, "spec": spec}  # fmt: skip
    if "path" not in spec.get("model", {}):
        spec.setdefault("model", {})["path"] = "/models/base-model"
        out.note("spec.model.path", "the script names no model: a placeholder")
    data = spec.setdefault("data", {})
    if "answerKey" not in data and fw in _ANSWER_KEY:
        data["answerKey"] = _ANSWER_KEY[fw]
        out.note("spec.data.answerKey", f"where {fw}'s preprocessed data keeps the answer")
    if "trainFiles" not in data:
        data["trainFiles"] = ["/data/train.parquet"]
        out.note("spec.data.trainFiles", "the script names no training data: a placeholder")
    reward = spec.get("reward", {})
    if "entrypoint" not in reward and "function" not in reward:
        files = [f.lower() for f in data.get("trainFiles", [])]
        gsm8k = [f for f in files if "gsm8k" in f]
        function = "gsm8k" if gsm8k and len(gsm8k) == len(files) else "math_answer"
        spec.setdefault("reward", {})["function"] = function
        out.note(
            "spec.reward.function",
            f"{fw} scores by each row's data_source by default; "
            + (
                "chosen from the data's name: check it"
                if function == "gsm8k" or not gsm8k
                else "the data mixes GSM8K with other sources, and lorarl scores every row "
                "with one reward: check it"
            ),
        )
    environment = spec.get("environment", {})
    if environment and "maxResponseTokens" in data:
        # verl's max_response_length bounds the whole episode (every turn, tool results too)
        environment["maxTotalTokens"] = data["maxResponseTokens"]
        out.note(
            "spec.environment.maxTotalTokens",
            "the script's max_response_length: in multi-turn verl it bounds the whole episode; "
            "each turn may use data.maxResponseTokens of what is left",
        )
    kl = spec.get("algorithm", {}).get("kl", {})
    if fw == VERL and kl.get("coef") and "estimator" not in kl:
        kl["estimator"] = "low_var_kl"
        out.note("spec.algorithm.kl.estimator", "verl's default kl_loss_type")
    training = spec.setdefault("training", {})
    if "totalSteps" not in training and "epochs" not in training:
        out.note(
            "spec.training.totalSteps",
            "the script gives no step count: lorarl's default (100) applies",
        )
    if (training.get("evalInterval") or training.get("evalBeforeTrain")) and not data.get(
        "valFiles"
    ):
        for key in ("evalInterval", "evalBeforeTrain"):
            if key in training:
                out.skip(f"spec.training.{key}", str(training.pop(key)), "no validation files")
    if data.get("valFiles") and not (
        training.get("evalInterval") or training.get("evalBeforeTrain")
    ):
        out.skip("data.valFiles", str(data.pop("valFiles")), "evals are off in the script")
    rollout = spec.get("rollout", {})
    if rollout.get("placement") == "colocated":
        gpus = spec.get("trainer", {}).get("gpusPerReplica", 1)
        if "replicas" in rollout:
            out.skip(
                "rollout.replicas",
                str(rollout.pop("replicas")),
                "colocated: one engine per trainer pod",
            )
        rollout["gpusPerReplica"] = rollout["tensorParallelSize"] = gpus
        out.note(
            "spec.rollout.tensorParallelSize", "colocated: each trainer pod's engine spans its GPUs"
        )
    order = ("model", "lora", "algorithm", "optim", "critic", "data", "reward", "environment",
             "training", "trainer", "rollout", "logging")  # fmt: skip
    out.manifest["spec"] = {
        k: spec[k] for k in sorted(spec, key=lambda k: order.index(k) if k in order else len(order))
    }
    spec = out.manifest["spec"]
    if "outputDir" in training:
        out.skip(
            "training.outputDir",
            str(training.pop("outputDir")),
            "outputs go under training.volume in a cluster, under the run directory locally",
        )
    if cluster:
        training["volume"] = dict(_OUTPUT_CLAIM)
        training["outputDir"] = f"{_OUTPUT_CLAIM['mountPath']}/{job}"
        out.note(
            "spec.training.volume",
            "a PersistentVolumeClaim you create (checkpoints and the adapter outlive the pods)",
        )


def _settle(out: Imported, cluster: bool) -> None:
    """Drop each value lorarl refuses (to a comment) until the manifest validates."""
    from lorarl.api.validation import check_manifest

    for _ in range(32):
        problems = check_manifest(out.manifest, cluster=cluster)
        if not problems:
            return
        dropped = False
        for problem in problems:
            if _drop(out.manifest, problem.path):
                out.skip(problem.path, "", f"refused by lorarl: {problem.message}")
                dropped = True
        if not dropped:
            raise ScriptError(
                "the imported manifest does not validate: " + "; ".join(str(p) for p in problems)
            )
    raise ScriptError("the imported manifest does not validate")


def _drop(manifest: dict[str, Any], path: str) -> bool:
    parts = path.split(".")
    if parts[0] != "spec" or len(parts) < 2 or parts[:2] in (["spec", "model"], ["spec", "data"]):
        return False
    node: Any = manifest
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    if isinstance(node, dict) and parts[-1] in node:
        del node[parts[-1]]
        return True
    return False


# --- writing it ----------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _comment(lines: list[str], indent: str, text: str, hang: str = "") -> None:
    for line in textwrap.wrap(text, 98 - len(indent), subsequent_indent=hang):
        lines.append(f"{indent}# {line}")


def _emit(
    node: dict[str, Any], path: str, notes: dict[str, list[str]], lines: list[str], depth: int
) -> None:
    indent = "  " * depth
    for key, value in node.items():
        here = f"{path}.{key}" if path else key
        for text in notes.get(here, []):
            _comment(lines, indent, text)
        if isinstance(value, dict) and value:
            if (
                all(not isinstance(v, dict | list) for v in value.values())
                and len(value) <= 3
                and not any(f"{here}.{k}" in notes for k in value)
            ):
                inner = ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items())
                lines.append(f"{indent}{key}: {{{inner}}}")
                continue
            lines.append(f"{indent}{key}:")
            _emit(value, here, notes, lines, depth + 1)
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: [{', '.join(_scalar(v) for v in value)}]")
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}")


def render(out: Imported, source: str = "") -> str:
    """The manifest as YAML with a comment on every converted field and a block listing what
    was not carried."""
    fw = out.framework
    lines = [
        f"# Imported by `lorarl import` from {fw}"
        + (f" {'config' if fw == RLINF else 'script'} {source}" if source else "")
        + "."
    ]
    lines.append(
        "# Check the comments, then `lorarl validate` (add --deep on the machine that "
        "has the files)."
    )
    if out.uncarried:
        lines.append(f"# Not carried ({len(out.uncarried)}):")
        for key, raw, why in out.uncarried:
            shown = f"{key}={raw}" if raw else key
            _comment(lines, "", f"- {shown}: {why}", hang="    ")
    _emit(out.manifest, "", out.notes, lines, 0)
    return "\n".join(lines) + "\n"


# --- docs/porting.md -----------------------------------------------------------------------------


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def porting_tables() -> str:
    """The generated part of docs/porting.md: one table per framework, then the parameters lorarl
    needs none of, then those that cannot apply to its design."""
    out = []
    for fw in (VERL, SKYRL, RLINF):
        out += [f"### {fw}", "", f"| {fw} parameter | lorarl field | conversion / note |",
                "|---|---|---|"]  # fmt: skip
        for e in FOREIGN_NAMES:
            if e.framework != fw or e.field is None:
                continue
            how = CONVERSIONS[e.convert][1] if e.convert else ""
            note = "; ".join(x for x in (how, e.note) if x)
            out.append(f"| `{e.name}` | `{e.field}` | {_md(note)} |")
        out.append("")
    for title, cannot in (("Needs none", False), ("No equivalent", True)):
        out += [f"### {title}", "", "| framework | parameter | why |", "|---|---|---|"]
        for e in FOREIGN_NAMES:
            if e.field is None and e.cannot_apply is cannot:
                out.append(f"| {e.framework} | `{e.name}` | {_md(e.note)} |")
        out.append("")
    return "\n".join(out[:-1]) + "\n"


EXAMPLE_SCRIPT = "tests/fixtures/porting/verl_gsm8k_grpo_lora.sh"
_EXAMPLE_ENV = {"HOME": "/home/user"}


def example_manifest(root: str = ".") -> str:
    """The worked example of docs/porting.md: verl's GSM8K GRPO LoRA script, imported."""
    from pathlib import Path

    path = Path(root) / EXAMPLE_SCRIPT
    result = import_script(path.read_text(), "verl", env=_EXAMPLE_ENV, default_name=path.stem)
    return render(result, path.name)


_REGION = re.compile(r"(<!-- generated: (\w+) .*?-->\n)(.*?)(<!-- end generated -->)", re.S)


def update_doc(text: str, root: str = ".") -> str:
    """docs/porting.md with its generated regions (tables, example) rewritten."""
    generated = {
        "tables": lambda: porting_tables(),
        "example": lambda: f"```yaml\n{example_manifest(root)}```\n",
    }

    def sub(m: re.Match[str]) -> str:
        return m.group(1) + generated[m.group(2)]() + m.group(4)

    return _REGION.sub(sub, text)
