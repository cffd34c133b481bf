"""The only place errors become responses; the only broad catch in the gateway."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, InvalidRequest

log = logging.getLogger("gateway.errors")


def to_response(err: GatewayError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, media_type="application/json", headers=err.headers())


def reencode_error(exc: Exception, path: object) -> InvalidRequest:
    """A client body the upstream encoder refuses is the client's 400, not a 500. Parsing bounds JSON depth well
    below orjson's limit (`validation.MAX_JSON_DEPTH`) so this should not happen; if it does, it is logged."""
    log.warning("request body could not be re-encoded on %s: %s", path, exc)
    return InvalidRequest(f"The request body cannot be re-encoded for the upstream ({exc}); simplify its nesting.",
                          code="invalid_body")


def install(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return to_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's 422 {"detail": [...]} is not what OpenAI clients expect: 400 invalid_request_error.
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", [])[1:]) or None
        return to_response(InvalidRequest(f"Invalid request: {first.get('msg', 'validation failed')}", param=loc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith("/v1/") and exc.status_code in (404, 405):
            try:  # the key first: a probe without one learns nothing about which paths exist
                main = getattr(request.app.state, "main", request.app)
                main.state.gateway.policies.index.identify(request.headers.get("authorization"))
            except GatewayError as e:
                return to_response(e)
        err = GatewayError(str(exc.detail) if exc.status_code != 404 else f"Unknown path: {request.url.path}")
        err.status = exc.status_code
        err.type = "invalid_request_error"
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return to_response(err)

    @app.exception_handler(orjson.JSONEncodeError)
    async def reencode(request: Request, exc: orjson.JSONEncodeError) -> Response:
        return to_response(reencode_error(exc, request.url.path))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return to_response(GatewayError("The gateway hit an internal error."))
