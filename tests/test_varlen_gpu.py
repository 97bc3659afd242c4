"""prepare_varlen's metadata under CUDA-graph capture (marked gpu): a varlen chunk prefill of the gated rule (dense
states, and on a state pool in place), and a decode step on a state pool (fused_recurrent of the gated rule, on
[K, V] and on [V, K] states, and of KDA with its gate made in the op, in place; and the fused gating entry) captured
once, then replayed on new lengths (update()), slots and inputs copied into the captured tensors, each replay equal
to the eager call (the dense prefill on plain cu_seqlens tensors within bf16's bound: its eager call is planned for
its own lengths; the pooled prefill bit for bit on the same metadata); the [V, K] step bit for bit as the [K, V]
one."""
import pytest
import torch

import deltatron

from .helpers import BOUNDS, rel_rms

pytestmark = pytest.mark.gpu

Hk, Hv, K, V = 2, 4, 64, 64


def _fill(gen, q, k, v, g, beta):
    """New random inputs written into the captured tensors."""
    for x in (q, v):
        x.copy_(torch.randn(x.shape, generator=gen))
    k.copy_(torch.nn.functional.normalize(torch.randn(k.shape, generator=gen), dim=-1))
    g.copy_(-torch.nn.functional.softplus(torch.randn(g.shape, generator=gen)))
    beta.copy_(torch.rand(beta.shape, generator=gen))


