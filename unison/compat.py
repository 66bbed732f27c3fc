"""Every compatibility table in one place: the SGLang and vLLM names Unison accepts as its own,
takes with no effect, or refuses by name (so that a port knows what to drop)."""

from __future__ import annotations

# ---- command-line spellings (ours are SGLang's) ---------------------------------------------------

# vLLM's spellings beside ours (SGLang's are ours), so either ecosystem's command lines run.
ENGINE_ALIASES = {"model_path": ["--model"], "context_length": ["--max-model-len"],
                  "lora_paths": ["--lora-modules"], "max_loras_per_batch": ["--max-loras"],
                  "max_loaded_loras": ["--max-cpu-loras"]}
SERVE_ALIASES = {"data_parallel_size": ["--dp-size"], "disable_ui": ["--no-webui"]}  # vLLM's, SGLang's

# ---- sglang.Engine's options ----------------------------------------------------------------------

SGLANG_ONLY_POLICIES = ("dfs-weight", "lof", "priority", "routing-key", "hrrn", "shortest-prefill-first")
# sglang.Engine options accepted for compatibility, with the only values that mean something here.
NO_EFFECT = {"tp_size": (1,), "dp_size": (1,), "pp_size": (1,), "disable_cuda_graph": (True, False),
             "trust_remote_code": (True, False)}  # no model code is ever run from a checkpoint
# sglang.Engine's NGRAM speculation options -> SpeculativeConfig's.
SGLANG_SPECULATION = {"speculative_num_draft_tokens": "num_speculative_tokens",
                      "speculative_ngram_min_match_window_size": "prompt_lookup_min",
                      "speculative_ngram_max_match_window_size": "prompt_lookup_max"}
# sglang.Engine options Unison does not have: named in the refusal, so a port knows what to drop.
SGLANG_OPTIONS = frozenset("""
tokenizer_mode skip_server_warmup served_model_name chat_template
completion_template is_embedding enable_multimodal host port api_key ep_size nnodes node_rank
dist_init_addr attention_backend prefill_attention_backend decode_attention_backend sampling_backend
grammar_backend enable_torch_compile torch_compile_max_bs cuda_graph_max_bs cuda_graph_bs
enable_mixed_chunk enable_dp_attention speculative_draft_model_path
speculative_num_steps speculative_eagle_topk
lora_backend max_prefill_tokens page_size
stream_interval watchdog_timeout base_gpu_id gpu_id_step enable_metrics
show_time_cost decode_log_interval enable_memory_saver allow_auto_truncate tool_call_parser
json_model_override_args preferred_sampling_params enable_deterministic_inference
num_continuous_decode_steps torchao_config enable_p2p_check disaggregation_mode
enable_hierarchical_cache schedule_conservativeness cpu_offload_gb kv_cache_dtype_override
constrained_json_whitespace_pattern model_loader_extra_config enable_custom_logit_processor
weight_version load_balance_method disable_overlap_schedule enable_two_batch_overlap
enable_cache_report file_storage_path enable_nan_detection triton_attention_reduce_in_fp32
hybrid_kvcache_ratio swa_full_tokens_ratio modelopt_quant impl
""".split())

# ---- sglang.Engine's generate() arguments and methods -------------------------------------------

# sglang.Engine.generate's arguments for what Unison does not have (audio and video, precomputed
# image hashes, custom logit processors, hidden states, sessions, disaggregation), with their defaults: given
# anything else, the call is refused by name. Tracing and routing hints change no result and
# are taken as given.
SGLANG_UNSUPPORTED = {
    "audio_data": None, "video_data": None, "mm_hashes": None,
    "mm_content_hashes": None, "custom_logit_processor": None,
    "require_reasoning": False, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "disagg_prefill_dp_rank": None, "session_params": None,
    "session_id": None, "cache_salt": None,
}
SGLANG_NO_EFFECT = {"external_trace_header", "kv_router_hint", "routed_dp_rank", "data_parallel_rank"}


_NO_TP = ("Unison runs one process per engine core, with no torch.distributed group; use "
          "update_weights_from_tensor (same host) or update_weights_from_disk")
SGLANG_METHODS = {
    **dict.fromkeys(["open_session", "close_session"], "sessions are not supported"),
    **dict.fromkeys(["start_profile", "stop_profile"],
                    "profile the core process (get_server_info()['core_pid']) with py-spy or perf"),
    **dict.fromkeys(["start_expert_distribution_record", "stop_expert_distribution_record",
                     "dump_expert_distribution_record"], "the experts' routing is not recorded"),
    **dict.fromkeys(["init_weights_update_group", "destroy_weights_update_group",
                     "update_weights_from_distributed", "update_weights_from_ipc", "collective_rpc"],
                    _NO_TP),
    "get_weights_by_name": "weights live in the core process, packed for its kernels",
    "load_lora_adapter_from_tensors": "adapters load from a PEFT directory: save_pretrained() it and "
                                      "use load_lora_adapter",
    **dict.fromkeys(["release_memory_occupation", "resume_memory_occupation"],
                    "the KV cache and weights stay allocated (there is no memory saver)"),
    "freeze_gc": "not needed: the frontends hold few long-lived objects",
    **dict.fromkeys(["save_remote_model", "save_sharded_model"], "the weights are read, never written"),
}
