"""State pools by slot (ssm_state_indices) in the fused_recurrent (decode) and chunk (prefill) forms of the delta rule,
the gated delta rule and KDA (per-channel gates), on both backends (Triton in its interpreter without a GPU):
sequences start from their slots of a pool [S, H, K, V], padding entries (-1) output zeros and touch no slot,
inplace_final_state writes the final states back into the slots and leaves every other slot as it was; serving loops
with requests arriving and leaving (one with speculative steps accepting part of their drafts) against the float64
recurrence of each request."""
import pytest
import torch

import deltatron
from deltatron.reference import recurrent_gated_delta_rule

from .helpers import BOUNDS, DEVICE, INTERPRET, rel_rms

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", request.param)
    return request.param


def _device(backend):
    return DEVICE if backend == "triton" else "cpu"


def _inputs(lengths, Hk, Hv, K, V, device, seed, rule="gated"):
    """q, k, v, beta and g ([1, T, Hv], or [1, T, Hv, K] for KDA's rule; zeros for the delta rule), cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, Hk, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hk, K, generator=gen), dim=-1)
    v = torch.randn(1, T, Hv, V, generator=gen)
    beta = torch.rand(1, T, Hv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, T, Hv, *((K,) if rule == "kda" else ()), generator=gen))
    g = torch.zeros_like(g) if rule == "delta" else g
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device) for x in (q, k, v, beta, g)], cu.to(device)


def _reference(q, k, v, beta, g, h0, cu, scale):
    x = [t.double().cpu() for t in (q, k, v, g, beta, h0)]
    return recurrent_gated_delta_rule(*x[:5], scale, x[5], True, cu_seqlens=cu.cpu())


FORMS = {("delta", "fused_recurrent"): deltatron.fused_recurrent_delta_rule,
         ("gated", "fused_recurrent"): deltatron.fused_recurrent_gated_delta_rule,
         ("kda", "fused_recurrent"): deltatron.fused_recurrent_kda,
         ("delta", "chunk"): deltatron.chunk_delta_rule, ("gated", "chunk"): deltatron.chunk_gated_delta_rule,
         ("kda", "chunk"): deltatron.chunk_kda}
RULES = ["delta", "gated", "kda"]


@pytest.mark.parametrize("form", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("inplace", [False, True])
def test_pool_slots(backend, form, rule, inplace):
    lengths, slots = [1, 3, 1, 2], [5, -1, 0, 3]
    Hk, Hv, K, V, S = 1, 2, 16, 24, 7
    device = _device(backend)
    (q, k, v, beta, g), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=1, rule=rule)
    gated = rule != "delta"
    pool = torch.randn(S, Hv, K, V, generator=torch.Generator().manual_seed(2)).to(device)
    before = pool.clone()
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    gate = dict(g=g) if gated else {}
    chunk = {"chunk_size": 16} if form == "chunk" else {}
    with torch.no_grad():
        o, ht = FORMS[rule, form](q, k, v, beta=beta, **gate, initial_state=pool, output_final_state=True,
                                   cu_seqlens=cu, inplace_final_state=inplace, ssm_state_indices=idx, **chunk)
    live = [n for n, s in enumerate(slots) if s >= 0]
    h0 = torch.stack([before[s] if s >= 0 else torch.zeros_like(before[0]) for s in slots])
    o_ref, ht_ref = _reference(q, k, v, beta, g, h0, cu, K ** -0.5)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for n in range(len(slots)):
        o_n, ref_n = o[0, bounds[n]:bounds[n + 1]], o_ref[0, bounds[n]:bounds[n + 1]]
        if n in live:
            assert rel_rms(o_n, ref_n) <= BOUNDS[torch.float32], n
        else:
            assert torch.count_nonzero(o_n) == 0  # a padding entry outputs zeros
    if inplace:
        assert ht is pool
        for n in live:
            assert rel_rms(pool[slots[n]], ht_ref[n]) <= BOUNDS[torch.float32], n
        untouched = [s for s in range(S) if s not in slots]
        assert torch.equal(pool[untouched], before[untouched])
    else:
        assert torch.equal(pool, before) and ht.shape == (len(slots), Hv, K, V)
        for n in range(len(slots)):
            if n in live:
                assert rel_rms(ht[n], ht_ref[n]) <= BOUNDS[torch.float32], n
            else:
                assert torch.count_nonzero(ht[n]) == 0


def test_serving_loop(backend):
    # requests arrive (a chunk prefill of several tokens into a free slot), decode one token a step
    # (fused_recurrent), and leave (their slot is reused); each request's outputs against the float64 recurrence
    # over all its tokens
    Hk, Hv, K, V, S = 1, 2, 16, 16, 4
    device = _device(backend)
    gen = torch.Generator().manual_seed(3)
    pool = torch.zeros(S, Hv, K, V, device=device)
    streams = {}  # request -> its tokens so far (q, k, v, beta, g) and outputs
    free, active, next_id = list(range(S)), {}, 0

    def step(requests, lengths, fn):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        T = sum(lengths)
        x = [torch.randn(1, T, Hk, K, generator=gen), torch.randn(1, T, Hk, K, generator=gen),
             torch.randn(1, T, Hv, V, generator=gen), torch.rand(1, T, Hv, generator=gen),
             -torch.rand(1, T, Hv, generator=gen)]
        x[1] = torch.nn.functional.normalize(x[1], dim=-1)
        idx = torch.tensor([active[r] for r in requests], dtype=torch.int32, device=device)
        with torch.no_grad():
            o, _ = fn(*(t.to(device) for t in x[:3]), x[4].to(device), x[3].to(device), initial_state=pool,
                      cu_seqlens=cu, inplace_final_state=True, ssm_state_indices=idx)
        for n, r in enumerate(requests):
            sl = slice(int(cu[n]), int(cu[n + 1]))
            streams.setdefault(r, []).append(([t[:, sl] for t in x], o[:, sl].cpu()))

    for round_ in range(4):
        if free:  # a new request with a prefill of 3 + round_ tokens
            r, next_id = next_id, next_id + 1
            active[r] = free.pop(0)
            pool[active[r]] = 0.0
            step([r], [3 + round_], deltatron.chunk_gated_delta_rule)
        step(list(active), [1] * len(active), deltatron.fused_recurrent_gated_delta_rule)  # one token each
        if round_ == 1:  # the oldest request leaves; its slot is reused
            oldest = min(active)
            free.append(active.pop(oldest))
    for r, parts in streams.items():
        x = [torch.cat([p[0][i] for p in parts], 1) for i in range(5)]
        o = torch.cat([p[1] for p in parts], 1)
        o_ref, _ = recurrent_gated_delta_rule(*(t.double() for t in (x[0], x[1], x[2], x[4], x[3])), K ** -0.5)
        assert rel_rms(o, o_ref) <= BOUNDS[torch.float32], r


def test_serving_loop_with_speculative_steps(backend):
    # an engine's loop in vLLM's speculative layout: each request owns W slots of the pool; it arrives with a chunk
    # prefill into its first slot, then takes speculative steps (W draft tokens verified in one fused_recurrent call
    # that writes the state after each into the request's slots, of which a random number are accepted: the next
    # step starts from the last accepted token's slot) and plain decode steps (one token, the same layout), and
    # leaves, its slots reused; every accepted token's output against the float64 recurrence over the request's
    # accepted tokens
    Hk, Hv, K, V, W, R = 1, 2, 16, 16, 3, 3  # R requests at once, each with W slots
    device = _device(backend)
    gen = torch.Generator().manual_seed(4)
    pool = torch.zeros(R * W, Hv, K, V, device=device)
    accepted_tokens, accepted_outputs = {}, {}  # request -> its accepted tokens (q, k, v, beta, g) and outputs
    free, blocks, start_column, next_id = list(range(R)), {}, {}, 0

    def tokens(T):
        x = [torch.randn(1, T, Hk, K, generator=gen), torch.randn(1, T, Hk, K, generator=gen),
             torch.randn(1, T, Hv, V, generator=gen), torch.rand(1, T, Hv, generator=gen),
             -torch.rand(1, T, Hv, generator=gen)]
        x[1] = torch.nn.functional.normalize(x[1], dim=-1)
        return x

    def keep(r, x, o, count):
        accepted_tokens.setdefault(r, []).append([t[:, :count] for t in x])
        accepted_outputs.setdefault(r, []).append(o[:, :count].cpu())

    def step(requests, length):  # every request takes `length` tokens; returns its tokens and outputs
        cu = torch.arange(len(requests) + 1, dtype=torch.int32, device=device) * length
        x = tokens(len(requests) * length)
        slots = torch.tensor([[blocks[r] * W + j for j in range(W)] for r in requests], dtype=torch.int32,
                             device=device)
        accepted = torch.tensor([start_column[r] + 1 for r in requests], dtype=torch.int32, device=device)
        with torch.no_grad():
            o, _ = deltatron.fused_recurrent_gated_delta_rule(
                *(t.to(device) for t in x[:3]), x[4].to(device), x[3].to(device), initial_state=pool, cu_seqlens=cu,
                ssm_state_indices=slots, num_accepted_tokens=accepted, inplace_final_state=True)
        return [([t[:, n * length:(n + 1) * length] for t in x], o[:, n * length:(n + 1) * length])
                for n in range(len(requests))]

    for round_ in range(5):
        if free:  # a new request: a chunk prefill of 4 + round_ tokens into its first slot
            r, next_id = next_id, next_id + 1
            blocks[r], start_column[r] = free.pop(0), 0
            pool[blocks[r] * W] = 0.0  # a new request's state (the slot may hold a previous request's)
            x = tokens(4 + round_)
            idx = torch.tensor([blocks[r] * W], dtype=torch.int32, device=device)
            with torch.no_grad():
                o, _ = deltatron.chunk_gated_delta_rule(*(t.to(device) for t in x[:3]), x[4].to(device),
                                                        x[3].to(device), initial_state=pool, chunk_size=16,
                                                        inplace_final_state=True, ssm_state_indices=idx)
            keep(r, x, o, x[0].shape[1])
        active = sorted(blocks)
        for r, (x, o) in zip(active, step(active, W)):  # a speculative step: a random number of drafts accepted
            count = int(torch.randint(1, W + 1, (1,), generator=gen))
            keep(r, x, o, count)
            start_column[r] = count - 1
        for r, (x, o) in zip(active, step(active, 1)):  # a decode step: its one token, into the first slot
            keep(r, x, o, 1)
            start_column[r] = 0
        if round_ == 2:  # the oldest request leaves; its slots are reused
            oldest = min(blocks)
            free.append(blocks.pop(oldest))
    for r, parts in accepted_tokens.items():
        x = [torch.cat([p[i] for p in parts], 1) for i in range(5)]
        o = torch.cat(accepted_outputs[r], 1)
        o_ref, _ = recurrent_gated_delta_rule(*(t.double() for t in (x[0], x[1], x[2], x[4], x[3])), K ** -0.5)
        assert rel_rms(o, o_ref) <= BOUNDS[torch.float32], r


@pytest.mark.parametrize("change, match", [
    (dict(idx=[0, 7]), r"must lie in \[-1, S\) = \[-1, 7\)"),
    (dict(idx=[0, -2]), r"must lie in \[-1, S\)"),
    (dict(idx=[0]), r"ssm_state_indices must have shape \[N\] = \[2\]"),
    (dict(pool_shape=(7, 2, 16, 8)), r"initial_state is the pool \[S, Hv, K, V\]"),
    (dict(no_pool=True), "needs initial_state"),
    (dict(grad=True), "for inference"),
])
def test_pool_errors(change, match):
    q = torch.randn(1, 2, 1, 16)
    v, beta = torch.randn(1, 2, 2, 16), torch.rand(1, 2, 2)
    pool = None if change.get("no_pool") else torch.zeros(*change.get("pool_shape", (7, 2, 16, 16)))
    if change.get("grad"):
        v.requires_grad_()
    idx = torch.tensor(change.get("idx", [0, 1]), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        deltatron.fused_recurrent_delta_rule(q, q, v, beta, initial_state=pool, cu_seqlens=torch.tensor([0, 1, 2]),
                                             ssm_state_indices=idx)


@pytest.mark.parametrize("softplus", [(1.0, 20.0), (2.0, 1.0)])
@pytest.mark.parametrize("l2norm", [False, True])
def test_fused_sigmoid_gating_decode_step(backend, softplus, l2norm):
    # the raw projections in, the gate, beta and norms made in the op (one kernel on the Triton backend), the pool's
    # slots updated in place; against the float64 recurrence on the same quantities made in float64
    lengths, slots = [1, 1, 2, 1], [2, -1, 0, 4]
    Hk, Hv, K, V, S = 2, 4, 16, 16, 5
    device = _device(backend)
    gen = torch.Generator().manual_seed(4)
    T = sum(lengths)
    q, k = (torch.randn(1, T, Hk, K, generator=gen) for _ in range(2))
    v, a, b = torch.randn(1, T, Hv, V, generator=gen), torch.randn(1, T, Hv, generator=gen) * 3, \
        torch.randn(1, T, Hv, generator=gen)
    A_log, dt_bias = torch.rand(Hv, generator=gen) * 2, torch.randn(Hv, generator=gen)
    pool = torch.randn(S, Hv, K, V, generator=gen)
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pool_dev = pool.to(device)
    with torch.no_grad():
        o = deltatron.fused_sigmoid_gating_delta_rule_update(
            A_log.to(device), a.to(device), dt_bias.to(device), *softplus, q.to(device), k.to(device), v.to(device),
            b.to(device), pool_dev, torch.tensor(slots, dtype=torch.int32, device=device),
            use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu.to(device))
    d = lambda x: x.double()
    g = -d(A_log).exp() * torch.nn.functional.softplus(d(a) + d(dt_bias), beta=softplus[0], threshold=softplus[1])
    qr, kr = (torch.nn.functional.normalize(d(x), dim=-1, eps=0) if l2norm else d(x) for x in (q, k))
    h0 = torch.stack([d(before[s]) if s >= 0 else torch.zeros_like(d(before[0])) for s in slots])
    o_ref, ht_ref = recurrent_gated_delta_rule(qr, kr, d(v), g, d(b).sigmoid(), K ** -0.5, h0, True, cu_seqlens=cu)
    live = [n for n, s in enumerate(slots) if s >= 0]
    tokens = [t for n in live for t in range(int(cu[n]), int(cu[n + 1]))]
    assert rel_rms(o[0, tokens], o_ref[0, tokens]) <= BOUNDS[torch.float32]
    assert torch.count_nonzero(o[0, int(cu[1]):int(cu[2])]) == 0
    for n in live:
        assert rel_rms(pool_dev[slots[n]], ht_ref[n]) <= BOUNDS[torch.float32], n
    untouched = [s for s in range(S) if s not in slots]
    assert torch.equal(pool_dev[untouched].cpu(), before[untouched])


@pytest.mark.parametrize("rule", RULES)
def test_speculative_verify_and_commit(backend, rule):
    # vLLM's layout: a slot per token ([N, W]); each sequence starts from the state its last step accepted (column
    # num_accepted_tokens - 1) and, committed (inplace_final_state), the state after its token j lands in slot
    # [n, j]; a verify step without inplace_final_state writes nothing
    Hk, Hv, K, V = 1, 2, 16, 16
    lengths, accepted = [3, 2, 3], [2, 1, 3]
    slots = [[0, 1, 2], [3, 4, -1], [-1, 6, 7]]  # the third sequence's first slot is padding, not its start
    device = _device(backend)
    (q, k, v, beta, g), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=5, rule=rule)
    pool = torch.randn(9, Hv, K, V, generator=torch.Generator().manual_seed(6)).to(device)
    before = pool.clone()
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    acc = torch.tensor(accepted, dtype=torch.int32, device=device)
    fn = FORMS[rule, "fused_recurrent"]
    gate = {} if rule == "delta" else dict(g=g)
    with torch.no_grad():
        o_verify, _ = fn(q, k, v, beta=beta, **gate, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                         num_accepted_tokens=acc)
        assert torch.equal(pool, before)
        o, ht = fn(q, k, v, beta=beta, **gate, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                   num_accepted_tokens=acc, inplace_final_state=True)
    assert ht is pool and torch.equal(o, o_verify)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    written = set()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = before[slots[n][accepted[n] - 1]]
        for j, t in enumerate(range(start, end)):  # the state after each prefix of the sequence's tokens
            x = [y[:, start:t + 1] for y in (q, k, v, beta, g)]
            o_ref, s_ref = _reference(*x, h0[None], torch.tensor([0, t + 1 - start]), K ** -0.5)
            assert rel_rms(o[:, t], o_ref[:, -1]) <= BOUNDS[torch.float32], (n, j)
            if slots[n][j] >= 0:
                assert rel_rms(pool[slots[n][j]], s_ref[0]) <= BOUNDS[torch.float32], (n, j)
                written.add(slots[n][j])
    untouched = [s for s in range(9) if s not in written]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("commit", [False, True])
def test_sglang_verify_into_intermediate_buffer(backend, commit):
    # SGLang's verify: every token's state into the sequence's buffer row at its step (steps past the buffer's and
    # rows of -1 write nothing); disable_state_update leaves the pool as it was, else each live slot takes the state
    # after the sequence's last token; against the float64 recurrence of each prefix
    Hk, Hv, K, V, S, R, steps = 1, 2, 16, 16, 6, 4, 3
    lengths, slots, rows = [3, 4, 2, 1], [4, 0, -1, 2], [2, 0, 1, -1]
    device = _device(backend)
    (q, k, v, _, _), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=8)
    gen = torch.Generator().manual_seed(9)
    T = sum(lengths)
    a, b = torch.randn(1, T, Hv, generator=gen).to(device), torch.randn(1, T, Hv, generator=gen).to(device)
    A_log, dt_bias = torch.rand(Hv, generator=gen).to(device), torch.randn(Hv, generator=gen).to(device)
    pool = torch.randn(S, Hv, K, V, generator=gen).to(device)
    buffer = torch.randn(R, steps, Hv, K, V, generator=gen).to(device)
    pool_before, buffer_before = pool.clone(), buffer.clone()
    with torch.no_grad():
        o = deltatron.fused_sigmoid_gating_delta_rule_update(
            A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, torch.tensor(slots, dtype=torch.int32, device=device),
            cu_seqlens=cu, disable_state_update=not commit, intermediate_states_buffer=buffer,
            intermediate_state_indices=torch.tensor(rows, device=device), cache_steps=steps)
    g = -A_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    written, committed = set(), set()
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if slots[n] < 0:
            assert not o[:, start:end].any()
            continue
        for j, t in enumerate(range(start, end)):
            x = [y[:, start:t + 1] for y in (q, k, v, b.sigmoid(), g)]
            o_ref, s_ref = _reference(*x, pool_before[slots[n]][None], torch.tensor([0, t + 1 - start]), K ** -0.5)
            assert rel_rms(o[:, t], o_ref[:, -1]) <= BOUNDS[torch.float32], (n, j)
            if rows[n] >= 0 and j < steps:
                assert rel_rms(buffer[rows[n], j], s_ref[0]) <= BOUNDS[torch.float32], (n, j)
                written.add((rows[n], j))
        if commit:
            assert rel_rms(pool[slots[n]], s_ref[0]) <= BOUNDS[torch.float32], n
            committed.add(slots[n])
    for r in range(R):
        for j in range(steps):
            if (r, j) not in written:
                assert torch.equal(buffer[r, j], buffer_before[r, j]), (r, j)
    untouched = [s for s in range(S) if s not in committed]
    assert torch.equal(pool[untouched], pool_before[untouched])


@pytest.mark.parametrize("change, match", [
    (dict(intermediate_state_indices=None), "go together"),
    (dict(intermediate_states_buffer=torch.zeros(2, 3, 2, 16, 8)), r"\[R, steps, Hv, K, V\]"),
    (dict(cache_steps=4), "cache_steps"),
    (dict(intermediate_state_indices=torch.tensor([0, 2])), r"lie in \[-1, R\) = \[-1, 2\)"),
    (dict(intermediate_state_indices=torch.tensor([0])), r"\[N\] = \[2\]"),
    (dict(disable_state_update=1), "disable_state_update must be a bool"),
])
def test_verify_errors(change, match):
    Hk, Hv, K, V = 1, 2, 16, 16
    (q, k, v, b, a), cu = _inputs([2, 1], Hk, Hv, K, V, "cpu", seed=0)
    args = dict(intermediate_states_buffer=torch.zeros(2, 3, Hv, K, V), intermediate_state_indices=torch.tensor([0, 1]),
                cache_steps=3, disable_state_update=True)
    args.update(change)
    error = TypeError if "bool" in match else ValueError
    with pytest.raises(error, match=match), torch.no_grad():
        deltatron.fused_sigmoid_gating_delta_rule_update(
            torch.zeros(Hv), a, torch.zeros(Hv), 1.0, 20.0, q, k, v, b, torch.zeros(3, Hv, K, V),
            torch.tensor([0, 1]), cu_seqlens=cu, **args)


@pytest.mark.parametrize("rule", RULES)
def test_pool_chunk_states(backend, rule):
    # output_chunk_states on a pool: each live entry's chunks as on its dense state, a padding entry's zeros
    lengths, slots, C = [20, 5, 0, 17], [2, -1, 0, 4], 16
    Hk, Hv, K, V = 1, 2, 16, 8
    device = _device(backend)
    (q, k, v, beta, g), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=5, rule=rule)
    pool = torch.randn(6, Hv, K, V, generator=torch.Generator().manual_seed(6)).to(device)
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    h0 = torch.stack([pool[s] if s >= 0 else torch.zeros_like(pool[0]) for s in slots])
    gate = {} if rule == "delta" else dict(g=g)
    fn = FORMS[rule, "chunk"]
    with torch.no_grad():
        o, _, states = fn(q, k, v, beta=beta, **gate, initial_state=pool.clone(), cu_seqlens=cu, chunk_size=C,
                          inplace_final_state=True, ssm_state_indices=idx, output_chunk_states=True)
        _, _, want = fn(q, k, v, beta=beta, **gate, initial_state=h0, cu_seqlens=cu, chunk_size=C,
                        output_chunk_states=True)
    seq_of_chunk = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([-(-n // C) for n in lengths]))
    for c, n in enumerate(seq_of_chunk.tolist()):
        if slots[n] >= 0:
            assert torch.equal(states[c], want[c]), c
        else:
            assert torch.count_nonzero(states[c]) == 0, c


def test_pool_prefill_reads_no_slot_on_the_host(monkeypatch):
    # the Triton backend's chunk prefill on a pool with prepare_varlen's metadata reads the slots on the device only
    # (what CUDA-graph capture needs): with every host read of a tensor's values refused, the same bits as eagerly
    if DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    lengths, slots = [5, 0, 19], [3, -1, 0, -1]
    (q, k, v, beta, g), _ = _inputs(lengths, 1, 2, 16, 8, DEVICE, seed=7)
    q, k, v, beta, g = (torch.cat([x, torch.randn_like(x[:, :6])], 1) for x in (q, k, v, beta, g))  # spare rows
    meta = deltatron.prepare_varlen([0, 5, 5, 24], max_sequences=4, max_tokens=30, chunk_sizes=(16,), device=DEVICE)
    pool = torch.randn(5, 2, 16, 8, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)

    def call(pool):
        with torch.no_grad():
            return deltatron.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=meta,
                                                    chunk_size=16, inplace_final_state=True, ssm_state_indices=idx)

    eager_o, eager_pool = call(pool.clone())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _name=name, **kw: pytest.fail(f"Tensor.{_name} read"))
    o, pooled = call(pool.clone())
    monkeypatch.undo()
    assert torch.equal(o, eager_o) and torch.equal(pooled, eager_pool)
    assert torch.equal(pooled[[1, 2, 4]], pool[[1, 2, 4]])  # slots no live entry names


@pytest.mark.parametrize("rule", ["gated", "kda"])
@pytest.mark.parametrize("layout", ["slots", "slots_per_token", "dense"])
def test_v_first_states_as_the_kernel_reads_them(backend, rule, layout):
    # state_v_first (vLLM's and FlashInfer's [V, K] states) in the fused_recurrent form: a pool by slot (in place,
    # a padding entry), a slot per token (a committed verify step) and dense states, each the same bits as the [K, V]
    # call on the transposed states (on the Triton backend the kernel reads and writes [V, K] tiles itself; on a GPU
    # it reduces over K along the tile's other axis, so there the same values up to the order of fp32 sums)
    Hk, Hv, K, V = 1, 2, 16, 24
    lengths = [2, 3, 1]
    device = _device(backend)
    (q, k, v, beta, g), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=9, rule=rule)
    pool = torch.randn(7, Hv, K, V, generator=torch.Generator().manual_seed(10)).to(device)
    fn = FORMS[rule, "fused_recurrent"]
    args = dict(beta=beta, g=g, cu_seqlens=cu)
    if layout == "slots":
        args.update(ssm_state_indices=torch.tensor([5, -1, 2], dtype=torch.int32, device=device),
                    inplace_final_state=True)
    elif layout == "slots_per_token":
        args.update(ssm_state_indices=torch.tensor([[0, 1, -1], [2, 3, 4], [-1, 6, 5]], dtype=torch.int32,
                                                   device=device),
                    num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32, device=device),
                    inplace_final_state=True)
    else:
        pool = pool[:3]
        args.update(output_final_state=True)
    k_first, v_first = pool.clone(), pool.transpose(-1, -2).contiguous()
    with torch.no_grad():
        o, ht = fn(q, k, v, initial_state=k_first, **args)
        o_vf, ht_vf = fn(q, k, v, initial_state=v_first, state_v_first=True, **args)
    same = torch.equal if device == "cpu" else (lambda a, b: rel_rms(a, b) <= 1e-6)
    assert same(o_vf, o) and same(ht_vf.transpose(-1, -2), ht)
    if layout != "dense":
        assert ht_vf is v_first
