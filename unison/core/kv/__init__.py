"""The core's KV cache: the block pool, the radix prefix cache, per-request recurrent states,
the disk tier, and the KV events published to routers."""
