"""The README and the docs site as a new user reads them: every shell and Python block runs, as
written, against one real redis-server, one worker on the bundled model and one gateway (shared by
all blocks), or is marked GPU-only and runs in the GPU tests; the reference pages match the code;
the README's relative links lead to files.

A block is marked by the comment line right above it:
    <!-- run -->            run it (bash or python) in a folder holding `examples/`, with
                            WICORE_REDIS_URL, GATEWAY and OPENAI_API_KEY set; it must exit 0
    <!-- run: install -->   install lines: each `pip install` resolves (pip's --dry-run) against
                            this clone, then the rest of the line runs
    <!-- gpu -->            GPU-only: runs under `pytest -m gpu`, a tiny Gemma-3 folder standing in
                            for /models/gemma-3-4b-it
Text, JSON, TOML and YAML blocks are shown, not run."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.helpers import start_gateway, start_worker, stop, wait_http
from wicore.docs_gen import stale_pages
from wicore.embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}
MARKERS = {"<!-- run -->": "run", "<!-- run: install -->": "install", "<!-- gpu -->": "gpu"}
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
CAPTION = "a red star on a purple background"  # the demo captioner on examples/images/red-star-on-purple.png
PLAIN_PYPI_CPU_TORCH = "--index-url https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def python(self) -> bool:
        return self.language in {"python", "py"}


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start(2) if match[1] is None else match.start()) + 1
        marker = MARKERS.get(match[1] or "")
        found.append(Block(page, line, match[2], marker, match[3]))
    return [block for block in found if block.language in RUNNABLE]


ALL = [block for page in PAGES for block in blocks(page)]


def of_kind(kind: str) -> list:
    return [pytest.param(block, id=block.name) for block in ALL if block.marker == kind]


def test_every_shell_and_python_block_is_run_or_marked_gpu_only():
    unmarked = [block.name for block in ALL if block.marker is None]
    assert not unmarked, f"blocks without <!-- run -->, <!-- run: install --> or <!-- gpu --> above them: {unmarked}"
    assert len(of_kind("run")) >= 15 and of_kind("gpu") and of_kind("install")


def test_the_reference_pages_are_what_the_code_writes():
    assert stale_pages(ROOT / "docs" / "reference") == [], "run: python -m wicore.docs_gen docs/reference"


def test_the_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert targets and not missing, missing


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


# --- running the blocks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One redis-server, one CPU worker on the bundled model, one gateway without keys; a work folder
    holding `examples/` (the blocks' relative paths)."""
    work = tmp_path_factory.mktemp("reader")
    (work / "examples").symlink_to(ROOT / "examples")
    images = str(ROOT / "examples" / "images")
    with EmbeddedRedis() as redis_server:
        metrics, port = free_port(), free_port()
        worker = start_worker("--redis-url", redis_server.url, "--engine", "fast", "--engine-option", "torch_threads=1",
                              "--metrics-port", str(metrics), "--allow-root", images, log=work / "worker.log",
                              env={"WICORE_URL_ALLOW_HOSTS": "127.0.0.1"})  # the pages' image servers  # fmt: skip
        gateway = start_gateway("--redis-url", redis_server.url, "--port", str(port), "--allow-root", images,
                                log=work / "gateway.log")  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{metrics}/metrics", 120, worker)
            wait_http(f"http://127.0.0.1:{port}/health/ready", 60, gateway)
            env = {
                **os.environ,
                "WICORE_REDIS_URL": redis_server.url,
                "GATEWAY": f"http://127.0.0.1:{port}",
                "OPENAI_API_KEY": "anything",  # the client wants one; this gateway takes none
                "REPO_URL": f"file://{ROOT}",
                "XDG_CACHE_HOME": str(work / "cache"),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            }
            yield work, env
        finally:
            stop(gateway)
            stop(worker, signal.SIGKILL)


def run(block: Block, code: str, work: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the block in a process group of its own; whatever it leaves running is killed after it,
    and a Redis it started on `own_ports`' port is shut down."""
    command = [sys.executable, "-c", code] if block.python else ["bash", "-e", "-o", "pipefail", "-c", code]
    process = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        reap(process, code)
    assert process.returncode == 0, f"{block.name} exited {process.returncode}:\n{code}\n{stdout}\n{stderr}"
    if "red-star-on-purple" in code:
        assert CAPTION in stdout, f"{block.name}: no caption in its output:\n{stdout}"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def reap(process: subprocess.Popen, code: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    started = re.search(r"redis-server --bind 127.0.0.1 --port (\d+)", code)
    if started:  # daemonized: out of the group
        with contextlib.suppress(redis.RedisError):
            redis.Redis(port=int(started[1])).shutdown(nosave=True)


def own_ports(code: str) -> str:
    """A block that starts its own Redis and worker gets free ports for them."""
    return code.replace("6379", str(free_port())).replace("9100", str(free_port()))


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("run"))
def test_run_block(block, service):
    work, env = service
    run(block, own_ports(block.code), work, env)


def resolved_only(code: str) -> str:
    """Install lines, run here: pip resolves without installing (this clone stands for '.'), the
    suite's command collects instead of running; this machine's index serves torch's CPU wheel, so
    the plain-PyPI index flag goes."""
    code = code.replace(PLAIN_PYPI_CPU_TORCH, "").replace("python3 -m venv .venv && . .venv/bin/activate && ", "")
    code = code.replace("pip install", f"{sys.executable} -m pip install --dry-run").replace("'.[", f"'{ROOT}[")
    return code.replace(
        "python -m pytest -q", f"{sys.executable} -m pytest -q --collect-only {ROOT}/tests/test_schemas.py"
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("install"))
def test_install_block(block, service):
    work, env = service
    run(block, resolved_only(block.code), work, env, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("block", of_kind("gpu"))
def test_gpu_block(block, service, tiny_model_dir, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    work, env = service
    folder = tmp_path / "gemma-3-4b-it"
    folder.symlink_to(tiny_model_dir)
    run(block, own_ports(block.code.replace("/models/gemma-3-4b-it", str(folder))), work, env, timeout=900)
