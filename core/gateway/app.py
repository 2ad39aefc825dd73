"""The FastAPI app of `wicore serve`. It holds no model: requests are validated, enqueued through
the producer and answered from Redis, so any number of gateways can run beside the workers.

Its docs (`/docs`: Swagger UI, `/redoc`) load their scripts from the gateway itself (the
fastapi-offline package's copies, under /static-offline-docs), so they work without internet;
every route's example body runs as it is ("Try it out")."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from pydantic.json_schema import models_json_schema

from wicore.gateway import batches, files, jobs, openai_routes, service
from wicore.gateway.errors import ErrorBody, install_error_handlers
from wicore.gateway.examples import with_model
from wicore.gateway.limits import BodyLimit, BodyTooLarge, too_large
from wicore.gateway.metrics import HttpMetrics
from wicore.gateway.schemas import JobRequest, OpenAIBatchLine
from wicore.gateway.service_batches import BatchService
from wicore.gateway.state import Gateway, GatewayConfig

DOCUMENTED = (JobRequest, OpenAIBatchLine, ErrorBody)  # bodies read by Content-Type, and the error shape
ERRORS = {
    "description": "Bad request, key or route: the message says what to fix",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
}


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)
    batch_service = BatchService(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        with batch_service.running():
            yield
        await gateway.close()

    app = FastAPIOffline(
        title="wicore gateway",
        version="1",
        lifespan=lifespan,
        description=__doc__,
        swagger_ui_parameters={"validatorUrl": None},  # Swagger UI would send the schema to a public validator
    )
    app.state.gateway = gateway
    app.state.batches = batch_service
    install_error_handlers(app)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, exc: BodyTooLarge):
        return too_large(config.max_request_bytes)

    for router in (jobs.router, openai_routes.router, service.router, files.router, batches.router):
        app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(HttpMetrics, metrics=gateway.metrics)
    app.openapi = lambda: openapi(app, config.model)
    return app


def openapi(app: FastAPI, model: str) -> dict:
    """FastAPI's schema, plus the bodies the routes read by Content-Type, with every error in
    the shape the gateway answers (FastAPI's own 422 shape is never sent); the examples name
    the gateway's `model`."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, defs = models_json_schema(
            [(m, "validation") for m in DOCUMENTED], ref_template="#/components/schemas/{model}"
        )
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
            operation["responses"]["4XX"] = ERRORS
        app.openapi_schema = with_model(schema, model)
    return app.openapi_schema
