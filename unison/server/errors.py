"""HTTP errors, in the one JSON shape every route answers with (OpenAI's, which vLLM and SGLang
also use): {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from unison.json_types import JSONObject


def error_kind(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error",
            503: "service_unavailable"}.get(status, "invalid_request_error")


class HTTPError(Exception):
    """A request that is answered with `status` and an error body; `param` names the field that
    was wrong, when one was."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or error_kind(status)


def error_body(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> JSONObject:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)
