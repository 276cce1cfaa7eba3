"""`lorarl import verl|skyrl|rlinf FILE`: a verl or SkyRL launch script, or an RLinf YAML config,
as a LoRARLJob manifest (lorarl.importer); `lorarl import --table`: the parameter tables of
docs/porting.md."""

from __future__ import annotations

import os
from pathlib import Path

import click

from lorarl.errors import UserError


@click.command("import")
@click.argument("framework", required=False, type=click.Choice(["verl", "skyrl", "rlinf"]))
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Default: stdout. With --table: a doc whose generated regions are rewritten.",
)
@click.option(
    "--name", help="metadata.name (default: the script's or config's experiment/run name)."
)
@click.option(
    "--local", is_flag=True, help="For `lorarl run --local` (no output PersistentVolumeClaim)."
)
@click.option(
    "--table", is_flag=True, help="Print the verl/SkyRL/RLinf parameter tables (docs/porting.md)."
)
def import_cmd(framework, file, output, name, local, table) -> None:
    """Write a LoRARLJob manifest from a verl or SkyRL launch script (Hydra overrides) or an
    RLinf YAML config, with a comment on each parameter it could not carry and why."""
    from lorarl import importer

    if table:
        if framework or file:
            raise click.UsageError("--table takes no FRAMEWORK or FILE")
        if output:  # rewrite the generated regions of a doc (docs/porting.md) in place
            doc = Path(output)
            doc.write_text(importer.update_doc(doc.read_text()))
            click.echo(f"updated {output}")
        else:
            click.echo(importer.porting_tables(), nl=False)
        return
    if not framework or not file:
        raise click.UsageError("give FRAMEWORK (verl, skyrl or rlinf) and FILE, or --table")
    text = Path(file).read_text()
    try:
        result = importer.import_script(
            text,
            framework,
            name=name,
            default_name=Path(file).stem,
            env=os.environ,
            cluster=not local,
        )
    except importer.ScriptError as exc:
        raise UserError(f"{file}: {exc}") from None
    rendered = importer.render(result, Path(file).name)
    if output:
        Path(output).write_text(rendered)
        click.echo(
            f"wrote {output} ({len(result.uncarried)} parameters not carried: see its comments)"
        )
    else:
        click.echo(rendered, nl=False)


COMMANDS = (import_cmd,)
