"""The model: ModelRunner (the core's one interface to it), the families, the one decoder forward,
and the KV and state budget; its parts in layers/, weights/, vision/, pooling/ and kernels/."""
