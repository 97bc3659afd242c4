"""portable/walk.py: the state pass (state_fwd), the forward's fused walk (state_output_fwd) and the backward's walk
computing W, U on chip (state_wy_fwd), each against float64 or against the composition of the stages it replaces."""
import pytest
import torch

from deltatron.kernels.chunk.portable import output, walk, wy
from deltatron.reference.chunk import intra_chunk_wy

from ....helpers import DEVICE, INTERPRET, rel_rms
from ..helpers import (ONE_ROUNDING_FWD, STAGE_BOUNDS, needs_triton, output_reference, packed, packed_growing,
                       per_sequence_chunks, state_reference)

pytestmark = needs_triton


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 16], 24, 40, True),
    (torch.float16, 32, [40, 0], 32, 24, False),
    (torch.bfloat16, 64, [65, 7], 40, 32, True),
])
def test_state_fwd(poison, dtype, C, lengths, K, V, has_h0):
    inp, info, ref = packed(lengths, 2, K, V, dtype, seed=5, initial_state=has_h0)
    _, _, W, U = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    w, u = W.to(dtype).to(DEVICE), U.to(dtype).to(DEVICE)
    h0 = inp.get("initial_state")
    h, v_new, final = walk.state_fwd(inp["k"], w, u, h0, True, info, C)
    h_ref, vn_ref, final_ref = state_reference(ref["k"], w.cpu().double(), u.cpu().double(), ref.get("initial_state"),
                                               lengths, C)
    assert h.dtype == dtype and v_new.dtype == dtype and final.dtype == torch.float32
    assert rel_rms(h, h_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(v_new, vn_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(final, final_ref) < STAGE_BOUNDS[dtype]
    if 0 in lengths:  # an empty sequence passes its initial state (or zeros) through exactly
        n = lengths.index(0)
        assert torch.equal(final[n], h0[n] if has_h0 else torch.zeros_like(final[n]))
    _, _, no_final = walk.state_fwd(inp["k"], w, u, h0, False, info, C)
    assert no_final is None


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 16], 24, 40, True),
    (torch.float32, 32, [1], 40, 24, False),
    (torch.float16, 32, [40, 0, 1, 31], 32, 24, False),
    (torch.float16, 16, [33], 24, 24, True),
    (torch.bfloat16, 64, [65, 7], 40, 32, True),
    (torch.bfloat16, 16, [0, 1, 15, 16, 17], 24, 40, False),
])
def test_state_output_fwd(poison, dtype, C, lengths, K, V, has_h0):
    # the fused walk against the float64 composition of the two stages it replaces (state pass, output)
    H, scale = 2, 0.37
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=7, initial_state=has_h0)
    _, _, W, U = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    w, u = W.to(dtype).to(DEVICE), U.to(dtype).to(DEVICE)
    h0 = inp.get("initial_state")
    o, final = walk.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, True, info, C)
    h_ref, vn_ref, final_ref = state_reference(ref["k"], w.cpu().double(), u.cpu().double(), ref.get("initial_state"),
                                               lengths, C)
    o_ref = output_reference(ref["q"], ref["k"], h_ref, vn_ref, scale, lengths, C)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert rel_rms(o, o_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(final, final_ref) < STAGE_BOUNDS[dtype]
    if 0 in lengths:  # an empty sequence passes its initial state (or zeros) through exactly
        n = lengths.index(0)
        assert torch.equal(final[n], h0[n] if has_h0 else torch.zeros_like(final[n]))
    o2, no_final = walk.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, False, info, C)
    assert no_final is None and torch.equal(o2, o)


@pytest.mark.parametrize("dtype, C, K, V", [
    (torch.float32, 32, 40, 24),
    (torch.float16, 16, 24, 40),
    (torch.bfloat16, 64, 32, 16),
])
def test_state_output_fwd_matches_unfused(poison, dtype, C, K, V):
    # same W, U: the fused walk rounds S and V' as the unfused pair does (h and v_new in the input dtype),
    # so only the order of fp32 sums may differ: on a GPU the two kernels' dots may sum in another order
    # (about one rounding apart). In the interpreter the walk computes the same products as the unfused pair (the
    # output stage does not tile K at these sizes), so the same bits
    lengths, H, scale = [C + 1, 0, 1, C], 2, 0.3
    inp, info, _ = packed(lengths, H, K, V, dtype, seed=8, initial_state=True)
    _, w, u = wy.wy_fwd(inp["k"], inp["v"], inp["beta"], info, C)
    h0 = inp["initial_state"]
    h, v_new, final_unfused = walk.state_fwd(inp["k"], w, u, h0, True, info, C)
    o_unfused = output.output_fwd(inp["q"], inp["k"], v_new, h, scale, info, C)
    o, final = walk.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, True, info, C)
    assert rel_rms(o, o_unfused) < ONE_ROUNDING_FWD[dtype]
    assert rel_rms(final, final_unfused) < ONE_ROUNDING_FWD[dtype]
    if INTERPRET:
        assert torch.equal(o, o_unfused) and torch.equal(final, final_unfused)


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 33, 0], 24, 40, True),  # empty sequences, a 1-token one, partial chunks
    (torch.float32, 32, [20, 40], 40, 72, False),  # two V-blocks, the second partial
    (torch.float16, 32, [1], 40, 24, True),  # T = 1
    (torch.float16, 16, [0, 15, 16, 17], 24, 40, False),
    (torch.bfloat16, 64, [65, 0, 3], 40, 32, True),
    (torch.bfloat16, 16, [20, 40], 24, 72, False),
])
def test_state_wy_fwd_matches_composition(dtype, C, lengths, K, V, has_h0, poison):
    """The walk computing W, U on chip from the stored Tinv (the backward's recompute) against
    wy.recompute_w_u + walk.state_fwd: the same products in the same order (wy.wy_product), so the same
    bits: W (written by the first V-block's programs only), h, v_new and the final state."""
    H = 2
    inp, info, _ = packed_growing(lengths, H, K, V, dtype, seed=C + K + V)
    h0 = torch.randn(len(lengths), H, K, V, device=DEVICE) if has_h0 else None
    k, v, beta = inp["k"], inp["v"], inp["beta"]
    tinv = wy.tinv_fwd(k, beta, info, C)
    w, u = wy.recompute_w_u(k, v, beta, tinv, info, C)
    want = (w, *walk.state_fwd(k, w, u, h0, True, info, C))
    got = walk.state_wy_fwd(k, v, beta, tinv, h0, True, info, C)
    for name, x, ref in zip(("w", "h", "v_new", "final_state"), got, want):
        assert x.dtype == ref.dtype and x.shape == ref.shape, name
        assert torch.equal(x, ref), f"{name}: rel RMS {rel_rms(x, ref):.2e}"
    assert walk.state_wy_fwd(k, v, beta, tinv, h0, False, info, C)[3] is None
