"""The engine core process: scheduler, KV blocks, model runner and sampler behind one socket."""
