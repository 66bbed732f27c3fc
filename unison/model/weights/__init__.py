"""Where a model's tensors come from: GGUF and safetensors files, their block formats,
quantization at load."""
