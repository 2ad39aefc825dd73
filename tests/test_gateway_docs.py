"""The gateway's docs work offline and their examples run: a real `wicore serve` with a CPU
worker on the demo captioner; every example body the schema documents is sent as it is and
answers 2xx; /docs loads in headless Chromium with every request off the loopback interface
blocked, its scripts served by the gateway, and shows the routes."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from tests.test_gateway_stream import served  # noqa: F401  (the module's gateway and worker)

pytestmark = pytest.mark.slow

# POST routes whose body cannot be a fixed example: an upload (a file part), and a batch (it names
# an uploaded file's id).
NO_EXAMPLE = {"/v1/files", "/v1/batches"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


def documented_examples(schema: dict) -> list[tuple[str, str, str, object]]:
    """(path, content type, example name, value) of every request-body example."""
    found = []
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            for kind, content in (operation.get("requestBody") or {}).get("content", {}).items():
                found += [(path, kind, name, ex["value"]) for name, ex in content.get("examples", {}).items()]
    return found


def test_every_documented_example_body_answers_2xx(served):  # noqa: F811
    url = served[0]
    schema = httpx.get(url + "/openapi.json").json()
    examples = documented_examples(schema)
    posts = {path for path, ops in schema["paths"].items() if "requestBody" in ops.get("post", {})}
    assert posts - NO_EXAMPLE == {path for path, *_ in examples}, "a POST route without an example body"
    for path, kind, name, value in examples:
        body = {"content": value} if isinstance(value, str) else {"json": value}
        with httpx.stream("POST", url + path, headers={"content-type": kind}, timeout=120, **body) as reply:
            text = reply.read().decode()
        assert 200 <= reply.status_code < 300, (path, name, text)
        assert '"error":{' not in text.replace(" ", "") and '"rejected":0' in text or "batch" not in path, text
        assert "event: error" not in text and 'data: {"error"' not in text, (path, name, text)


def test_the_docs_pages_load_their_scripts_from_the_gateway(served):  # noqa: F811
    url = served[0]
    for page in ("/docs", "/redoc"):
        html = httpx.get(url + page).text
        assert "cdn" not in html and "https://" not in html, html
    assert httpx.get(url + "/static-offline-docs/swagger-ui-bundle.js").status_code == 200


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install -y chromium)")
def test_docs_render_in_chromium_with_the_network_blocked(served, tmp_path):  # noqa: F811
    url = served[0] + "/docs"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", OFFLINE,
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000"]  # fmt: skip
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/jobs/{job_id}/stream", "/v1/models/{model_id}"):
        assert route in dom, f"{route} not rendered"
    assert "swagger-ui" in dom and "Failed to load API definition" not in dom
    shot = tmp_path / "docs.png"
    subprocess.run([*flags, "--window-size=1280,1600", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
