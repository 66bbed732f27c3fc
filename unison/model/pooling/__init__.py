"""Encoder models (embeddings, cross-encoder scores) and what a pooling model serves."""
