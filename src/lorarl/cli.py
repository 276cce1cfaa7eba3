"""The `lorarl` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import yaml

from lorarl.api.validation import ManifestError, load_documents, parse_job, validate_file

DEFAULT_CRD_PATH = Path("crds/lorarljobs.lorarl.dev.yaml")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lorarl")
def main() -> None:
    """lorarl: RL fine-tuning of LLMs with LoRA adapters, as Kubernetes jobs."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-q", "--quiet", is_flag=True, help="Print problems only.")
def validate(files: tuple[str, ...], quiet: bool) -> None:
    """Check LoRARLJob manifests; exit 1 if any has a problem."""
    failed = False
    for file in files:
        for result in validate_file(file):
            if result.ok:
                if not quiet:
                    click.echo(f"{result.source}: ok ({result.job.name})")
                continue
            failed = True
            for problem in result.problems:
                click.echo(f"{result.source}: {problem}", err=True)
    sys.exit(1 if failed else 0)


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
def plan_cmd(file: str, output: str) -> None:
    """Print the job plan (pods, commands, env, ports) a manifest turns into."""
    from lorarl.plan import plan

    try:
        docs = load_documents(file)
        job = parse_job(docs[0][1]) if len(docs) == 1 else None
    except ManifestError as exc:
        _fail(file, exc)
    if job is None:
        raise click.UsageError(f"{file}: holds {len(docs)} documents; plan takes one job")
    data = plan(job).model_dump(mode="json", by_alias=True, exclude_none=True)
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False, width=100), nl=False)


def _fail(source: str, exc: ManifestError) -> None:
    for problem in exc.problems:
        click.echo(f"{source}: {problem}", err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
