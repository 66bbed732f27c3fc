"""Fan-out: one pass over the core's outputs, applied to the requests in flight on a frontend.

The frontend's loop hands every output of a pass (one step, or several when it fell behind) to
`fan_out` at once, so each consumer is woken once per pass, not once per token or per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from unison.frontend.request import ReqState
from unison.wire.messages import Abort, ReqOutput

log = logging.getLogger("unison.frontend")


def fan_out(states: dict[str, ReqState], outputs: list[ReqOutput]) -> list[Abort]:
    """Apply `outputs` to `states` (the requests in flight, by rid; finished ones leave it) and
    wake each consumer once; returns what the core must be told (requests a stop string or a
    failure ended here)."""
    wakers: dict[Callable[[], None], None] = {}  # one call per consumer, in order
    replies = []
    for out in outputs:
        state = states.get(out.rid)
        if state is None:
            continue  # finished here already (a stop string, an abort)
        try:
            state.update(out)
        except Exception as e:  # one request's failure must not end the receive loop
            log.exception("request %s failed in the frontend", out.rid)
            state.fail(e)
            del states[out.rid]
            replies.append(Abort(out.rid))
            continue
        if out.queued:
            continue
        if state.waker is not None:
            wakers[state.waker] = None
        if state.finished:
            del states[out.rid]
            if state.stopped_here:
                replies.append(Abort(out.rid, finished=True))
    for wake in wakers:
        try:
            wake()
        except RuntimeError:  # its event loop is closed: nobody is waiting there
            pass
    return replies