def _captured(fn):
    """(graph, its outputs) of fn after one eager call on a side stream (Triton compiles outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _replay_then_eager(graph, out, step, pool):
    """Replays graph (whose output is out), then runs step eagerly from the same pool: (the pool before, the replay's
    output, the pool after the replay, the eager output); the pool is left as the eager step wrote it."""
    before = pool.clone()
    graph.replay()
    replayed, after = out.clone(), pool.clone()
    pool.copy_(before)
    return before, replayed, after, step()


@torch.no_grad()
def test_varlen_prefill_replays_on_new_lengths():
    max_sequences, max_tokens = 4, 300
    meta = deltatron.prepare_varlen([0, 100, 100, 180], max_sequences, max_tokens)
    q, k = (torch.empty(1, max_tokens, Hk, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, max_tokens, Hv, V, device="cuda", dtype=torch.bfloat16)
    g, beta = (torch.empty(1, max_tokens, Hv, device="cuda") for _ in range(2))
    h0 = torch.empty(max_sequences, Hv, K, V, device="cuda")
    gen = torch.Generator().manual_seed(0)
    _fill(gen, q, k, v, g, beta)
    h0.copy_(torch.randn(h0.shape, generator=gen))
    graph, (o, ht) = _captured(lambda: deltatron.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=meta))
    for cu in ([0, 300], [0, 7, 7, 150, 299], [0, 64, 128, 192]):
        meta.update(cu)
        _fill(gen, q, k, v, g, beta)
        graph.replay()
        T, N = cu[-1], len(cu) - 1
        want_o, want_ht = deltatron.chunk_gated_delta_rule(
            q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], initial_state=h0[:N], output_final_state=True,
            cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32), cu_seqlens_cpu=torch.tensor(cu))
        # the same kernels on another plan (capacity-sized launches): within bf16's bound
        bound = BOUNDS[torch.bfloat16]
        assert rel_rms(o[:, :T], want_o) <= bound and rel_rms(ht[:N], want_ht) <= bound
        assert not o[:, T:].any() and torch.equal(ht[N:], h0[N:])


@torch.no_grad()
def test_pool_prefill_replays_on_new_lengths_and_slots():
    max_sequences, max_tokens, S = 4, 300, 9
    meta = deltatron.prepare_varlen([0, 100, 100, 180], max_sequences, max_tokens)
    q, k = (torch.empty(1, max_tokens, Hk, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, max_tokens, Hv, V, device="cuda", dtype=torch.bfloat16)
    g, beta = (torch.empty(1, max_tokens, Hv, device="cuda") for _ in range(2))
    pool = torch.randn(S, Hv, K, V, device="cuda")
    slots = torch.tensor([4, -1, 0, -1], device="cuda", dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    _fill(gen, q, k, v, g, beta)

    def prefill():
        return deltatron.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=meta,
                                                inplace_final_state=True, ssm_state_indices=slots)[0]

    graph, o = _captured(prefill)
    for cu, new_slots in (([0, 300], [7, -1, -1, -1]), ([0, 7, 7, 150, 299], [2, 8, -1, 5]),
                          ([0, 64, 128, 192], [1, 3, 6, -1])):
        meta.update(cu)
        slots.copy_(torch.tensor(new_slots))
        _fill(gen, q, k, v, g, beta)
        before, replayed, after, want = _replay_then_eager(graph, o, prefill, pool)
        assert torch.equal(replayed, want) and torch.equal(after, pool), cu
        untouched = [s for s in range(S) if s not in new_slots]
        assert torch.equal(after[untouched], before[untouched]) and not replayed[:, cu[-1]:].any()


@torch.no_grad()
def test_pool_decode_replays_with_new_slots():
    B, S = 8, 12
    q, k = (torch.empty(B, 1, Hk, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(B, 1, Hv, V, device="cuda", dtype=torch.bfloat16)
    g, beta = (torch.empty(B, 1, Hv, device="cuda") for _ in range(2))
    gk = torch.empty(B, 1, Hv, K, device="cuda")  # KDA's raw per-channel gate projection
    A_log, dt_bias = torch.randn(Hv, device="cuda"), torch.randn(Hv, device="cuda")
    kda_dt_bias = torch.randn(Hv * K, device="cuda")
    pool = torch.randn(S, Hv, K, V, device="cuda")
    pool_v_first = pool.transpose(-1, -2).contiguous()  # vLLM's layout, [S, Hv, V, K]
    slots = torch.arange(B, device="cuda", dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    _fill(gen, q, k, v, g, beta)
    steps = {
        "fused_recurrent": lambda: deltatron.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots)[0],
        "fused_recurrent_v_first": lambda: deltatron.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=pool_v_first, inplace_final_state=True, ssm_state_indices=slots,
            state_v_first=True)[0],
        "fused_gating": lambda: deltatron.fused_sigmoid_gating_delta_rule_update(
            A_log, g, dt_bias, 1.0, 20.0, q, k, v, beta, pool, slots, use_qk_l2norm_in_kernel=True),
        "fused_recurrent_kda": lambda: deltatron.fused_recurrent_kda(
            q, k, v, gk, beta, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=kda_dt_bias, use_qk_l2norm_in_kernel=True)[0],
    }
    for name, step in steps.items():
        graph, o = _captured(step)
        for new_slots in ([11, -1, 3, 4, 0, 9, -1, 2], [0, 1, 2, 3, 4, 5, 6, 7]):
            slots.copy_(torch.tensor(new_slots))
            _fill(gen, q, k, v, g, beta)
            gk.copy_(torch.randn(gk.shape, generator=gen))
            states = pool_v_first if name.endswith("v_first") else pool
            _, replayed, after, want = _replay_then_eager(graph, o, step, states)
            assert torch.equal(replayed, want) and torch.equal(after, states), name
    # the kernel's [V, K] tiles: the [K, V] step's values up to the order of its fp32 sums (S^T k and S^T q reduce
    # over K along the tile's other axis), so o within one bf16 rounding and the states within fp32's
    pool_v_first.copy_(pool.transpose(-1, -2))
    o_v_first, o = steps["fused_recurrent_v_first"](), steps["fused_recurrent"]()
    assert torch.allclose(o_v_first.float(), o.float(), rtol=2 ** -7, atol=0)
    assert rel_rms(pool_v_first, pool.transpose(-1, -2)) <= 1e-6
