"""Dataset inputs and outputs of `wicore caption` / `wicore enqueue`: Parquet files, WebDataset tar
shards, a `datasets` folder (save_to_disk's layout, written with pyarrow) and s3:// prefixes on a
real S3-compatible server on loopback (moto's server mode, as s3fs's own tests use); Parquet output
read back with pyarrow; one run per output file. The captions are the bundled demo captioner's, on
the reference engine on CPU, compared with a run over the same images in a folder."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import WICORE, wait_until, wicore, without
from wicore.cli.dataset_inputs import DatasetOptions
from wicore.cli.input_paths import expand_inputs
from wicore.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "images"
IMAGES = sorted(EXAMPLES.iterdir())
CAP = 20_000  # max_image_bytes in these tests: every example is below it
BUCKET = "wicore-data"


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_saved_dataset(folder: Path, rows: list[dict]) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: an Arrow IPC stream, state.json naming it."""
    folder.mkdir(parents=True)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.Table.from_pylist(rows, schema=pa.schema([("image", image), ("key", pa.string())]))
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def stem(path: Path) -> str:
    return path.name.split(".")[0]


def keys(items) -> dict[str, str | None]:
    return {item.input: item.error for item in items}


# -- reading (no workers) -----------------------------------------------------------------------


def test_parquet_rows_by_bytes_path_and_url_with_a_key_column(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(IMAGES[0].read_bytes())
    raw = write_parquet(tmp_path / "raw.parquet", [{"id": "bytes", "image": IMAGES[1].read_bytes(), "prompt": "Why?"}])
    rows = [
        {"id": "path", "image": "pics/a.png"},
        {"id": "url", "image": "https://example.com/x.png"},
        {"id": "gone", "image": "pics/missing.png"},
        {"id": None, "image": None},
    ]
    paths = write_parquet(tmp_path / "paths.parquet", rows)
    by_key = {item.input: item for item in expand_inputs([str(raw), str(paths)])}
    assert list(by_key) == ["bytes", "path", "url", "gone", f"{paths}:3"]
    assert by_key["bytes"].data == IMAGES[1].read_bytes() and by_key["bytes"].prompt == "Why?"
    assert by_key["path"].data == IMAGES[0].read_bytes() and by_key["path"].error is None
    assert "image URLs (https://example.com/x.png) are not supported yet" in by_key["url"].error
    assert by_key["gone"].error == f"InputError: {tmp_path}/pics/missing.png: no such file (gone)"
    assert by_key[f"{paths}:3"].error == f"InputError: {paths}:3: no image in row ({paths})"
    [named] = expand_inputs([str(raw)], DatasetOptions(key_column="prompt"))
    assert named.input == "Why?"
    [wrong] = expand_inputs([str(raw)], DatasetOptions(image_column="picture"))
    assert wrong.error == f"InputError: {raw}: no column 'picture' (--image-column) (columns: id, image, prompt)"


def test_webdataset_shards_group_members_by_key(tmp_path):
    shard = write_shard(tmp_path / "shard-000.tar", [
        ("a/0001.png", IMAGES[0].read_bytes()), ("a/0001.json", b'{"source": "cam1"}'), ("a/0001.txt", b"a hint"),
        ("a/0002.jpg", IMAGES[1].read_bytes()),
        ("a/0003.json", b"{}"),  # no image
        ("a/0004.png", b"x" * (CAP + 1)),
    ])  # fmt: skip
    items = {item.input: item for item in expand_inputs([str(tmp_path / "*.tar")], DatasetOptions(
        prompt_column="txt", max_image_bytes=CAP))}  # fmt: skip
    assert list(items) == [f"{shard}:a/000{i}" for i in range(1, 5)]
    first = items[f"{shard}:a/0001"]
    assert (first.data, first.metadata, first.prompt) == (IMAGES[0].read_bytes(), {"source": "cam1"}, "a hint")
    assert items[f"{shard}:a/0002"].data == IMAGES[1].read_bytes()
    assert items[f"{shard}:a/0003"].error == f"InputError: {shard}:a/0003: no image member (members: json)"
    assert items[f"{shard}:a/0004"].error == (
        f"ImageTooLarge: {shard}:a/0004: {CAP + 1} bytes is over the {CAP}-byte limit (max_image_bytes)"
    )


def test_a_cut_or_corrupt_tar_keeps_the_samples_before_and_gets_an_error_line(tmp_path):
    members = [(f"{i:04d}.png", path.read_bytes()) for i, path in enumerate(IMAGES[:3])]
    whole = write_shard(tmp_path / "whole.tar", members).read_bytes()
    second_header = 512 + -(-len(members[0][1]) // 512) * 512  # a header, then the data in 512-byte blocks
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: second_header + 512 + 100])  # inside the second member's data
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(whole[:second_header] + b"garbage!" * 64 + whole[second_header + 512 :])
    for shard in (cut, corrupt):
        items = expand_inputs([str(shard)])
        assert [item.input for item in items] == [f"{shard}:0000", f"{shard}:@error"]
        assert items[0].error is None and items[1].error.startswith(f"InputError: {shard}: unreadable tar after sample")


