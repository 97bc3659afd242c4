"""GPU-only tests (marked gpu; skipped without CUDA). Realistic sizes; run them with tests/gpu/run_suite.py."""

# (B, T, H, head size K = V, chunk size) of the chunk pipeline's fixed-length tests, forward and backward:
# long and short sequences, B*H up to 64, every head size class (16, 64, 128, 256 and 100), every chunk size
CHUNK_SHAPES = [
    (2, 8192, 4, 128, 64),
    (4, 2048, 16, 64, 64),
    (1, 4096, 8, 256, 64),
    (8, 1000, 8, 100, 32),
    (2, 777, 32, 128, 16),
    (8, 128, 4, 16, 64),  # 16-wide heads (deltatron train's CPU preset), where the fused WY kernel once failed on the GPU
]
