"""Documents from the sources given on the command line: text files, directories, JSONL and Parquet.

Every document has a stable key (its identity for the train/eval assignment, see the dataset spec): a text
file's path relative to the source root given, "<relative path>:<line number>" for a JSONL line and
"<relative path>:<row>" for a Parquet row (rows counted from 0, lines from 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dilocod.data.errors import DataError

JSONL = ".jsonl"
PARQUET = ".parquet"
PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Document:
    key: str  # stable identity, decides train or eval
    text: str


def _files_under(root: Path) -> list[Path]:
    """Regular files under ``root`` sorted by relative path, hidden files and directories skipped."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _text_document(path: Path, key: str, *, strict: bool) -> Iterator[Document]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
        return  # a binary file inside a directory (an image, a .pyc) is not text: skip it, as ever
    yield Document(key, text)


def _jsonl_documents(path: Path, rel: str, field: str) -> Iterator[Document]:
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(raw)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueError
                detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(f"{where}: not valid JSON ({detail})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            text = record.get(field)
            if not isinstance(text, str):
                raise DataError(f"{where}: missing string field {field!r}")
            yield Document(f"{rel}:{lineno}", text)


def _parquet_documents(path: Path, rel: str, field: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    names = file.schema_arrow.names
    if field not in names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names) or 'none'})")
    column_type = file.schema_arrow.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {field!r} holds {column_type}, not strings")
    row = 0
    try:
        # Record batches: a Parquet file of many GB is read a slice at a time, never whole.
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise DataError(f"{path}: row {row}: column {field!r} is null")
                yield Document(f"{rel}:{row}", text)
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None


def _file_documents(path: Path, rel: str, field: str, *, strict: bool) -> Iterator[Document]:
    if path.suffix == JSONL:
        return _jsonl_documents(path, rel, field)
    if path.suffix == PARQUET:
        return _parquet_documents(path, rel, field)
    return _text_document(path, rel, strict=strict)


def _source_documents(source: Path, field: str) -> Iterator[Document]:
    if not source.exists():
        raise DataError(f"{source}: no such file or directory")
    if source.is_dir():
        for path in _files_under(source):
            yield from _file_documents(path, path.relative_to(source).as_posix(), field, strict=False)
    elif source.is_file():
        yield from _file_documents(source, source.name, field, strict=True)
    else:
        raise DataError(f"{source}: neither a regular file nor a directory")


def check_sources(sources: Sequence[Path]) -> None:
    """Fail at once (not after an hour of tokenizing) when a source does not exist."""
    if not sources:
        raise DataError("no sources given")
    for source in sources:
        if not Path(source).exists():
            raise DataError(f"{source}: no such file or directory")


def iter_documents(sources: Sequence[Path], *, text_field: str = "text") -> Iterator[Document]:
    """Every document of ``sources`` in order (the sources in the order given, files in sorted order)."""
    check_sources(sources)
    for source in sources:
        try:
            yield from _source_documents(Path(source), text_field)
        except OSError as e:
            raise DataError(f"{e.filename or source}: cannot read ({e.strerror or e})") from None
