"""Dataset INPUTs of `wicore caption` / `wicore enqueue`, read as streams: memory holds one Parquet
row group, one Arrow record batch or one tar sample at a time, whatever the dataset's size.

- Parquet (`x.parquet`): one input per row. The image column holds the image's bytes (binary, or a
  struct with `bytes` / `path` as Hugging Face's Image feature stores it), a path (relative to the
  file's folder) or an s3:// URL; http(s) URLs get an error line (not supported yet). The key of a
  row: its key column's value, else `x.parquet:<row number>`.
- WebDataset tar shards (`x.tar`, `x.tar.gz`, `x.tgz`): members grouped by key as WebDataset does
  (`dir/0001.jpg`, `dir/0001.json`: one sample `dir/0001`); one input per sample, keyed
  `x.tar:dir/0001`. A `.json` member is the sample's metadata; the prompt column names a member
  extension holding the prompt (`--prompt-column txt` for `0001.txt`).
- A `datasets` folder from `save_to_disk` (its Arrow files, listed in state.json; every split of a
  DatasetDict), read like Parquet without the `datasets` package.
- s3://: an object of any of these kinds, or a prefix: its images one input each, its Parquet and
  tar objects as above. Globs (`shards/*.tar`, `s3://b/shards-*.tar`) expand in name order.

A dataset that cannot be read (a truncated Parquet file, a tar cut mid-member or with a corrupt
header) gets an error line keyed by what could not be read; its readable rows keep theirs.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from wicore.cli.object_store import Store, has_glob, is_s3, store_errors
from wicore.defaults import MAX_IMAGE_BYTES

PARQUET_SUFFIXES = (".parquet",)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
IMAGE_COLUMNS = ("image", "img", "jpg", "jpeg", "png", "webp", "image_bytes", "bytes", "path", "image_path", "file_name",
                 "url", "image_url")  # fmt: skip
KEY_COLUMNS = ("key", "__key__", "id", "input")
PROMPT_COLUMN = "prompt"
BATCH_ROWS = 64  # rows turned into Python objects at a time


@dataclass(frozen=True)
class DatasetOptions:
    image_column: str | None = None  # default: the first of IMAGE_COLUMNS present
    key_column: str | None = None  # default: the first of KEY_COLUMNS present, else the row number
    prompt_column: str = PROMPT_COLUMN  # a column (tar: a member extension) holding each input's prompt
    s3_endpoint_url: str | None = None
    max_image_bytes: int = MAX_IMAGE_BYTES

    @property
    def store(self) -> Store:
        return Store(self.s3_endpoint_url)


@dataclass(frozen=True)
class Row:
    """One input read from a dataset, before it is an InputItem."""

    key: str
    data: bytes | None = None
    prompt: str | None = None
    metadata: dict[str, Any] | None = None
    error: str | None = None


def is_dataset_file(url: str) -> bool:
    return url.lower().endswith(PARQUET_SUFFIXES + TAR_SUFFIXES)


def is_dataset(url: str, store: Store) -> bool:
    """Whether INPUT `url` is read here (rather than as a local image, folder or manifest)."""
    if is_s3(url) or is_dataset_file(url) or (has_glob(url) and not store.exists(url)):
        return True
    return is_saved_dataset(url, store)


def is_saved_dataset(url: str, store: Store) -> bool:
    return any(store.exists(posixpath.join(url, name)) for name in ("state.json", "dataset_dict.json"))


def dataset_rows(url: str, options: DatasetOptions) -> Iterator[Row]:
    store = options.store
    if has_glob(url) and not store.exists(url):
        for match in store.glob(url):
            yield from dataset_rows(match, options)
    elif url.lower().endswith(PARQUET_SUFFIXES):
        yield from parquet_rows(url, options)
    elif url.lower().endswith(TAR_SUFFIXES):
        yield from tar_rows(url, options)
    elif is_saved_dataset(url, store):
        yield from saved_dataset_rows(url, options)
    elif is_s3(url) and store.is_dir(url):
        yield from prefix_rows(url, options)
    else:
        yield s3_image_row(url, store.size(url), options)


def require_extras(urls: list[str]) -> None:
    """Fail now, in one line naming the `datasets` extra, when these dataset INPUTs need it and it is
    not installed: tar shards on the local disk need only the standard library."""
    from wicore.cli.failures import require

    if any(not url.lower().endswith(TAR_SUFFIXES) or is_s3(url) for url in urls):
        require("pyarrow")
    if any(is_s3(url) for url in urls):
        require("s3fs", extra="datasets")


def missing(urls: list[str], store: Store) -> list[str]:
    """The dataset INPUTs that name nothing (no such file, object, prefix or glob match)."""
    return [url for url in urls if not (store.glob(url) if has_glob(url) else store.exists(url))]


# -- s3 prefixes and objects ---------------------------------------------------------------------


def prefix_rows(prefix: str, options: DatasetOptions) -> Iterator[Row]:
    for url, size in options.store.find(prefix).items():
        if is_dataset_file(url):
            yield from dataset_rows(url, options)
        else:
            yield s3_image_row(url, size, options)


def s3_image_row(url: str, size: int, options: DatasetOptions) -> Row:
    if not url.lower().endswith(tuple("." + ext for ext in IMAGE_EXTENSIONS)):
        kinds = " ".join(sorted("." + ext for ext in IMAGE_EXTENSIONS))
        return Row(url, error=f"InputError: {url}: not an image, Parquet or tar object (images: {kinds})")
    if size > options.max_image_bytes:
        return Row(url, error=too_large(url, size, options.max_image_bytes))
    try:
        with options.store.open(url) as source:
            return Row(url, data=source.read())
    except store_errors() as exc:
        return Row(url, error=f"ImageError: {url}: cannot read ({exc})")


def too_large(where: str, size: int, limit: int) -> str:
    return f"ImageTooLarge: {where}: {size} bytes is over the {limit}-byte limit (max_image_bytes)"


# -- Parquet and Arrow ---------------------------------------------------------------------------


def parquet_rows(url: str, options: DatasetOptions) -> Iterator[Row]:
    require_pyarrow()
    import pyarrow.parquet as pq

    def columns_of(reader) -> list[str]:
        return reader.schema_arrow.names

    yield from arrow_table_rows(url, options, "Parquet", pq.ParquetFile, columns_of, row_group_batches)


def arrow_table_rows(url: str, options: DatasetOptions, kind: str, open_reader, columns_of, batches) -> Iterator[Row]:
    """The rows of a Parquet or Arrow file: `open_reader(source)` reads it, `columns_of(reader)` names
    its columns, `batches(reader, columns)` gives its record batches; a file that does not open is
    one error line."""
    import pyarrow as pa

    try:
        source = options.store.open(url)
        reader = open_reader(source)
    except (pa.ArrowException, *store_errors()) as exc:
        yield Row(url, error=f"InputError: {url}: not a readable {kind} file ({exc})")
        return
    with source:
        columns = chosen_columns(url, columns_of(reader), options)
        if isinstance(columns, str):
            yield Row(url, error=columns)
            return
        yield from table_rows(url, batches(reader, [c for c in columns if c]), columns, options)


def row_group_batches(reader, columns: list[str]):
    """Record batches of one row group at a time (`iter_batches` keeps more and more memory as it
    goes through a file; a row group read whole and let go does not)."""
    for index in range(reader.num_row_groups):
        yield from reader.read_row_group(index, columns=list(dict.fromkeys(columns)), use_threads=False).to_batches(
            BATCH_ROWS
        )


def saved_dataset_rows(folder: str, options: DatasetOptions) -> Iterator[Row]:
    """A `save_to_disk` folder: a Dataset (state.json lists its Arrow files) or a DatasetDict
    (dataset_dict.json lists its splits, each a Dataset folder)."""
    store = options.store
    splits = read_json(store, posixpath.join(folder, "dataset_dict.json"))
    if isinstance(splits, dict):
        for split in splits.get("splits", []):
            yield from saved_dataset_rows(posixpath.join(folder, str(split)), options)
        return
    state = read_json(store, posixpath.join(folder, "state.json"))
    files = state.get("_data_files", []) if isinstance(state, dict) else []
    if not files:
        yield Row(folder, error=f"InputError: {folder}: not a `datasets` folder (state.json lists no data files)")
    for entry in files:
        yield from arrow_rows(posixpath.join(folder, str(entry.get("filename"))), options)


def read_json(store: Store, url: str) -> Any:
    try:
        with store.open(url) as source:
            return json.load(source)
    except (OSError, ValueError):
        return None


def arrow_rows(url: str, options: DatasetOptions) -> Iterator[Row]:
    """An Arrow IPC stream file as `save_to_disk` writes them."""
    require_pyarrow()
    import pyarrow as pa

    def columns_of(reader) -> list[str]:
        return reader.schema.names

    def batches(reader, columns: list[str]):
        return reader

    yield from arrow_table_rows(url, options, "Arrow", pa.ipc.open_stream, columns_of, batches)


def require_pyarrow() -> None:
    from wicore.cli.failures import require

    require("pyarrow")


Columns = tuple[str, str | None, str | None]  # (image, key, prompt)


def chosen_columns(url: str, names: list[str], options: DatasetOptions) -> Columns | str:
    """The image, key and prompt columns, or the error line when the image or key column is not there."""
    image = options.image_column or next((c for c in IMAGE_COLUMNS if c in names), None)
    key = options.key_column or next((c for c in KEY_COLUMNS if c in names), None)
    columns = f"(columns: {', '.join(names)})"
    if image is None:
        return f"InputError: {url}: no image column {columns}; name it with --image-column"
    for flag, wanted in (("--image-column", image), ("--key-column", key)):
        if wanted is not None and wanted not in names:
            return f"InputError: {url}: no column {wanted!r} ({flag}) {columns}"
    return image, key, options.prompt_column if options.prompt_column in names else None


def table_rows(url: str, batches, columns: Columns, options: DatasetOptions) -> Iterator[Row]:
    """Rows of record batches; a batch that cannot be read ends the file with an error line."""
    import pyarrow as pa

    image, key, prompt = columns
    number = 0
    try:
        for batch in batches:
            for values in batch.select([c for c in columns if c]).to_pylist():
                yield column_row(url, number, values, columns, options)
                number += 1
    except (pa.ArrowException, *store_errors()) as exc:
        yield Row(f"{url}:{number}", error=f"InputError: {url}: unreadable from row {number} on ({exc})")


def column_row(url: str, number: int, values: dict, columns: Columns, options: DatasetOptions) -> Row:
    image, key, prompt = columns
    name = str(values[key]) if key and values.get(key) is not None else f"{url}:{number}"
    text = values.get(prompt) if prompt else None
    prompt_text = text if isinstance(text, str) and text else None
    data, error = image_value(url, name, values.get(image), options)
    return Row(name, data=data, prompt=prompt_text, error=error)


def image_value(url: str, name: str, value: Any, options: DatasetOptions) -> tuple[bytes | None, str | None]:
    """(bytes, None) or (None, the error line) for an image column's value."""
    if isinstance(value, dict):  # Hugging Face's Image feature: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes):
        return value, None
    if not isinstance(value, str) or not value:
        return None, f"InputError: {name}: no image in row ({url})"
    if value.startswith(("http://", "https://")):
        return None, f"InputError: {name}: image URLs ({value}) are not supported yet; use bytes, paths or s3://"
    where = value if is_s3(value) or posixpath.isabs(value) else posixpath.join(posixpath.dirname(url), value)
    return read_image(name, where, options)


