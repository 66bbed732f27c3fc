"""Every message that crosses a process: frontend <-> core (msgspec structs), the registry file an
Engine is found by, the model pool's messages, and KV events. Imports no layer that uses it."""
