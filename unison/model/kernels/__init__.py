"""The C kernels (csrc/) and their ctypes face, and the torch reference they are tested against."""
