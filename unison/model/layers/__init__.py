"""A forward's parts: attention over the paged cache (with the int8 cache's key rounding and
recent rows), linears, experts, Gated DeltaNet, rotary embeddings, LoRA."""
