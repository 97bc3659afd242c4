"""portable/output.py: o = scale (Q S + (Q K^T ⊙ M) V') per chunk, the output stage of the unfused walk, against
float64."""
import pytest
import torch

from deltatron.kernels.chunk.portable import output

from ....helpers import DEVICE, rel_rms
from ..helpers import STAGE_BOUNDS, chunk_rows, needs_triton, output_reference, packed

pytestmark = needs_triton


@pytest.mark.parametrize("dtype, C, lengths, K, V", [
    (torch.float32, 32, [33, 1], 40, 24),
    (torch.bfloat16, 16, [18, 0, 16], 24, 40),
    (torch.float16, 64, [64, 5], 32, 32),
])
def test_output_fwd(poison, dtype, C, lengths, K, V):
    H, scale = 2, 0.37
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=6)
    spans = chunk_rows(lengths, C)
    h = torch.randn(len(spans), H, K, V, device=DEVICE).to(dtype)
    v_new = inp["v"]
    o = output.output_fwd(inp["q"], inp["k"], v_new, h, scale, info, C)
    o_ref = output_reference(ref["q"], ref["k"], h.cpu().double(), ref["v"], scale, lengths, C)
    assert o.dtype == dtype
    assert rel_rms(o, o_ref) < STAGE_BOUNDS[dtype]
