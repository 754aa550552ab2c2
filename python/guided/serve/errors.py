"""Every error the server sends, in OpenAI's one shape:
``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("guided.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """A request the server refuses; raised anywhere below a handler."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                              param=where)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")
