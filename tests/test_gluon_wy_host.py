"""The Gluon WY forward's dispatch and host wrapper (kernels/chunk/gluon_wy.py) where nothing runs on a GPU: wy.wy_fwd
runs it only with wy.GLUON_WY True and where gluon_wy_applies (never on the CPU), the wrapper refuses what the
kernel does not take, launches nothing without chunks, and launches the grid and descriptors it should (the kernel
replaced by a recorder). With DELTATRON_TRITON36 naming a folder that holds triton 3.6 (the GPU's; the installed
triton's Gluon API differs), the kernel also compiles for sm_90 offline. The kernel itself is checked on the GPU
(tests/gpu/test_gluon_wy_gpu.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltatron.kernels.chunk import wy
from deltatron.kernels.utils import seq_info

from .helpers import make_inputs, misaligned, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk import gluon_wy  # noqa: E402

from .test_gluon_reverse_host import LaunchRecorder  # noqa: E402

C = gluon_wy.C_WY


def wy_inputs(B=2, T=70, H=3, D=128, dtype=torch.bfloat16):
    x = make_inputs(B, T, H, D, D, dtype, seed=0)
    return x["k"], x["v"], x["beta"], seq_info(B, T, torch.device("cpu"), None, None)


def test_switch_is_off_by_default():
    assert wy.GLUON_WY is False


@pytest.mark.parametrize("switch", [False, None, True])
def test_wy_fwd_runs_gluon_only_when_forced_where_it_applies(monkeypatch, switch):
    # False never; None (no rule yet) as False; True where gluon_wy_applies. Here it "applies" on CPU tensors
    # (patched) and the Gluon wrapper is a recorder, so wy_kernel's path is what runs otherwise
    k, v, beta, info = wy_inputs()
    calls = []
    monkeypatch.setattr(wy, "gluon_wy_applies", lambda *a: True)
    monkeypatch.setattr(gluon_wy, "gluon_wy_fwd", lambda *a: calls.append(a) or ("tinv", "w", "u"))
    monkeypatch.setattr(wy, "_wy", lambda *a: calls.append("wy_kernel") or ("w0", "u0"))
    out = wy.wy_fwd(k, v, beta, info, C, store_tinv=False)
    monkeypatch.setattr(wy, "GLUON_WY", switch)
    out_switched = wy.wy_fwd(k, v, beta, info, C, store_tinv=False)
    assert out == (None, "w0", "u0")
    if switch is True:
        assert out_switched == ("tinv", "w", "u") and calls == ["wy_kernel", (k, v, beta, info, C, False)]
    else:
        assert out_switched == out and calls == ["wy_kernel", "wy_kernel"]


def test_does_not_apply_on_the_cpu(monkeypatch):
    # CPU tensors (and the interpreter) never run Gluon, whatever the switch says: wy_kernel's result
    k, v, beta, info = wy_inputs(T=64, H=1)
    monkeypatch.setattr(wy, "GLUON_WY", True)
    assert not wy.gluon_wy_applies(k, v, beta, C)
    tinv, w, u = wy.wy_fwd(k, v, beta, info, C)
    monkeypatch.setattr(wy, "GLUON_WY", False)
    tinv0, w0, u0 = wy.wy_fwd(k, v, beta, info, C)
    assert torch.equal(tinv, tinv0) and torch.equal(w, w0) and torch.equal(u, u0)


def test_refuses_misuse():
    k, v, beta, info = wy_inputs()
    with pytest.raises(ValueError, match="16-bit dtype"):
        gluon_wy.gluon_wy_fwd(k, v.float(), beta, info)
    with pytest.raises(ValueError, match="16-bit dtype"):
        gluon_wy.gluon_wy_fwd(k.float(), v.float(), beta, info)
    with pytest.raises(ValueError, match="K = V"):
        gluon_wy.gluon_wy_fwd(k, v[..., :64].contiguous(), beta, info)
    k256, v256, beta256, info256 = wy_inputs(D=256)
    with pytest.raises(ValueError, match="K = V"):
        gluon_wy.gluon_wy_fwd(k256, v256, beta256, info256)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_wy.gluon_wy_fwd(k, v, beta, info, chunk_size=32)
    with pytest.raises(ValueError, match="contiguous"):
        gluon_wy.gluon_wy_fwd(k.transpose(1, 2).contiguous().transpose(1, 2), v, beta, info)
    with pytest.raises(ValueError, match="tokens"):  # rows that are not the batch's B * T
        gluon_wy.gluon_wy_fwd(k[:1], v[:1], beta[:1], info)
    with pytest.raises(ValueError, match="beta"):
        gluon_wy.gluon_wy_fwd(k, v, beta[..., :1], info)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA: the descriptor's base
        gluon_wy.gluon_wy_fwd(k, misaligned(v), beta, info)


@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_chunks_launches_nothing(monkeypatch, lengths):
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_wy, "gluon_wy_kernel", kernel)
    x = make_inputs(1, 0, 2, 128, 128, torch.bfloat16, N=len(lengths), seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, 0, torch.device("cpu"), cu, cu)
    tinv, w, u = gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info)
    assert tinv.shape == (1, 0, 2, C) and w.shape == x["k"].shape and u.shape == x["v"].shape
    assert not kernel.launches


@pytest.mark.parametrize("D", gluon_wy.HEAD_SIZES)
@pytest.mark.parametrize("store_tinv", [True, False])
def test_launch(monkeypatch, D, store_tinv):
    # one program a chunk and head over info.chunks(C) (packed sequences: a short last chunk each), descriptors of
    # [C, D] tiles on the [TT, H * D] views of k and v, Tinv stored or not
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_wy, "gluon_wy_kernel", kernel)
    lengths = [70, 0, 5, 128]
    TT, H = sum(lengths), 3
    x = make_inputs(1, TT, H, D, D, torch.bfloat16, seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, TT, torch.device("cpu"), cu, cu)
    tinv, w, u = gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info, C, store_tinv)
    ((grid, args, kwargs), ) = kernel.launches
    chunks = info.chunks(C)
    assert grid == (chunks.num_chunks, H) == (2 + 1 + 2, H)
    k_desc, v_desc, beta, tinv_arg, w_arg, u_arg, cu_arg, chunk_indices, H_arg, store, blocked = args
    for desc, x_ in ((k_desc, x["k"]), (v_desc, x["v"])):
        assert desc.base.data_ptr() == x_.data_ptr() and list(desc.shape) == [TT, H * D]
        assert list(desc.strides) == [H * D, 1] and list(desc.block_shape) == [C, D]
    assert beta is x["beta"] and w_arg is w and u_arg is u and cu_arg is info.cu_seqlens
    assert torch.equal(chunk_indices, chunks.chunk_indices) and (H_arg, store) == (H, store_tinv)
    assert blocked is gluon_wy.BLOCKED_LEVELS
    assert (tinv_arg is tinv) and ((tinv.shape == (1, TT, H, C) and tinv.dtype == torch.float32) if store_tinv
                                   else tinv is None)
    assert kwargs == dict(num_warps=4, maxnreg=gluon_wy.MAX_REGISTERS)
    assert w.shape == x["k"].shape and u.shape == x["v"].shape
    gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info, C, store_tinv, blocked_levels=not blocked)
    assert kernel.launches[-1][1][-1] is (not blocked)


TRITON36 = os.environ.get("DELTATRON_TRITON36")


@pytest.mark.skipif(not TRITON36, reason="DELTATRON_TRITON36 (a folder holding triton 3.6) not set")
def test_compiles_offline_for_sm90():
    # benchmarks/diagnostics/gluon_wy.py --offline with triton 3.6 first on the path: every variant compiles within
    # sm_90's shared memory, 3 programs an SM at K = V = 128; the whole-tile levels without spills
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "gluon_wy.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([TRITON36, str(script.parents[2])])
    proc = subprocess.run([sys.executable, str(script), "--offline"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("gluon_wy_kernel")]
    assert len(rows) == 8 and all("blocks an SM" in row for row in rows), proc.stdout
    assert all(" 0 B of spills" in row for row in rows if "blocked_levels False" in row), proc.stdout
    assert all(", 3 blocks an SM" in row for row in rows if "K=V=128" in row), proc.stdout
    assert "triton 3.6" in proc.stdout
