"""Images by URL through `wicore caption` (the installed command, the demo captioner, a worker
process): http:// and s3:// images caption as the same files on disk do, and each bad URL fails
its own line, with the URL and the reason, within the fetch timeout, while the rest finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import wicore
from tests.url_servers import BUCKET, EXAMPLES, S3_ENV, image_http_server, s3_server
from wicore.schemas import ResultLine

pytestmark = pytest.mark.slow

TIMEOUT_S = 3


def caption(manifest: Path, out: Path, env: dict) -> tuple[int, dict[str, ResultLine]]:
    run = wicore("caption", str(manifest), "-o", str(out), "--max-new-tokens", "16", env=env, check=False)
    lines = [ResultLine.model_validate_json(line) for line in out.read_text().splitlines()]
    return run.returncode, {line.input or "": line for line in lines}


def write_manifest(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_url_images_caption_as_files_do_and_bad_urls_fail_alone(tmp_path):
    names = sorted(path.name for path in EXAMPLES.iterdir())
    bad = {
        "404": "/missing",
        "never-answers": "/hang",
        "endless-redirect": "/loop",
        "2-GB-body": "/huge",
        "to-metadata": "/to-metadata",
    }
    with image_http_server() as base, s3_server() as endpoint:
        lines = [{"image": str(EXAMPLES / name), "input": f"disk/{name}"} for name in names]
        lines += [{"image": f"{base}/img/{name}", "input": f"http/{name}"} for name in names]
        lines += [{"image": f"s3://{BUCKET}/examples/{name}", "input": f"s3/{name}"} for name in names]
        lines += [{"image": f"{base}{route}?token=secret", "input": key} for key, route in bad.items()]
        lines += [{"image": "http://169.254.169.254/latest/meta-data/iam", "input": "metadata"}]
        lines += [{"image": f"s3://{BUCKET}/examples/nope.png", "input": "no-such-object"}]
        env = {
            **S3_ENV,
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "WICORE_URL_ALLOW_HOSTS": "127.0.0.1",
            "WICORE_S3_ENDPOINT_URL": endpoint,
            "WICORE_URL_TIMEOUT_S": str(TIMEOUT_S),
        }
        code, got = caption(write_manifest(tmp_path / "urls.jsonl", lines), tmp_path / "out.jsonl", env)

        assert code == 1, "some lines failed"
        for name in names:
            disk = got[f"disk/{name}"]
            assert disk.status == "finished" and disk.text
            assert (got[f"http/{name}"].status, got[f"http/{name}"].text) == ("finished", disk.text)
            assert (got[f"s3/{name}"].status, got[f"s3/{name}"].text) == ("finished", disk.text)
        reasons = {
            "404": "HTTP 404 Not Found",
            "never-answers": "the server did not answer within the timeout",
            "endless-redirect": "more than 3 redirects",
            "2-GB-body": "2,000,000,000 bytes is over the 33,554,432-byte limit",
            "to-metadata": "redirected to http://169.254.169.254/latest/meta-data/: refused: 169.254.169.254 is "
            "a link-local address",
        }
        for key, reason in reasons.items():
            line = got[key]
            assert line.status == "failed" and line.error is not None
            assert line.error.startswith("Image") and f"{base}{bad[key]}?token=***: {reason}" in line.error
            assert "secret" not in line.error
        assert "169.254.169.254 is a link-local address" in (got["metadata"].error or "")
        assert f"s3://{BUCKET}/examples/nope.png: no such object" in (got["no-such-object"].error or "")

        # By default loopback is refused.
        default_env = {key: value for key, value in env.items() if key != "WICORE_URL_ALLOW_HOSTS"}
        manifest = write_manifest(tmp_path / "loopback.jsonl", [{"image": f"{base}/img/{names[0]}"}])
        code, got = caption(manifest, tmp_path / "loopback-out.jsonl", default_env)
        [line] = got.values()
        assert code == 1 and line.status == "failed"
        assert "127.0.0.1 is not a public address; set allow_private_urls" in (line.error or "")
