"""HTTP errors, in the shape of the API a route belongs to: OpenAI's (which vLLM, SGLang and
llama-server also use) {"error": {"message", "type", "param", "code"}} everywhere but Anthropic's
/v1/messages ({"type": "error", "error": {"type", "message"}}) and Ollama's /api/ ({"error": msg})."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from unison.json_types import JSONObject

ANTHROPIC_PREFIX, OLLAMA_PREFIX = "/v1/messages", "/api/"
# Anthropic's error types by status (its docs' table); 503 is its "overloaded_error" (529).
ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}


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

    def renamed(self, rules: list[tuple[str, str]]) -> HTTPError:
        """The same error with its field in another API's names: each rule (a regex anchored at the
        field's start, its replacement) applies once, in order. The message says the new name."""
        if not self.param:
            return self
        param = self.param
        for pattern, new in rules:
            param = re.sub(f"^{pattern}(?=$|[.\\[])", new, param, count=1)
        return HTTPError(self.status, self.message.replace(self.param, param), param=param, kind=self.kind)


def error_body(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None, path: str = "") -> JSONObject:
    """The error body for a route at `path` (see the module's docstring)."""
    if path.startswith(ANTHROPIC_PREFIX):
        fallback = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": ANTHROPIC_KINDS.get(status, fallback), "message": message}}
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param, path), status_code=status)


_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])$")  # in pydantic's error locations


def field_path(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's error location as a field path, `messages[0].role`, without its union-member tags."""
    path = ""
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x != "body" and not _UNION_TAG.match(x):
            path += f".{x}" if path else x
    return path or None
