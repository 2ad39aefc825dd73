"""The package layout the design card asks for, and the one-way dependencies between parts."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]) if relative.parts else name)
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"


def imported_modules(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_producer_and_scheduler_import_neither_torch_nor_transformers():
    modules = imported_modules("import wicore.producer, wicore.scheduler.policy, wicore.scheduler.queues")
    assert not {"torch", "transformers", "PIL"} & modules


def test_the_gateway_imports_neither_torch_nor_transformers():
    """`wicore serve` holds no model: a gateway host needs no torch."""
    modules = imported_modules("import wicore.gateway.app, wicore.cli.gateway")
    assert {"fastapi", "prometheus_client"} <= modules
    assert not {"torch", "transformers", "PIL"} & modules


def test_engines_and_ops_import_neither_redis_nor_rq():
    modules = imported_modules("import wicore.engines.reference, wicore.engines.null, wicore.ops.image_preprocess")
    assert not {"redis", "rq"} & modules


def test_the_wheel_ships_the_default_model(tmp_path):
    """`pip install wicore` (not only an editable checkout) must carry the bundled demo captioner."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True)  # fmt: skip
    [wheel] = tmp_path.glob("wicore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        f"wicore/models/democap/checkpoint/{p.name}" for p in (ROOT / "core/models/democap/checkpoint").iterdir()
    }
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {n.rsplit("/", 1)[1] for n in shipped}
    assert shipped <= names
