"""Every public Engine method checks its arguments before anything is sent: a wrong type or value
is a TypeError / ValueError naming the argument, and the engine is unchanged after it."""

from __future__ import annotations

import inspect

import pytest

from unison import Engine

# (method, kwargs, the argument the error must name)
BAD_CALLS = [
    ("generate", {"prompt": 5}, "prompt"),
    ("generate", {"prompt": "x", "sampling_params": 5}, "sampling_params"),
    ("generate", {"prompt": "x", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ("generate", {"input_ids": "abc"}, "input_ids"),
    ("generate", {"prompt": "x", "stream": "yes"}, "stream"),
    ("generate", {"prompt": "x", "rid": 5}, "rid"),
    ("generate", {"prompt": "x", "return_logprob": "yes"}, "return_logprob"),
    ("generate", {"prompt": "x", "priority": "high"}, "priority"),
    ("generate", {"prompt": "x", "top_logprobs_num": "3"}, "top_logprobs_num"),
    ("generate", {"prompt": "x", "lora_path": "adapter"}, "lora_path"),  # LoRA is off here
    ("generate", {"prompt": ["x", "y"], "lora_path": ["a"]}, "lora_path"),
    ("generate", {"prompt": "x", "lora_path": 5}, "lora_path"),
    ("async_generate", {"prompt": 5}, "prompt"),
    ("async_generate", {"prompt": "x", "stream": 1}, "stream"),
    # Pooling calls to this generation model (test_embeddings.py has them on encoders).
    ("encode", {"prompt": "x"}, "model"),
    ("encode", {"prompt": "x", "dimensions": 5}, "dimensions"),
    ("async_encode", {"prompt": ["x"]}, "model"),
    ("rerank", {"query": "q", "documents": ["d"]}, "model"),
    ("rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("rerank", {"query": "q", "documents": ["d"], "return_documents": "yes"}, "return_documents"),
    ("score", {"text_1": "a", "text_2": ["b"]}, "model"),
    ("async_score", {"text_1": "a", "text_2": "b"}, "model"),
    ("abort_request", {"rid": ["a"]}, "rid"),
    ("abort_request", {"abort_all": "yes"}, "abort_all"),
    ("pause_generation", {"mode": 5}, "mode"),
    ("pause_generation", {"mode": "sideways"}, "mode"),
    ("update_weights_from_disk", {"model_path": None}, "model_path"),
    ("update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("update_weights_from_disk", {"model_path": "m.gguf", "load_format": 5}, "load_format"),
    ("update_weights_from_disk", {"model_path": "m.gguf", "abort_all_requests": "no"}, "abort_all_requests"),
    ("update_weights_from_tensor", {"named_tensors": 5}, "named_tensors"),
    ("update_weights_from_tensor", {"named_tensors": [("w", 1.0)]}, "named_tensors"),
    ("update_weights_from_tensor", {"named_tensors": [], "flush_cache": "no"}, "flush_cache"),
    ("update_weights_from_tensor", {"named_tensors": [], "load_format": "direct"}, "load_format"),
    ("load_lora_adapter", {"lora_name": 5, "lora_path": "/a"}, "lora_name"),
    ("load_lora_adapter", {"lora_name": "a", "lora_path": 5}, "lora_path"),
    ("load_lora_adapter", {"lora_name": "a", "lora_path": "/a", "pinned": "yes"}, "pinned"),
    ("async_load_lora_adapter", {"lora_name": None, "lora_path": "/a"}, "lora_name"),
    ("unload_lora_adapter", {"lora_name": 5}, "lora_name"),
    ("async_unload_lora_adapter", {"lora_name": ["a"]}, "lora_name"),
    ("attach_tokenizer_worker", {"parent_pid": "1"}, "parent_pid"),
    ("attach_tokenizer_worker", {"registry_file": 5}, "registry_file"),
    ("attach_tokenizer_worker", {"address": 5, "server_key": "k", "client_key": "k"}, "address"),
    ("attach_tokenizer_worker", {"heartbeat_timeout_s": 0}, "heartbeat_timeout_s"),
    ("attach_tokenizer_worker", {"heartbeat_timeout_s": "3"}, "heartbeat_timeout_s"),
]
NO_ARGUMENTS = {"get_server_info", "server_info", "get_model_info", "flush_cache", "continue_generation",
                "check_integrity", "get_all_child_pids", "shutdown"}


def test_every_public_method_is_covered():
    """A new public method with arguments must get its bad-input cases here."""
    public = {name for name, member in inspect.getmembers(Engine, callable) if not name.startswith("_")}
    assert public == {m for m, _, _ in BAD_CALLS} | NO_ARGUMENTS
    for name in NO_ARGUMENTS:
        params = [p for p in inspect.signature(getattr(Engine, name)).parameters if p != "self"]
        assert params == [], f"{name} takes arguments: add its bad-input cases"


@pytest.fixture(scope="module")
def engine():
    with Engine(max_total_tokens=2048) as e:
        yield e


@pytest.mark.parametrize("method, kwargs, field", BAD_CALLS, ids=[f"{m}-{f}" for m, _, f in BAD_CALLS])
def test_a_bad_argument_is_refused_by_name(engine: Engine, method: str, kwargs: dict, field: str):
    call = getattr(Engine if method == "attach_tokenizer_worker" else engine, method)
    with pytest.raises((TypeError, ValueError), match=field):
        result = call(**kwargs)
        if inspect.iscoroutine(result):
            import asyncio

            asyncio.run(result)
    info = engine.get_server_info()
    assert info["num_running"] == info["num_waiting"] == 0 and not info["paused"]
    engine.check_integrity()


def test_the_engine_serves_after_every_refusal(engine: Engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 4
    info = engine.get_server_info()
    assert info["model_path"].endswith(".gguf")  # the embedded file, resolved: what is served
    assert engine.get_model_info()["model_path"] == info["model_path"]