def read_image(name: str, url: str, options: DatasetOptions) -> tuple[bytes | None, str | None]:
    try:
        return options.store.read(url, options.max_image_bytes), None
    except FileNotFoundError:
        return None, f"InputError: {url}: no such file ({name})"
    except store_errors() as exc:
        return None, f"ImageError: {url}: cannot read ({exc})"
    except ValueError:
        return None, too_large(url, options.store.size(url), options.max_image_bytes)


# -- WebDataset tar shards -----------------------------------------------------------------------


def sample_key(member_name: str) -> tuple[str, str]:
    """('dir/0001', 'seg.png') for 'dir/0001.seg.png': WebDataset splits at the basename's first dot."""
    folder, base = posixpath.split(member_name)
    stem, _, extension = base.partition(".")
    return posixpath.join(folder, stem), extension.lower()


def tar_rows(url: str, options: DatasetOptions) -> Iterator[Row]:
    try:
        source = options.store.open(url)
    except store_errors() as exc:
        yield Row(url, error=f"InputError: {url}: cannot read ({exc})")
        return
    with source:
        yield from shard_rows(url, source, options)


def shard_rows(url: str, source, options: DatasetOptions) -> Iterator[Row]:
    """Samples in member order; a tar cut short or with a corrupt header ends the shard with an
    error line keyed `x.tar:@<offset>` (the samples before it keep theirs)."""
    last = None
    unreadable: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, *store_errors())
    try:
        with tarfile.open(fileobj=source, mode="r|*") as tar:
            for key, members in grouped(tar, options):
                last = key
                yield sample_row(f"{url}:{key}", members, options)
            if not all_zero(tar):
                raise tarfile.ReadError("a corrupt member header; the rest of the shard is unread")
    except unreadable as exc:
        after = f" after sample {last}" if last else ""
        yield Row(f"{url}:@error", error=f"InputError: {url}: unreadable tar{after} ({exc})")


