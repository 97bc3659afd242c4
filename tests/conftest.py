"""Without a GPU the Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before the
first kernel is defined, so it is set here, before any test module imports deltatron's kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _round_bf16_to_nearest_in_interpreter():
    """The interpreter casts fp32 -> bf16 by truncation (toward zero); the GPU rounds to nearest even.
    Truncation biases every bf16 intermediate the same way, so errors add up instead of averaging out:
    make the interpreter round like the GPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def rounding_cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.array(src.data, dtype=np.float32))
            return interpreter.TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = rounding_cast_impl


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _round_bf16_to_nearest_in_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
