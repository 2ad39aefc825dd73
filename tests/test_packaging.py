"""The package layout (one import package `wicore` over the top-level folders) and the one-way
dependencies between its parts: which third-party packages each part may load (imported for
real), and wicore's own layers and the absence of import circles (read from the source,
tests/import_graph.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from tests.import_graph import circles, import_graph, layer_of, upward_imports

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {
    "wicore.ops.attention.paged_triton",
    "wicore.ops.fp8_triton",
    "wicore.ops.fp8_attention_cuda",
}  # import triton (or cudnn, the fp8 extra's) at the top: skipped where it is missing


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_in_pyproject():
    config = setuptools_config()
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]) if relative.parts else name)
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"


def modules_under(folder: str) -> list[str]:
    """Every module of a top-level folder, by import name (pyproject's `package-dir`)."""
    package = {path: name for name, path in setuptools_config()["package-dir"].items()}[folder]
    names = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        names.append(".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return names


# argv: JSON lists of modules to import in turn, forbidden packages, optional dependencies.
# Prints {"pulled": {module: forbidden packages it was the first to load}, "skipped": [modules
# whose optional dependency is not installed]}.
_IMPORT_EACH = """
import importlib, json, sys
modules, forbidden, optional = (json.loads(arg) for arg in sys.argv[1:])
pulled, skipped = {}, []
for name in modules:
    before = {m for m in forbidden if m in sys.modules}
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in optional:
            raise
        skipped.append(name)
        continue
    loaded = sorted(m for m in forbidden if m in sys.modules and m not in before)
    if loaded:
        pulled[name] = loaded
print(json.dumps({"pulled": pulled, "skipped": skipped}))
"""


def first_importers(modules: list[str], forbidden: set[str], optional: Iterable[str] = ()) -> tuple[dict, list]:
    """Imports `modules` one by one in a fresh interpreter: (which module first loaded which
    `forbidden` package, the modules skipped because an `optional` dependency is missing)."""
    args = [json.dumps(value) for value in (modules, sorted(forbidden), sorted(optional))]
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    return report["pulled"], report["skipped"]


def test_producer_and_scheduler_import_neither_torch_nor_transformers():
    modules = ["wicore.config", *modules_under("producer"), *modules_under("scheduler")]
    assert {"wicore.producer.client", "wicore.scheduler.queues"} <= set(modules)
    pulled, skipped = first_importers(modules, {"torch", "transformers", "PIL"})
    assert pulled == {}, f"a service that only enqueues would need these: {pulled}"
    assert skipped == []


def test_the_gateway_imports_neither_torch_nor_transformers():
    """`wicore serve` holds no model: a gateway host needs no torch."""
    modules = [name for name in modules_under("core") if name.startswith("wicore.gateway")] + ["wicore.cli.gateway"]
    assert {"wicore.gateway.app", "wicore.gateway.submissions"} <= set(modules)
    pulled, skipped = first_importers(modules, {"torch", "transformers", "PIL"})
    assert pulled == {}, f"a gateway host would need these: {pulled}"
    assert skipped == []


def test_engines_and_ops_import_neither_redis_nor_rq():
    modules = modules_under("engines") + modules_under("ops")
    assert {
        "wicore.engines.fast.engine",
        "wicore.engines.fast.model.weights",
        "wicore.engines.kvcache.tiers",
        "wicore.ops.attention.paged",
        "wicore.ops.image_decode",
    } <= set(modules)
    pulled, skipped = first_importers(modules, {"redis", "rq"}, optional={"triton", "cudnn"})
    assert pulled == {}, (
        f"engines/ and ops/ must not import Redis or RQ (module: what it loaded first, maybe through another): {pulled}"
    )
    assert set(skipped) <= GPU_ONLY


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


def test_imports_never_run_back_up_a_layer():
    """wicore's internal layers (tests/import_graph.py LAYERS, lowest first): base modules <- ops <-
    the engines' foundations (interface, options, checkpoints) <- the KV cache's storage <- the
    engines <- models, settings, scheduler, producer <- worker <- gateway <- bench <- cli."""
    graph = import_graph()
    assert {"wicore.engines.kvcache.tiers", "wicore.worker.loop", "wicore.cli.main"} <= set(graph)
    assert all(layer_of(module) >= 0 for module in graph)  # every module is placed in a layer
    assert upward_imports(graph) == [], "a lower layer imports a higher one (importer, imported)"


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == [], "modules that import each other in a circle"


def test_the_layering_check_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative one are arrows too."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "wicore" = "core" }\n')
    package = tmp_path / "core"
    (package / "cli").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("def f():\n    from wicore.cli import main\n")
    (package / "cli" / "__init__.py").write_text("")
    (package / "cli" / "main.py").write_text("from .. import errors\n")
    graph = import_graph(tmp_path)
    assert graph["wicore.errors"] == {"wicore.cli.main"} and graph["wicore.cli.main"] == {"wicore.errors"}
    assert upward_imports(graph) == [("wicore.errors", "wicore.cli.main")]
    assert circles(graph) == [["wicore.cli.main", "wicore.errors"]]
