"""The control plane's declarations agree: each control request type has one reply type and one
handler in the core whose signature says so, and every reply type travels in ControlReply."""

from __future__ import annotations

import gc
import re
import types
import typing

import msgspec
import pytest

from unison.core.controls import Controls
from unison.wire import messages as protocol

EXAMPLES = {  # one of each, for the types whose fields have no defaults
    protocol.UpdateWeights: protocol.UpdateWeights("/models/next"),
    protocol.UpdateTensors: protocol.UpdateTensors("/dev/shm/tensors.safetensors"),
    protocol.LoadLoraAdapter: protocol.LoadLoraAdapter("sql", "/adapters/sql", pinned=True),
    protocol.UnloadLoraAdapter: protocol.UnloadLoraAdapter("sql"),
}


def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub} | _subclasses(sub)}


def _types(annotation: object) -> set[object]:
    """The types a (possibly union) annotation admits."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return set(typing.get_args(annotation)) if union else {annotation}


def test_every_request_type_is_on_the_wire():
    """A ControlRequest subclass left out of the Control union could be built but never sent."""
    assert _subclasses(protocol.ControlRequest) == set(protocol.CONTROL_REQUESTS)
    tags = [cls.__struct_config__.tag for cls in protocol.CONTROL_REQUESTS]
    assert len(set(tags)) == len(tags), tags


def test_every_request_type_has_exactly_one_handler():
    assert set(Controls.HANDLERS) == set(protocol.CONTROL_REQUESTS)


@pytest.mark.parametrize("cls", protocol.CONTROL_REQUESTS, ids=lambda c: c.__name__)
def test_each_handler_takes_its_request_and_returns_its_reply_type(cls):
    hints = typing.get_type_hints(Controls.HANDLERS[cls])
    assert cls in _types(hints["req"]), f"{cls.__name__}'s handler takes {hints['req']}"
    returns = _types(hints["return"])  # None: it answers later (a weight update)
    assert cls.reply in returns and returns <= {cls.reply, type(None)}, (
        f"{cls.__name__} declares {cls.reply.__name__}; its handler returns {hints['return']}")


def test_every_reply_type_travels_in_control_reply():
    declared = {cls.reply for cls in protocol.CONTROL_REQUESTS}
    assert set(typing.get_args(protocol.ControlResult)) == declared
    hints = typing.get_type_hints(protocol.ControlReply)
    assert _types(hints["result"]) == declared | {type(None)}


@pytest.mark.parametrize("cls", protocol.CONTROL_REQUESTS, ids=lambda c: c.__name__)
def test_each_request_round_trips_as_itself(cls):
    req = EXAMPLES.get(cls) or cls()
    msg = protocol.decode_to_core(protocol.encode(protocol.Control(7, req)))
    assert msg == protocol.Control(7, req) and type(msg.request) is cls


def test_a_reply_of_another_type_is_an_error_not_a_value():
    info = protocol.GetServerInfo()
    with pytest.raises(RuntimeError, match="server_info: the engine core answered with OpResult"):
        info.check_reply(protocol.OpResult(True))
    assert protocol.FlushCache().check_reply(protocol.OpResult(True)) == protocol.OpResult(True)


def test_a_request_without_a_reply_type_is_refused_at_definition():
    with pytest.raises(TypeError, match="must name its reply type"):
        class Nameless(protocol.ControlRequest, tag="nameless"):  # noqa: F841
            pass
    with pytest.raises(TypeError, match="must name its reply type"):
        class Generic(protocol.ControlRequest[protocol.ReplyT], tag="generic"):  # noqa: F841
            pass
    gc.collect()  # the half-made classes must not linger among ControlRequest's subclasses
    assert _subclasses(protocol.ControlRequest) == set(protocol.CONTROL_REQUESTS)


@pytest.mark.parametrize("request_, where", [
    ({"type": "pause", "mode": "sideways"}, "$.request.mode"),
    ({"type": "reboot"}, "$.request.type"),
    ({"type": "abort_requests", "rid": 5}, "$.request.rid"),
])
def test_an_unreadable_control_still_yields_its_cid(request_, where):
    data = msgspec.msgpack.encode({"type": "Control", "cid": 41, "request": request_})
    with pytest.raises(msgspec.ValidationError, match=re.escape(where)):
        protocol.decode_to_core(data)
    assert protocol.decode_control_head(data).cid == 41
