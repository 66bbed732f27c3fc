"""The model: location and GGUF conversion (loader, gguf), Llama-family compute (llama), ModelRunner."""