def test_a_truncated_parquet_gets_one_error_line(tmp_path):
    data = write_parquet(tmp_path / "d.parquet", [{"image": p.read_bytes()} for p in IMAGES])
    data.write_bytes(data.read_bytes()[:-100])
    [item] = expand_inputs([str(data)])
    assert item.input == str(data) and item.error.startswith(f"InputError: {data}: not a readable Parquet file")


def test_a_saved_datasets_folder_reads_without_the_datasets_package(tmp_path):
    folder = write_saved_dataset(tmp_path / "ds", [{"image": {"bytes": p.read_bytes(), "path": p.name}, "key": p.name}
                                                   for p in IMAGES])  # fmt: skip
    items = expand_inputs([str(folder)])
    assert [(item.input, item.data) for item in items] == [(p.name, p.read_bytes()) for p in IMAGES]


# -- S3 on loopback -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on a free loopback port, a bucket with the examples under images/ and a
    Parquet file of them; the environment a `wicore` process reaches it with."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1",
           "WICORE_S3_ENDPOINT_URL": f"http://{host}:{port}"}  # fmt: skip
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["WICORE_S3_ENDPOINT_URL"])
    client.create_bucket(Bucket=BUCKET)
    for path in IMAGES:
        client.put_object(Bucket=BUCKET, Key=f"images/{path.name}", Body=path.read_bytes())
    yield env
    for name, value in saved.items():
        os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    server.stop()


def test_an_s3_prefix_gives_its_images_and_a_missing_one_is_a_usage_error(s3_env):
    options = DatasetOptions(s3_endpoint_url=s3_env["WICORE_S3_ENDPOINT_URL"])
    items = expand_inputs([f"s3://{BUCKET}/images/"], options)
    assert [(item.input, item.data) for item in items] == [
        (f"s3://{BUCKET}/images/{p.name}", p.read_bytes()) for p in IMAGES
    ]
    with pytest.raises(ConfigError, match=rf"^no such file or folder: s3://{BUCKET}/nope/$"):
        expand_inputs([f"s3://{BUCKET}/nope/"], options)
    gone = wicore("enqueue", f"s3://{BUCKET}/nope/", env=s3_env, check=False)
    assert (gone.returncode, gone.stderr) == (2, f"error: no such file or folder: s3://{BUCKET}/nope/\n")


