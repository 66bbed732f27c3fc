"""The image side: vision towers, their projectors and llama.cpp's mmproj files."""
