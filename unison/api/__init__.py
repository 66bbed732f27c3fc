"""The Python API: `Engine` (shaped like sglang.Engine), its loop thread, attaching to a running
core, and the handle on the core process an owner starts."""
