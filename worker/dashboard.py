"""rq-dashboard as a Flask app on wicore's Redis, told that jobs are JSON (never pickle)."""

from __future__ import annotations


def make_app(redis_url: str):
    try:
        from rq.serializers import JSONSerializer
        from rq_dashboard.cli import make_flask_app
        from rq_dashboard.web import config as dashboard_config
        from rq_dashboard.web import setup_rq_connection
    except ImportError as exc:
        from wicore.errors import ConfigError

        raise ConfigError(f"rq-dashboard is not installed: pip install 'wicore[dashboard]' ({exc})") from exc

    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = redis_url
    dashboard_config.serializer = JSONSerializer
    setup_rq_connection(app)
    return app
