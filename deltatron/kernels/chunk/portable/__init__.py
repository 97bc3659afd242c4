"""Portable Triton stages of the chunk algorithm: they run on every GPU and in Triton's interpreter."""
