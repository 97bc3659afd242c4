"""Every Triton launch of the four forms (forward and backward, bf16) compiles for the H200 (sm_90) within
its shared memory at the largest head size, and so does the fp32 kernel that once did not; checked on this
machine without a GPU (tools/offline_compile.py with the installed triton: the compile
errors and shared-memory overflows that otherwise first show on the GPU)."""
import os
import re

from . import run_tool


def compile_rows(*args):
    """The script's rows (one per compiled launch) for these arguments; fails on any failed compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, not the interpreter
    proc = run_tool("offline_compile", *args, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if " regs " in line]
    assert all(" regs  -1" not in line for line in rows), proc.stdout
    return rows


def test_all_forms_compile_for_sm90():
    # K = V = 256: the largest tiles, so the most shared memory (a compile error would show at any size).
    # chunk: 8 launches (the state pass twice: at K = 256 the forward runs the plain walk; the reverse state
    # pass with the local dV' fused in); fused_chunk 4 (chunk's WY kernel for Tinv, the walk twice, the
    # reverse walk); fused_recurrent 2; parallel 5
    assert len(compile_rows("--heads", "256")) == 19


def test_fused_walk_compiles_for_sm90():
    # K = 128 with 8 x 16 heads, where the forward runs the fused state+output walk (a 128-wide V-block on
    # 8 warps); the backward's walk beside it (computing W, U on chip: plan.wy_on_chip)
    rows = compile_rows("--heads", "128", "--forms", "chunk", "--kernels", "state_fwd_kernel")
    assert len(rows) == 2 and any("BV=128  w8" in row for row in rows)


def test_fp32_chunk_at_head_size_256_fits_shared_memory():
    # fp32 tiles are twice the size: the reverse state pass at K = 256 needs its narrower V-block (it used
    # 237,568 bytes of shared memory at BV = 32, over sm_90's 232,448, with 16 sequences x heads or more;
    # the fused local dV' adds none) (fp32 kernels take minutes to compile on two cores: this one only)
    rows = compile_rows("--dtype", "fp32", "--heads", "256", "--forms", "chunk", "--kernels", "state_bwd_kernel")
    assert len(rows) == 1 and "state_bwd_kernel" in rows[0] and "BV=16" in rows[0]


def test_launch_choices_at_head_size_128():
    # bf16, K = V = 128, offline_compile faking the H200's 132 SMs. 8 x 16 heads: the reverse state pass
    # takes 128-wide V-blocks (128 programs, one wave); 20 x 16: 64-wide (320 programs at 128 would be
    # several waves, where the wider programs measured slower). The fused WY forward is capped at 168
    # registers a thread; the backward has no WY launch of its own (its walk computes W, U on chip:
    # plan.wy_on_chip), except with few heads, where its walk's V-blocks are narrow and the unfused
    # recompute of W, U (uncapped) runs
    one_wave = compile_rows("--heads", "128", "--forms", "chunk", "--kernels", "state_bwd_kernel", "wy_kernel")
    waves = compile_rows("--heads", "128", "--forms", "chunk", "--kernels", "state_bwd_kernel",
                         "--batch-heads", "20", "16")
    assert [("BV=128  w8" in r) for r in one_wave if "state_bwd_kernel" in r] == [True]
    assert [("BV=64   w8" in r) for r in waves] == [True]
    assert [int(re.search(r"regs +(\d+)", r).group(1)) == 168 for r in one_wave if "wy_kernel" in r] == [True]
    few_heads = compile_rows("--heads", "128", "--forms", "chunk", "--kernels", "wy_kernel", "--batch-heads", "1", "16")
    assert sorted(int(re.search(r"regs +(\d+)", r).group(1)) == 168 for r in few_heads) == [False, True]


def test_sass_lines_attribute_instructions_to_source():
    # --sass-lines: the WY forward's SASS counted by source line (nvdisasm's line table); its inverse and its
    # products are among the lines, and the listed counts add up to at most the total
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_tool("offline_compile", "--heads", "64", "--forms", "chunk", "--kernels", "wy_kernel", "--sass-lines",
                    "6", env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = int(re.search(r"(\d+) SASS instructions", proc.stdout).group(1))
    listed = re.findall(r"^ +(\d+)  (\w+\.py):(\d+)", proc.stdout, re.M)
    assert len(listed) == 6 and sum(int(n) for n, _, _ in listed) <= total
    assert {"solve_tril.py", "utils.py"} <= {name for _, name, _ in listed}


def test_kda_backward_compiles_for_sm90():
    # --kda: KDA's per-channel gate in the chunk form; its backward's per-channel stages (the gradient stage with its
    # sub-chunk products, capped at 32-wide K-tiles, and the gate's dg per channel) compile at K = V = 64
    rows = compile_rows("--kda", "--heads", "64", "--forms", "chunk", "--kernels", "dqkw_kernel",
                        "channel_gate_grad_kernel")
    assert len(rows) == 2 and "dqkw_kernel" in rows[0] and "BK=32" in rows[0]
    assert "channel_gate_grad_kernel" in rows[1]


def test_kda_is_not_taken_with_the_per_head_gate():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_tool("offline_compile", "--kda", "--gated", env=env, timeout=300)
    assert proc.returncode == 2 and "--kda: the per-channel gate runs on the portable stages" in proc.stderr
