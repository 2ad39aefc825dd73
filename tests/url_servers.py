"""Servers on loopback that image URLs point at: an HTTP server (http.server in a thread) with
good images and every bad answer a fetch must survive, and an S3-compatible server (moto's server
mode, as s3fs's own tests use) holding the example images."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "images"
BUCKET = "wicore-images"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
HUGE_BYTES = 2_000_000_000  # declared, and streamed lazily: never held in memory
CHUNK = b"\0" * 65_536


class ImageHandler(BaseHTTPRequestHandler):
    """/img/NAME: an example image; /missing: 404; /hang: never answers; /loop: redirects to
    itself; /huge: a 2 GB body; /endless: a chunked body that never ends; /to-metadata: a
    redirect to the cloud metadata address; /to-img/NAME: a redirect to /img/NAME."""

    stop = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        route, _, rest = self.path.partition("?")[0].lstrip("/").partition("/")
        handler = getattr(self, "_" + route.replace("-", "_"), self._missing)
        handler(rest)

    def _img(self, name: str) -> None:
        path = EXAMPLES / name
        if not path.is_file():
            self._missing(name)
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, _: str) -> None:
        self.send_error(404)

    def _hang(self, _: str) -> None:
        self.stop.wait(120)

    def _loop(self, _: str) -> None:
        self._redirect("/loop")

    def _to_img(self, name: str) -> None:
        self._redirect(f"/img/{name}")

    def _to_metadata(self, _: str) -> None:
        self._redirect("http://169.254.169.254/latest/meta-data/")

    def _huge(self, _: str) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(HUGE_BYTES))
        self.end_headers()
        self._stream(HUGE_BYTES // len(CHUNK))

    def _endless(self, _: str) -> None:
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with contextlib.suppress(OSError):
            while not self.stop.is_set():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _stream(self, chunks: int) -> None:
        with contextlib.suppress(OSError):  # the client hangs up at its cap
            for _ in range(chunks):
                if self.stop.is_set():
                    return
                self.wfile.write(CHUNK)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def image_http_server() -> Iterator[str]:
    """The server's base URL, http://127.0.0.1:PORT."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    server.daemon_threads = True
    ImageHandler.stop.clear()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        ImageHandler.stop.set()
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """An S3-compatible endpoint on loopback (moto), with the example images in BUCKET and this
    process's AWS variables set to its test credentials."""
    from moto.server import ThreadedMotoServer

    saved = {key: os.environ.get(key) for key in S3_ENV}
    os.environ.update(S3_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        upload_examples(endpoint)
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def upload_examples(endpoint: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.makedirs(BUCKET, exist_ok=True)  # moto keeps its buckets for the life of the process
    for path in sorted(EXAMPLES.iterdir()):
        fs.pipe(f"{BUCKET}/examples/{path.name}", path.read_bytes())


def moto_process(port: int, log: Path):
    """moto's S3 server (`moto_server`) in a process of its own, with BUCKET made: a fault
    test can stop it (SIGSTOP) and let it go on (SIGCONT) with its objects kept."""
    import s3fs

    from tests.helpers import wait_until

    sink = open(log, "wb")  # noqa: SIM115 (closed with the process)
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **S3_ENV}, stdout=sink, stderr=subprocess.STDOUT,
    )  # fmt: skip
    key, secret = S3_ENV["AWS_ACCESS_KEY_ID"], S3_ENV["AWS_SECRET_ACCESS_KEY"]
    fs = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", key=key, secret=secret, skip_instance_cache=True)
    wait_until(lambda: made(fs, BUCKET), 30, 0.2, "moto_server")
    return server


def made(fs, bucket: str) -> bool:
    from botocore.exceptions import BotoCoreError

    try:
        fs.makedirs(bucket, exist_ok=True)
    except (OSError, BotoCoreError):  # not listening yet
        return False
    return True
