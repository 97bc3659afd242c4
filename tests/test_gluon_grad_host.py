"""The Gluon grad kernel's host wrapper (kernels/chunk/gluon_grad.py) on the CPU: the launch it makes with the kernel
replaced by a recorder (grid, descriptors' blocks, output dtypes, partition budgets), the batch without tokens
(nothing launched: a TMA descriptor cannot be built on zero rows), and the misuse it refuses. The kernel itself is
checked on the GPU (tests/gpu/test_gluon_grad_gpu.py), its algebra by tests/test_gluon_grad_model.py."""
import pytest
import torch

from deltatron.kernels.utils import seq_info

from .helpers import INTERPRET, make_inputs, misaligned, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk import gluon_grad  # noqa: E402

D, C = 128, 64


class LaunchRecorder:
    """Stands in for gluon_grad_kernel: kernel[grid](*args, **kwargs) records the launch instead."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def stage_inputs(lengths, H, dtype=torch.bfloat16):
    """The wrapper's inputs by name (values irrelevant: nothing runs) for packed sequences of these lengths."""
    TT = sum(lengths)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, TT, torch.device("cpu"), cu, cu)
    NT = info.chunks(C).num_chunks
    x = make_inputs(1, TT, H, D, D, dtype, seed=0)
    return dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], tinv=torch.zeros(1, TT, H, C),
                h=torch.zeros(NT, H, D, D, dtype=dtype), dh=torch.zeros(NT, H, D, D, dtype=dtype),
                dv_prime=torch.zeros_like(x["v"]), do=torch.zeros_like(x["v"])), info


def call(x, info, **changes):
    args = {**x, **changes}
    return gluon_grad.gluon_grad(*(args[n] for n in gluon_grad.INPUTS), 0.1, info, args.get("chunk_size", C))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[200, 200], [0, 1, 63, 64, 65, 130, 7], [1]])
def test_launches_a_program_per_chunk_and_head(monkeypatch, dtype, lengths):
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_grad, "gluon_grad_kernel", kernel)
    H = 3
    x, info = stage_inputs(lengths, H, dtype)
    dq, dk, dv, dbeta = call(x, info)
    (grid, args, kwargs), = kernel.launches
    chunks = info.chunks(C)
    assert grid == (chunks.num_chunks, H)
    # q, k, v, dO, dV' [C, 128] tiles; h, dh [128, 128]; T~ fp32 [C, C]
    assert [d.block_shape for d in args[:8]] == [[C, D]] * 5 + [[D, D]] * 2 + [[C, C]]
    TT, NT = info.total_tokens, chunks.num_chunks
    assert [tuple(d.shape) for d in args[:8]] == [(TT, H * D)] * 5 + [(NT * H * D, D)] * 2 + [(TT, H * C)]
    assert args[8] is x["beta"] and args[9:13] == (dq, dk, dv, dbeta)
    assert args[13] is chunks.chunk_indices and args[14] is info.cu_seqlens
    assert args[16:] == (H, gluon_grad.LOADER_REGS, gluon_grad.DQDK_WARPS, gluon_grad.DQDK_REGS)
    assert kwargs == {"num_warps": 4}
    assert (dq.dtype, dk.dtype, dv.dtype, dbeta.dtype) == (dtype, dtype, dtype, torch.float32)
    assert dq.shape == x["q"].shape and dv.shape == x["v"].shape and dbeta.shape == x["beta"].shape


@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_tokens_launches_nothing(monkeypatch, lengths):
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_grad, "gluon_grad_kernel", kernel)
    x, info = stage_inputs(lengths, 2)
    dq, dk, dv, dbeta = call(x, info)
    assert not kernel.launches and dq.numel() == dk.numel() == dv.numel() == dbeta.numel() == 0


def test_refuses_misuse():
    x, info = stage_inputs([100, 28], 2)
    cases = [
        ("share one 16-bit dtype", dict(v=x["v"].half())),
        ("share one 16-bit dtype", {n: x[n].float() for n in ("q", "k", "v", "dv_prime", "do")}),
        ("K = V = 128", dict(v=x["v"][..., :64])),
        ("tokens", dict(q=x["q"][:, :64])),
        ("contiguous", dict(do=x["do"].transpose(1, 2).contiguous().transpose(1, 2))),
        ("16-byte aligned", dict(k=misaligned(x["k"]))),
        ("h must be", dict(h=x["h"][:1])),
        ("dh must be", dict(dh=x["dh"].half())),
        ("tinv", dict(tinv=x["tinv"].to(torch.bfloat16))),
        ("tinv", dict(tinv=torch.zeros(1, 128, 2, 32))),
        ("beta", dict(beta=x["beta"][:, :64])),
        ("chunk_size", dict(chunk_size=32)),
    ]
    for match, changes in cases:
        with pytest.raises(ValueError, match=match):
            call(x, info, **changes)


@pytest.mark.parametrize("N, T, expected", [(1, 32768, True), (2, 8192, True), (3, 8192, True), (1, 8191, False),
                                         (8, 2048, False), (4, 4096, False), (2, 8190, False), (1, 0, False)])
def test_backward_takes_the_kernel_on_long_sequences_only(N, T, expected):
    # by default (GLUON_GRAD None) where the H200 measured the whole call faster with it: 8,192 tokens or more a
    # sequence on average; never on CPU tensors (not sm_90, and the interpreter runs no Gluon)
    import importlib

    backward = importlib.import_module("deltatron.kernels.chunk.backward")
    assert backward.GLUON_GRAD is None
    assert backward.gluon_grad_pays(seq_info(N, T, torch.device("cpu"), None, None)) == expected
    x, _ = stage_inputs([100], 2)
    assert not backward.gluon_grad_applies(x["q"], x["k"], x["v"], x["do"], C)


@pytest.mark.skipif(not INTERPRET, reason="the backward's Triton stages on CPU tensors need the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_hands_the_wrapper_what_it_checks(monkeypatch, dtype):
    # the backward's own h, dh, dV', T~, beta through the wrapper's checks and descriptors (the model test
    # replaces the wrapper whole): a refusal here would otherwise first show on the GPU
    import importlib

    from deltatron.kernels import chunk

    from .test_gluon_grad_model import kernel_model

    backward = importlib.import_module("deltatron.kernels.chunk.backward")
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_grad, "gluon_grad_kernel", kernel)

    def wrapper_then_model(*args):
        gluon_grad.gluon_grad(*args)
        return kernel_model(*args)

    monkeypatch.setattr(backward, "GLUON_GRAD", True)
    monkeypatch.setattr(backward, "gluon_grad_applies", lambda *a: True)
    monkeypatch.setattr(backward, "gluon_grad_kernel", lambda: wrapper_then_model)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, sum(lengths), torch.device("cpu"), cu, cu)
    x = make_inputs(1, sum(lengths), 2, D, D, dtype, initial_state=True, N=len(lengths), seed=1)
    q, k, v, beta, h0 = (x[n] for n in ("q", "k", "v", "beta", "initial_state"))
    _, _, saved, _ = chunk.forward(q, k, v, beta, D ** -0.5, h0, True, info)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = chunk.backward(q, k, v, beta, D ** -0.5, h0, saved, do, None, info, C)
    (grid, _, _), = kernel.launches
    assert grid == (info.chunks(C).num_chunks, 2) and all(torch.isfinite(g).all() for g in grads[:4])
