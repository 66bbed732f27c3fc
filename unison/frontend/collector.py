"""Collector: turns request deltas into sglang.Engine-shaped output dicts, on the caller's side."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from unison.frontend.worker import Delta, ReqState


class _Output:
    def __init__(self, state: ReqState) -> None:
        self.state = state
        self.text = ""
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.cached_tokens = 0
        self.logprobs: list = []
        self.top_logprobs: list = []
        self.prompt_logprobs: list = []
        self.prompt_top_logprobs: list = []

    def apply(self, d: Delta) -> None:
        if d.error is not None:
            raise d.error
        self.text += d.text
        self.output_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.top_logprobs.extend(d.top_logprobs)
        self.prompt_logprobs.extend(d.prompt_logprobs)
        self.prompt_top_logprobs.extend(d.prompt_top_logprobs)
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            # A stop string may end the request on a token whose logprob came with it.
            del self.logprobs[len(self.output_ids):], self.top_logprobs[len(self.output_ids):]

    def to_dict(self) -> dict[str, Any]:
        meta = {
            "id": self.state.rid,
            "prompt_tokens": len(self.state.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": time.monotonic() - self.state.created,
        }
        if self.state.return_logprob:
            meta["output_token_logprobs"] = list(self.logprobs)
            meta["output_top_logprobs"] = list(self.top_logprobs)
            meta["input_token_logprobs"] = list(self.prompt_logprobs)
            meta["input_top_logprobs"] = list(self.prompt_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class Collector:
    """Drains the deltas of one call's requests; yields a cumulative dict per changed request."""

    def __init__(self, states: list[ReqState], batch: bool) -> None:
        self.outputs = [_Output(s) for s in states]
        self.batch = batch or len(states) > 1

    def set_waker(self, waker: Callable[[], None]) -> None:
        for out in self.outputs:
            out.state.waker = waker
        waker()  # deltas may have arrived before the waker was set

    def drain(self) -> list[dict[str, Any]]:
        chunks = []
        for i, out in enumerate(self.outputs):
            if not out.state.deltas:
                continue
            while out.state.deltas:
                out.apply(out.state.deltas.popleft())
            chunk = out.to_dict()
            if self.batch:
                chunk["index"] = i
            chunks.append(chunk)
        return chunks

    @property
    def done(self) -> bool:
        return all(out.finish_reason is not None for out in self.outputs)

    def unfinished_rids(self) -> list[str]:
        return [out.state.rid for out in self.outputs if out.finish_reason is None]

    def results(self) -> dict[str, Any] | list[dict[str, Any]]:
        dicts = [out.to_dict() for out in self.outputs]
        return dicts if self.batch else dicts[0]