def grouped(tar: tarfile.TarFile, options: DatasetOptions) -> Iterator[tuple[str, dict[str, bytes | int]]]:
    """(sample key, {extension: bytes, or the size of a member over the image limit}), members of
    one key being consecutive as in WebDataset shards."""
    key, members = None, {}
    for member in tar:
        if not member.isfile():
            continue
        member_key, extension = sample_key(member.name)
        if member_key != key and key is not None:
            yield key, members
            members = {}
        key = member_key
        over = member.size > options.max_image_bytes
        members[extension] = member.size if over else read_member(tar, member)
    if key is not None:
        yield key, members


def read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    reader = tar.extractfile(member)
    data = reader.read() if reader is not None else b""
    if len(data) != member.size:
        raise tarfile.ReadError(f"member {member.name} is cut short ({len(data)} of {member.size} bytes)")
    return data


def all_zero(tar: tarfile.TarFile) -> bool:
    """Whether what follows the members is the end-of-archive padding (zero blocks): tarfile stops
    at a corrupt header as if the archive ended there."""
    while chunk := tar.fileobj.read(1 << 16):
        if chunk.strip(b"\0"):
            return False
    return True


def sample_row(name: str, members: dict[str, bytes | int], options: DatasetOptions) -> Row:
    image = options.image_column or next((ext for ext in IMAGE_EXTENSIONS if ext in members), None)
    if image is None or image not in members:
        return Row(name, error=f"InputError: {name}: no image member (members: {', '.join(sorted(members))})")
    data = members[image]
    if isinstance(data, int):
        return Row(name, error=too_large(name, data, options.max_image_bytes))
    return Row(name, data=data, prompt=text_member(members.get(options.prompt_column)), metadata=metadata(members))


def text_member(value: bytes | int | None) -> str | None:
    return value.decode("utf-8", errors="replace").strip() or None if isinstance(value, bytes) else None


def metadata(members: dict[str, bytes | int]) -> dict[str, Any] | None:
    raw = members.get("json")
    try:
        parsed = json.loads(raw) if isinstance(raw, bytes) else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
