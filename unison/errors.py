"""Errors a Unison user may catch."""


class EngineDeadError(RuntimeError):
    """The engine core is gone (it crashed, was killed, or was shut down): no request can finish."""


class InvalidParam(ValueError):
    """A request's field is invalid; nothing was queued. `field` is its name as the engine's API
    spells it (an HTTP layer maps it to its own, e.g. max_new_tokens -> max_tokens), and the
    message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
