"""Portable Triton stages of the chunk algorithm (DESIGN.md §5): they run on every GPU and in Triton's interpreter."""
