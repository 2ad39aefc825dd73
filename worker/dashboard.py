"""`wicore dashboard`: rq-dashboard's pages in our own Flask app, with the guards rq-dashboard
leaves to its host.

- Jobs are read as JSON, never unpickled. rq-dashboard fetches jobs in some views with RQ's
  default (pickle) serializer; those views are replaced here by ones that use JSONSerializer,
  and every endpoint that is not on the reviewed list below answers 404, so a new rq-dashboard
  release cannot add a route nobody read.
- Write actions (delete, requeue, empty, compact) answer POST only, carrying the page's token:
  rq-dashboard's own script sends the `_csrf_token` cookie back as the `X-CSRFToken` header, and
  a page from another site can neither read that cookie nor set that header.
- Optional HTTP basic auth over every route; credentials are compared in constant time and
  never logged.
- rq-dashboard renders its Redis URL into every page (masking only a `user:password@`): it is
  handed the URL without its password, and the password on the side.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from redis import Redis
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job, requeue_job
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.serializers import JSONSerializer

from wicore.errors import ConfigError
from wicore.redaction import split_password

CSRF_COOKIE, CSRF_HEADER = "_csrf_token", "X-CSRFToken"  # the names rq-dashboard's script uses
PREFIX = "rq_dashboard."

# rq-dashboard 0.9 views read line by line: they list queue names and counts, or fetch jobs
# with the serializer we configure (`rq_dashboard.web.config.serializer`).
REVIEWED_READS = {"queues_overview", "workers_overview", "jobs_overview", "list_queues", "list_jobs", "job_info"}
# Views that fetch jobs with RQ's default serializer, replaced below by JSON-only versions.
REPLACED_READS = {"job_view", "list_workers"}
WRITES = {"delete_job_view", "requeue_job_view", "requeue_all", "empty_queue", "compact_queue"}
ALWAYS_OPEN = {"static", PREFIX + "static", PREFIX + "favicon"}

REGISTRIES = {
    "failed": FailedJobRegistry,
    "deferred": DeferredJobRegistry,
    "started": StartedJobRegistry,
    "finished": FinishedJobRegistry,
    "canceled": CanceledJobRegistry,
    "scheduled": ScheduledJobRegistry,
}


@dataclass(frozen=True)
class BasicAuth:
    user: str
    password: str

    @classmethod
    def parse(cls, text: str) -> BasicAuth:
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ConfigError("dashboard auth wants USER:PASSWORD (both non-empty)")
        return cls(user, password)

    def allows(self, user: str | None, password: str | None) -> bool:
        ok_user = hmac.compare_digest((user or "").encode(), self.user.encode())
        ok_password = hmac.compare_digest((password or "").encode(), self.password.encode())
        return ok_user and ok_password


def instances(redis_url: str) -> tuple[tuple[str, ...], str | None]:
    """The dashboard's Redis instances (one per shard of a comma-separated URL) without their
    password, which the page would show, and the password rq-dashboard gives all of them."""
    split = [split_password(url) for url in redis_url.split(",")]
    passwords = {password for _, password in split}
    if len(passwords) > 1:
        raise ConfigError("the dashboard gives every shard one password: give the shards the same password")
    return tuple(url for url, _ in split), passwords.pop()


def make_app(redis_url: str, auth: BasicAuth | None = None):
    try:
        from flask import Flask
        from rq_dashboard import default_settings
        from rq_dashboard.web import blueprint, setup_rq_connection
        from rq_dashboard.web import config as dashboard_config
    except ImportError as exc:
        raise ConfigError(f"rq-dashboard is not installed: pip install 'wicore[dashboard]' ({exc})") from exc

    app = Flask(__name__, static_folder=blueprint.static_folder)  # the pages' favicon.ico
    app.config.from_object(default_settings)
    app.config["RQ_DASHBOARD_REDIS_URL"], app.config["RQ_DASHBOARD_REDIS_PASSWORD"] = instances(redis_url)
    app.register_blueprint(blueprint, url_prefix="")
    dashboard_config.serializer = JSONSerializer
    setup_rq_connection(app)
    _install_views(app)
    _install_guards(app, auth, secrets.token_urlsafe(32))
    return app


# -- guards -------------------------------------------------------------------------------------


def _install_guards(app, auth: BasicAuth | None, token: str) -> None:
    from flask import Response, request

    reads = {PREFIX + name for name in REVIEWED_READS | REPLACED_READS} | ALWAYS_OPEN
    writes = {PREFIX + name for name in WRITES}

    @app.before_request
    def guard():
        if auth is not None and not _authorized(auth, request.authorization):
            return Response("login required\n", 401, {"WWW-Authenticate": 'Basic realm="wicore dashboard"'})
        if request.routing_exception is not None:  # Flask answers: 404, 405 or a redirect
            return None
        if request.endpoint in writes:
            return _refuse_write(request, token)
        if request.endpoint not in reads:
            return Response("not found\n", 404)
        return None

    @app.after_request
    def hand_out_token(response):
        if response.mimetype == "text/html":
            response.set_cookie(CSRF_COOKIE, token, samesite="Strict", path="/")
        return response


def _authorized(auth: BasicAuth, given) -> bool:
    return given is not None and auth.allows(given.username, given.password)


def _refuse_write(request, token: str):
    """None when a write may go ahead; else the refusal."""
    from flask import Response

    if request.method != "POST":
        return Response("write actions need POST\n", 405, {"Allow": "POST"})
    if not hmac.compare_digest(request.headers.get(CSRF_HEADER, "").encode(), token.encode()):
        return Response("write actions need the dashboard page's token\n", 403)
    origin = request.headers.get("Origin")
    if origin and urlsplit(origin).netloc != request.host:
        return Response("write actions must come from the dashboard's own pages\n", 403)
    return None


# -- views that read or change jobs, JSON only ----------------------------------------------------


def _install_views(app) -> None:
    views = {
        "job_view": _job_view,
        "list_workers": _list_workers,
        "delete_job_view": _delete_job,
        "requeue_job_view": _requeue_job,
        "requeue_all": _requeue_all,
        "empty_queue": _empty,
        "compact_queue": _compact,
    }
    for name, view in views.items():
        app.view_functions[PREFIX + name] = view


def _connection() -> Redis:
    from flask import current_app

    return current_app.redis_conn


def _fetch(job_id: str) -> Job:
    return Job.fetch(job_id, connection=_connection(), serializer=JSONSerializer)


def _job_view(instance_number: int, job_id: str):
    from flask import current_app, make_response, render_template, url_for
    from rq import VERSION as rq_version
    from rq_dashboard.version import VERSION as dashboard_version
    from rq_dashboard.web import escape_format_instance_list

    job = _fetch(job_id)
    page = render_template(
        "rq_dashboard/job.html",
        current_instance=instance_number,
        instance_list=escape_format_instance_list(current_app.config.get("RQ_DASHBOARD_REDIS_URL")),
        id=job.id,
        rq_url_prefix=url_for(".queues_overview"),
        rq_dashboard_version=dashboard_version,
        rq_version=rq_version,
        deprecation_options_usage=current_app.config.get("DEPRECATED_OPTIONS", False),
        enable_delete=not current_app.config.get("RQ_DASHBOARD_DISABLE_DELETE"),
    )
    response = make_response(page)
    response.headers.set("Cache-Control", "no-store")
    return response


def _list_workers(instance_number: int):
    from rq_dashboard.web import serialize_current_job

    rows = [
        {
            "name": worker.name,
            "pid": worker.pid,
            "queues": [q.name for q in worker.queues],
            "state": str(worker.get_state()),
            "current_job": serialize_current_job(_current_job(worker)),
            "last_heartbeat": worker.last_heartbeat,
            "birth_date": worker.birth_date,
            "successful_job_count": worker.successful_job_count,
            "failed_job_count": worker.failed_job_count,
            "total_working_time": worker.total_working_time,
            "version": getattr(worker, "version", ""),
            "python_version": getattr(worker, "python_version", ""),
        }
        for worker in Worker.all(connection=_connection(), serializer=JSONSerializer)
    ]
    return _json(workers=sorted(rows, key=lambda w: (w["state"], w["queues"], w["name"])))


def _current_job(worker: Worker) -> Job | None:
    try:
        return worker.get_current_job()
    except NoSuchJobError:
        return None


def _delete_job(job_id: str):
    try:
        _fetch(job_id).delete()
    except NoSuchJobError:
        return _json(status="ERROR")
    return _json(status="OK")


def _requeue_job(job_id: str):
    requeue_job(job_id, connection=_connection(), serializer=JSONSerializer)
    return _json(status="OK")


def _requeue_all(queue_name: str):
    ids = FailedJobRegistry(queue_name, connection=_connection(), serializer=JSONSerializer).get_job_ids(cleanup=False)
    for job_id in ids:
        requeue_job(job_id, connection=_connection(), serializer=JSONSerializer)
    return _json(status="OK", count=len(ids))


def _empty(queue_name: str, registry_name: str):
    if registry_name == "queued":
        Queue(queue_name, connection=_connection(), serializer=JSONSerializer).empty()
        return _json(status="OK")
    if registry_name not in REGISTRIES:
        return _json(status="ERROR")
    registry = REGISTRIES[registry_name](queue_name, connection=_connection(), serializer=JSONSerializer)
    for job_id in registry.get_job_ids(cleanup=False):
        try:
            _fetch(job_id).delete()
        except NoSuchJobError:
            registry.remove(job_id)
    return _json(status="OK")


def _compact(queue_name: str):
    queue = Queue(queue_name, connection=_connection(), serializer=JSONSerializer)
    if _connection().exists(queue.key):  # RQ's compact renames the list, which fails on an empty queue
        queue.compact()
    return _json(status="OK")


def _json(**fields):
    from flask import jsonify

    return jsonify(**fields), {"Cache-Control": "no-store"}


def serve(app, host: str, port: int) -> None:
    """Serve until interrupted, in this process; prints nothing itself."""
    from werkzeug.serving import make_server

    make_server(host, port, app, threaded=True).serve_forever()
