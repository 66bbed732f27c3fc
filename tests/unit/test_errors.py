"""How the core's reasons for ending a request reach a caller: typed errors, and HTTP statuses."""

from __future__ import annotations

import pytest

from unison.errors import EngineOverloadedError, FrontendStalledError, UnknownAdapterError
from unison.frontend.request import PromptRequest, ReqState
from unison.frontend.sampling_params import SamplingParams
from unison.server.streaming import stream_error
from unison.wire.messages import ReqOutput


def _state() -> ReqState:
    return ReqState("r", PromptRequest([1, 2, 3], SamplingParams(), 8), tokenizer=None)


@pytest.mark.parametrize("output, error", [
    (ReqOutput("r", finish="abort", error="queue full", overloaded=True), EngineOverloadedError),
    (ReqOutput("r", finish="abort", error="silent", refused=False, stalled=True), FrontendStalledError),
    (ReqOutput("r", finish="abort", error="no such adapter", unknown_adapter=True), UnknownAdapterError),
    (ReqOutput("r", finish="abort", error="bad request"), ValueError),
    (ReqOutput("r", finish="abort", error="a bug", refused=False), RuntimeError),
])
def test_each_reason_is_its_own_error(output, error):
    state = _state()
    state.update(output)
    assert state.finished and type(state.error) is error


@pytest.mark.parametrize("error, status", [
    (FrontendStalledError("frontend 1 processed none of the engine's outputs for 30 s"), 503),
    (EngineOverloadedError("the queue is full"), 503),
    (ValueError("bad"), 400),
    (RuntimeError("a bug"), 500),
])
def test_a_stream_reports_each_error_with_its_status(error, status):
    """A stalled frontend's request is a 503 naming the cause in every API's shape, never a 500."""
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        body = stream_error(error, path)
        text = str(body)
        assert str(error) in text
        if path.startswith("/v1/chat"):
            assert body["error"]["code"] == status
