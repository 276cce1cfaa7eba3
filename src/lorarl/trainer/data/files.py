"""Reading prompt rows from the formats users already have.

A source is a .jsonl or .parquet file, a folder of such shards (read in name order), or a folder
written by Hugging Face `datasets`' `save_to_disk`. The last is read with pyarrow directly: its
shards are Arrow IPC streams listed in `state.json`, and this keeps `datasets` (with pandas and
multiprocess) out of the trainer image. Every row comes back paired with its location
("file:line" or "file: row n") so that errors can name it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED_EXTENSIONS", "DataError", "LocatedRow", "is_missing", "lookup", "read_rows"]

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
SAVE_TO_DISK_STATE = "state.json"  # what `Dataset.save_to_disk` writes beside its arrow shards
SAVE_TO_DISK_SPLITS = "dataset_dict.json"  # what `DatasetDict.save_to_disk` writes

LocatedRow = tuple[str, Mapping[str, Any]]
_MISSING = object()


class DataError(ValueError):
    """Bad dataset input; the message names the file, row and key."""


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """`record[key]`, where a dotted key (`reward_model.ground_truth`) walks nested objects.

    A literal top-level key with dots in its name wins. Returns `_MISSING` when absent.
    """
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def is_missing(value: Any) -> bool:
    return value is _MISSING


Required = tuple[tuple[str, str], ...]  # (what, key), e.g. ("prompt", "question")


def read_rows(path: str | Path, required: Required = ()) -> list[LocatedRow]:
    """Every row of one source. `required` keys are checked against parquet/arrow schemas up
    front (by their first dotted part), so a wrong key is one error, not one per row."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: dataset file not found")
    if path.is_dir():
        return _read_dir(path, required)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path, required)
    raise DataError(
        f"{path}: unknown dataset extension {path.suffix!r}; supported: "
        f"{', '.join(SUPPORTED_EXTENSIONS)}, a folder of them, or a `save_to_disk` folder"
    )


def _read_dir(path: Path, required: Required) -> list[LocatedRow]:
    if (path / SAVE_TO_DISK_SPLITS).is_file():
        splits = _json(path / SAVE_TO_DISK_SPLITS).get("splits", [])
        raise DataError(
            f"{path}: a DatasetDict with splits {', '.join(map(str, splits))}; name one split's "
            f"folder, e.g. {path / str(splits[0]) if splits else path / 'train'}"
        )
    if (path / SAVE_TO_DISK_STATE).is_file():
        return _read_save_to_disk(path, required)
    shards = sorted(
        p
        for p in path.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in SUPPORTED_EXTENSIONS
    )
    if not shards:
        raise DataError(
            f"{path}: folder holds no {' or '.join(SUPPORTED_EXTENSIONS)} shards and is not a "
            "`save_to_disk` folder (no state.json)"
        )
    return [row for shard in shards for row in read_rows(shard, required)]


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


def _read_jsonl(path: Path) -> list[LocatedRow]:
    rows: list[LocatedRow] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: malformed JSON line: {exc.msg}") from exc
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            rows.append((where, record))
    return rows


def _read_parquet(path: Path, required: Required) -> list[LocatedRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    return _table_rows(path, table, required)


def _read_save_to_disk(path: Path, required: Required) -> list[LocatedRow]:
    import pyarrow as pa

    state = _json(path / SAVE_TO_DISK_STATE)
    files = state.get("_data_files")
    if not isinstance(files, list) or not files:
        raise DataError(f"{path / SAVE_TO_DISK_STATE}: lists no _data_files")
    rows: list[LocatedRow] = []
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise DataError(f"{path / SAVE_TO_DISK_STATE}: bad _data_files entry {entry!r}")
        shard = path / name
        try:
            with pa.memory_map(str(shard)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{shard}: cannot read arrow shard: {exc}") from exc
        rows.extend(_table_rows(shard, table, required))
    return rows


def _table_rows(path: Path, table: Any, required: Required) -> list[LocatedRow]:
    for what, key in required:
        if key not in table.column_names and key.split(".")[0] not in table.column_names:
            raise DataError(
                f"{path}: {what} key {key!r} is not a column; columns: "
                f"{', '.join(table.column_names)}"
            )
    return [(f"{path}: row {i + 1}", r) for i, r in enumerate(table.to_pylist())]
