"""Errors a Unison user may catch."""


class EngineDeadError(RuntimeError):
    """The engine core is gone (it crashed, was killed, or was shut down): no request can finish."""