def test_parquet_and_tar_objects_under_an_s3_prefix_and_an_s3_glob(s3_env, tmp_path):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_env["WICORE_S3_ENDPOINT_URL"])
    parquet = write_parquet(tmp_path / "d.parquet", [{"key": stem(p), "image": p.read_bytes()} for p in IMAGES[:2]])
    shard = write_shard(tmp_path / "s.tar", [(f"{stem(p)}.png", p.read_bytes()) for p in IMAGES[2:4]])
    for path in (parquet, shard):
        client.put_object(Bucket=BUCKET, Key=f"mixed/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=BUCKET, Key="mixed/notes.txt", Body=b"not an image")
    options = DatasetOptions(s3_endpoint_url=s3_env["WICORE_S3_ENDPOINT_URL"])
    items = {item.input: item for item in expand_inputs([f"s3://{BUCKET}/mixed/"], options)}
    tar_url = f"s3://{BUCKET}/mixed/s.tar"
    assert list(items) == [stem(IMAGES[0]), stem(IMAGES[1]), f"s3://{BUCKET}/mixed/notes.txt",
                           f"{tar_url}:{stem(IMAGES[2])}", f"{tar_url}:{stem(IMAGES[3])}"]  # fmt: skip
    assert items[f"{tar_url}:{stem(IMAGES[3])}"].data == IMAGES[3].read_bytes()
    assert items[f"s3://{BUCKET}/mixed/notes.txt"].error.startswith("InputError: s3://wicore-data/mixed/notes.txt: not")
    globbed = expand_inputs([f"s3://{BUCKET}/mixed/*.tar"], options)
    assert [item.input for item in globbed] == [f"{tar_url}:{stem(IMAGES[2])}", f"{tar_url}:{stem(IMAGES[3])}"]


@pytest.mark.parametrize(
    "module, url", [("pyarrow", "d.parquet"), ("pyarrow", "out.parquet"), ("s3fs", f"s3://{BUCKET}/images/")]
)
def test_a_missing_datasets_extra_is_one_line_naming_it(module, url, tmp_path, redis_url):
    write_parquet(tmp_path / "d.parquet", [{"image": IMAGES[0].read_bytes()}])
    output = url == "out.parquet"
    args = (
        ["caption", str(EXAMPLES), "-o", str(tmp_path / url)] if output else ["enqueue", url, "--redis-url", redis_url]
    )
    run = without(module, *args, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, cwd=tmp_path)
    assert (run.returncode, run.stderr) == (2, f"error: {module} is not installed: pip install 'wicore[datasets]'\n")


# -- end to end ---------------------------------------------------------------------------------


def caption(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    return wicore("caption", *args, "--max-new-tokens", "6", "--batch-size", "4", env=env, check=check, timeout=600)


def image_of(input: str) -> str:
    """The example's stem in a key: a path, an s3:// URL, `shard.tar:stem`, `ds/stem` or a stem."""
    return input.rsplit("/", 1)[-1].rsplit(":", 1)[-1].split(".")[0]


@pytest.mark.slow
def test_caption_over_every_dataset_kind_matches_a_folder_and_resumes(tmp_path, s3_env):
    env = {**s3_env, "XDG_CACHE_HOME": str(tmp_path / "cache"), "WICORE_MAX_IMAGE_BYTES": str(CAP)}
    caption(str(EXAMPLES), "-o", str(tmp_path / "folder.jsonl"), env=env)
    lines = [json.loads(line) for line in (tmp_path / "folder.jsonl").read_text().splitlines()]
    folder = {image_of(line["input"]): line["text"] for line in lines}
    assert len(folder) == 6 and all(folder.values())

    parquet = write_parquet(tmp_path / "d.parquet", [{"key": stem(p), "image": p.read_bytes()} for p in IMAGES[:3]])
    (tmp_path / "shards").mkdir()
    for n, chunk in enumerate((IMAGES[3:5], IMAGES[5:])):
        write_shard(tmp_path / "shards" / f"s-{n}.tar", [(f"{stem(p)}.{p.suffix[1:]}", p.read_bytes()) for p in chunk])
    saved = write_saved_dataset(tmp_path / "ds", [{"image": {"bytes": p.read_bytes(), "path": None}, "key": f"ds/{stem(p)}"}
                                                  for p in IMAGES[:2]])  # fmt: skip
    bad = [
        write_parquet(tmp_path / "huge.parquet", [{"key": "huge", "image": os.urandom(CAP + 1)}]),
        write_shard(tmp_path / "broken.tar", [("junk.png", b"not a png at all")]),
    ]
    out = tmp_path / "out.parquet"
    inputs = [str(parquet), str(tmp_path / "shards" / "*.tar"), str(saved), f"s3://{BUCKET}/images/", *map(str, bad)]
    first = caption(*inputs, "-o", str(out), env=env, check=False)
    assert first.returncode == 1 and first.stderr.startswith("captioned 14 of 16 inputs (2 errors, 0 already done)")

    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 16 == len({r["input"] for r in rows})
    errors = {r["input"]: r["error"] for r in rows if r["error"]}
    assert errors["huge"].startswith(f"ImageTooLarge: image of {CAP + 1} bytes is over the {CAP}-byte limit")
    assert errors[f"{bad[1]}:junk"].startswith("ImageError") and len(errors) == 2
    for r in (r for r in rows if r["error"] is None):
        assert r["status"] == "finished" and folder[image_of(r["input"])] == r["text"], r
    assert sum(r["input"].startswith("s3://") for r in rows) == 6
    assert sum(r["input"].startswith("ds/") for r in rows) == 2

    again = caption(*inputs, "-o", str(out), env=env, check=False)
    assert again.returncode == 1 and again.stderr.startswith("captioned 0 of 2 inputs (2 errors, 14 already done)")
    assert pq.read_table(out).to_pylist() != [] and sorted(pq.read_table(out)["input"].to_pylist()) == sorted(
        r["input"] for r in rows
    ), "retried errors keep one row each"
    done = caption(*inputs, "-o", str(out), "--skip-errors", env=env)
    assert "nothing to do: all 16 inputs already have a line" in done.stderr


@pytest.mark.slow
def test_enqueue_reads_the_same_dataset_inputs(tmp_path, redis_url):
    parquet = write_parquet(tmp_path / "d.parquet", [{"key": stem(p), "image": p.read_bytes()} for p in IMAGES[:2]])
    shard = write_shard(tmp_path / "s.tar", [(f"{stem(p)}.png", p.read_bytes()) for p in IMAGES[2:3]])
    enqueued = wicore("enqueue", str(parquet), str(shard), "--redis-url", redis_url, "--model-id", "democap")
    inputs = [line.split("\t")[1] for line in enqueued.stdout.splitlines()]
    assert inputs == [stem(IMAGES[0]), stem(IMAGES[1]), f"{shard}:{stem(IMAGES[2])}"]


@pytest.mark.slow
def test_a_second_run_on_the_same_output_refuses_at_once(tmp_path):
    (tmp_path / "imgs").mkdir()
    for i in range(40):
        (tmp_path / "imgs" / f"{i:03d}-{IMAGES[i % 6].name}").write_bytes(IMAGES[i % 6].read_bytes())
    out, env = tmp_path / "out.jsonl", {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = [WICORE, "caption", str(tmp_path / "imgs"), "-o", str(out), "--max-new-tokens", "4"]
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = Path(f"{out}.lock")
        wait_until(lambda: lock.exists() and lock.read_text().startswith("pid"), 60, what="the first run's lock")
        second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and first.poll() is None
        [line] = second.stderr.splitlines()
        assert line.startswith(f"error: {out} is being written by another run (pid {first.pid} on ")
        assert line.endswith(f"lock {lock}): wait for it to end, or write to another -o file")
    finally:
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 40 == len({line["input"] for line in lines}) and not lock.exists()
