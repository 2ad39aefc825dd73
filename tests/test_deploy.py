"""deploy/: the compose file names only commands, flags and settings the CLI has, and the Grafana
board reads only metrics the workers and the gateway export. No container is built here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer
import yaml

from wicore.cli.main import app
from wicore.config import CONFIG_ENV, Settings
from wicore.gateway.metrics import GatewayMetrics
from wicore.worker.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
METRIC = re.compile(r"\bwicore:[a-z0-9_:]+")


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def cli_command(words: list[str]):
    """The click command `wicore <words...>` names (a verb, or a group and its verb)."""
    command = typer.main.get_command(app)
    for word in words:
        assert word in getattr(command, "commands", {}), f"no command wicore ... {word}"
        command = command.commands[word]
    return command


def test_compose_is_redis_one_gateway_one_worker_and_prometheus():
    services = compose()["services"]
    assert set(services) == {"redis", "gateway", "worker", "prometheus"}
    assert services["gateway"]["command"][:2] == ["wicore", "serve"]
    assert services["worker"]["command"][:2] == ["wicore", "worker"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def test_prometheus_scrapes_the_gateway_and_each_worker_metrics_port():
    """deploy/prometheus.yml's targets are the compose services' ports that serve /metrics."""
    jobs = {job["job_name"]: job for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    services = compose()["services"]
    gateway = services["gateway"]["command"]
    assert jobs["wicore-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway[gateway.index('--port') + 1]}"]
    worker = services["worker"]["command"]
    [dns] = jobs["wicore-worker"]["dns_sd_configs"]
    assert dns["names"] == ["worker"] and str(dns["port"]) == worker[worker.index("--metrics-port") + 1]


def test_every_command_flag_and_setting_in_compose_exists():
    settings = {"WICORE_" + name.upper() for name in Settings.model_fields} | {CONFIG_ENV}
    checked = 0
    for name, service in compose()["services"].items():
        env = service.get("environment", {})
        unknown = sorted(k for k in env if k.startswith("WICORE_") and k not in settings)
        assert not unknown, f"service {name}: unknown settings {unknown}"
        command = service.get("command") or []
        if not command or command[0] != "wicore":
            continue
        verb = cli_command([command[1]])
        options = {opt for param in verb.params for opt in param.opts}
        flags = [word for word in command[2:] if word.startswith("--")]
        assert set(flags) <= options, f"service {name}: wicore {command[1]} has no {sorted(set(flags) - options)}"
        checked += 1
    assert checked == 2


def exported_names(redis_conn) -> set[str]:
    """Every sample name the worker and the gateway can export."""
    worker = WorkerMetrics("m")
    tier = {"hits": 1, "misses": 1}
    worker.engine_snapshot(
        {
            "kv_pages": 8,
            "kv_pages_used": 2,
            "peak_gpu_bytes": 1,
            "vision_cache": tier,
            "vision_cache_shared": tier,
            "cache": {"gpu": tier, "host": tier, "disk": tier},
        }
    )
    families = [*worker.registry.collect(), *GatewayMetrics([redis_conn]).registry.collect()]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def test_the_grafana_board_reads_only_exported_metrics(redis_conn):
    board = json.loads((DEPLOY / "grafana" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"]]
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    missing = used - exported_names(redis_conn)
    assert not missing, f"the board reads metrics nothing exports: {sorted(missing)}"
    assert len(used) >= 15
    for panel in board["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
