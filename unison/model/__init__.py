"""The model: location and GGUF conversion (loader, gguf), Llama compute (llama), ModelRunner."""
