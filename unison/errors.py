"""Errors a Unison user may catch."""


class EngineDeadError(RuntimeError):
    """The engine core is gone (it crashed, was killed, or was shut down): no request can finish."""


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full (max_queued_requests): the request was refused, nothing queued."""


class FrontendStalledError(EngineOverloadedError):
    """This frontend processed none of the engine's outputs for frontend_max_silence_s (its
    process was stopped, or wedged): the engine ended its requests. An HTTP client gets a 503."""


class InvalidParam(ValueError):
    """A request's field is invalid; nothing was queued. `field` is its name as the engine's API
    spells it (an HTTP layer maps it to its own, e.g. max_new_tokens -> max_tokens), and the
    message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownAdapterError(InvalidParam):
    """The request names a LoRA adapter the engine has not loaded (or has unloaded); nothing ran.
    The OpenAI routes answer it as a 404 for `model`, the native ones as a 400 for `lora_path`."""

    def __init__(self, message: str) -> None:
        super().__init__("lora_path", message)


def check_encodable(value: object, path: str) -> None:
    """Raise InvalidParam naming the first string under `value` that is not valid Unicode text
    (a lone surrogate such as "\\ud800", which JSON escapes allow and no tokenizer takes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidParam(path, f"{path} is not valid text: {e.reason} at position {e.start}") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_encodable(k, path)
            check_encodable(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_encodable(v, f"{path}[{i}]")
