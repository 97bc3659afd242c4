"""The warp-specialized Gluon walk (kernels/chunk/gluon_walk.py) against the Triton fused walk
(state.state_output_fwd, on S^T at K = V = 128 bf16): agreement and times on the GPU, or what triton 3.6
makes of it offline.

On the GPU, per config (transposed_walk.py's inputs: W, U from wy.wy_fwd as the forward makes them, a random
fp32 initial state), for each V-block width of the Gluon walk (block_v 128: a program a sequence and head;
64: two): o and the final state against the Triton walk's (relative RMS: o within one bf16 rounding, < 1e-2;
the state fp32 summation order apart), then the walks timed as the forward runs them (no final state) and the
walk without its output (the final states only: the chain alone), then the whole forward with each. The Gluon
walk runs twice: no atomics, so the second run must give the same bits.

--offline compiles the kernel for sm_90 (per V-block width: bf16 with and without the states, fp16 with them,
bf16 with them saving its per-chunk states for the backward (chunk_delta_rule's save_states), the walk without its
output, gluon_state_final_fwd, bf16 with and without the initial state, and the residual form, V' = Tb (V - K S),
bf16 and fp16 with the states, and without its output, bf16 from an initial state) on a machine
without a GPU (put triton 3.6 first on PYTHONPATH) and prints ptxas's registers and spills, shared memory, the
setmaxnreg of each partition, the warp-specialize partitions of the TTGIR with their products and waits, and
the PTX barriers.

    python benchmarks/diagnostics/gluon_walk.py [--configs b8-t2048-h16-k128 b1-t32768-h16-k128]
    python benchmarks/diagnostics/gluon_walk.py --offline [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import sys
from typing import Optional

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels import chunk  # noqa: E402
from deltatron.kernels.chunk import state  # noqa: E402
from deltatron.kernels.utils import num_sms  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stage_configs import worst_difference as rel_rms  # noqa: E402
from transposed_walk import walk_inputs  # noqa: E402


def compare(cfg: bench.Config, measure) -> None:
    from deltatron.kernels.chunk import gluon_walk

    state.GLUON_WALK = False  # state_output_fwd as the Triton walk, the reference
    q, k, w, u, scale, h0, info = walk_inputs(cfg, torch.device("cuda"))
    o_ref, s_ref = state.state_output_fwd(q, k, w, u, scale, h0, True, info, 64)
    widths = sorted(gluon_walk.WALK_CONFIGS, reverse=True)
    print(f"\n{cfg.name}: split_v chooses block_v {gluon_walk.split_v(info.num_seqs * cfg.H, num_sms(q.device))}")
    results = {}
    for block_v in widths:
        o, s = gluon_walk.gluon_state_output_fwd(q, k, w, u, scale, h0, True, info, block_v=block_v)
        o2, s2 = gluon_walk.gluon_state_output_fwd(q, k, w, u, scale, h0, True, info, block_v=block_v)
        same = torch.equal(o2, o) and torch.equal(s2, s)  # no atomics: a race between partitions shows as a change
        err_o, err_s = rel_rms(o, o_ref), rel_rms(s, s_ref)
        ok = err_o < 1e-2 and err_s < 1e-3 and torch.isfinite(o).all() and torch.isfinite(s).all() and same
        print(f"  gluon walk block_v {block_v} against the Triton walk: o rel RMS {err_o:.1e}, final state "
              f"{err_s:.1e}, state bitwise {torch.equal(s, s_ref)}, rerun bitwise {same}  {'OK' if ok else 'WRONG'}")
        results[block_v] = (o, s)
    (o_a, s_a), (o_b, s_b) = results[widths[0]], results[widths[-1]]
    print(f"  block_v {widths[-1]} against {widths[0]}: o bitwise {torch.equal(o_a, o_b)}, final state bitwise "
          f"{torch.equal(s_a, s_b)}")
    runs = {"Triton walk (state_output_fwd)": lambda: state.state_output_fwd(q, k, w, u, scale, None, False, info, 64)}
    for block_v in widths:
        runs[f"gluon walk, block_v {block_v}"] = functools.partial(
            gluon_walk.gluon_state_output_fwd, q, k, w, u, scale, None, False, info, block_v=block_v)
    # the chain alone (the sequence split's pass 1): how much of the walk's time its output partition sets
    for block_v in widths:
        runs[f"gluon walk without output, block_v {block_v}"] = functools.partial(
            gluon_walk.gluon_state_final_fwd, k, w, u, None, info, block_v=block_v)
    for name, fn in runs.items():
        print(f"  {name:<32} {measure(fn):8.3f} ms", flush=True)
    # the whole forward (no backward: Tinv not stored), each walk twice, interleaved against drift: without the
    # Gluon walk (the forward's own choice of Triton stages: the fused walk or state + output apart), and with
    # it at each V-block width (split_v pinned)
    x = bench.make_inputs(cfg, torch.device("cuda"), seed=0)
    q, k, v, beta = (x[n].detach().reshape(1, cfg.B * cfg.T, *x[n].shape[2:]) for n in ("q", "k", "v", "beta"))
    split_v = gluon_walk.split_v
    try:
        for block_v in [None, *widths] * 2:
            state.GLUON_WALK = block_v is not None
            gluon_walk.split_v = lambda num_seq_heads, sms, block_v=block_v: block_v
            ms = measure(lambda: chunk.forward(q, k, v, beta, scale, None, False, info, needs_backward=False))
            name = "Triton stages" if block_v is None else f"Gluon walk, block_v {block_v}"
            print(f"  forward, {name:<23} {ms:8.3f} ms", flush=True)
    finally:
        state.GLUON_WALK, gluon_walk.split_v = False, split_v


@contextlib.contextmanager
def compiling_for_sm90():
    """Within it, Gluon kernel launches compile for the H200's sm_90 instead of running (offline_compile's
    backend; nothing needs a GPU); yields the list the compiled kernels are appended to, in launch order."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import offline_compile as oc  # it refuses the interpreter: imported only here

    backend = oc.make_backend(oc.H200)
    compiled = []

    def compile_instead(fn, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        compiled.append(oc.triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=oc.H200,
                                          options=options.__dict__))

    run = JITFunction.run
    JITFunction.run = compile_instead
    try:
        yield compiled
    finally:
        JITFunction.run = run


def report_compiled(title: str, kernel, dump: Optional[str], stem: str) -> None:
    """Prints a compiled Gluon kernel's warps, registers, spills and shared memory, its setmaxnreg sequence,
    PTX counts and per-partition TTGIR summary; with dump, writes its TTGIR and PTX there as stem.ttgir/.ptx."""
    import offline_compile as oc

    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    usage = oc.ptxas_usage(ptx)
    print(f"\n{title}: {kernel.metadata.num_warps} warps in all; ptxas {usage['regs']} registers (the launch's, "
          f"before setmaxnreg), {usage['spills']} B of spills; shared {kernel.metadata.shared} B (sm_90 limit "
          f"{oc.SHARED_LIMIT})")
    setmaxnreg = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
    print("  setmaxnreg in the PTX, in order:", " ".join(f"{op} {n}" for op, n in setmaxnreg))
    print("  PTX: wgmma.mma_async", len(re.findall(r"wgmma\.mma_async", ptx)), " wgmma.wait_group",
          collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)),
          " mbarrier.try_wait", len(re.findall(r"mbarrier\.try_wait", ptx)),
          " bar.sync/barrier.sync",
          collections.Counter(re.findall(r"(?:bar|barrier)\.sync(?:\.aligned)?\s+([^;]+);", ptx)),
          " cp.async.bulk.tensor", len(re.findall(r"cp\.async\.bulk\.tensor", ptx)))
    partition_summary(ttgir)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{stem}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])


def offline(dump) -> int:
    """Compiles the kernel for sm_90 (nothing runs) at the benchmark's 8 x 16 heads, per V-block width: bf16
    with and without the initial and final states, fp16 with them; and the walk without its output
    (gluon_state_final_fwd: the final states only), bf16 with and without the initial state."""
    import triton

    import offline_compile as oc  # it refuses the interpreter: imported only here
    from deltatron.kernels.chunk import gluon_walk, state
    from deltatron.kernels.utils import seq_info

    B, T, H, D = 8, 256, 16, gluon_walk.D_WALK
    info = seq_info(B, T, torch.device("cpu"), None, None)
    # per V-block width: bf16 with and without the states; fp16 (the GPU test runs it too) with them; the final
    # states only, from zero and from an initial state
    variants = [(name, dtype, states, block_v) for block_v in sorted(gluon_walk.WALK_CONFIGS, reverse=True)
                for name, dtype, states in [("bf16", torch.bfloat16, False), ("bf16", torch.bfloat16, True),
                                            ("fp16", torch.float16, True), ("bf16_saves_states", torch.bfloat16, True),
                                            ("bf16_final_only", torch.bfloat16, False),
                                            ("bf16_final_only", torch.bfloat16, True),
                                            ("bf16_residual", torch.bfloat16, True),
                                            ("fp16_residual", torch.float16, True),
                                            ("bf16_final_only_residual", torch.bfloat16, True)]]
    with compiling_for_sm90() as compiled:
        for name, dtype, states, block_v in variants:
            x = oc.inputs(B, T, H, D, D, dtype)
            q, k = (x[n].reshape(1, B * T, H, D) for n in ("q", "k"))
            h0 = x["h0"] if states else None
            residual = name.endswith("residual")
            if "final_only" in name:
                gluon_walk.gluon_state_final_fwd(k, k, q, h0, info, block_v=block_v, residual=residual)
            else:
                saved = state.states_buffers(k, q, info, gluon_walk.C_WALK) if name.endswith("saves_states") else None
                # (w and u stand-ins of the right shape: k for W or the Tb pair [.., H, 2 x 64], q for U or V)
                gluon_walk.gluon_state_output_fwd(q, k, k, q, D ** -0.5, h0, states, info, block_v=block_v,
                                                  states=saved, residual=residual)
    assert len(compiled) == len(variants), f"{len(compiled)} kernels compiled for {len(variants)} launches"
    for (name, _, states, block_v), kernel in zip(variants, compiled):
        cfg = gluon_walk.WALK_CONFIGS[block_v]
        final_only = "final_only" in name
        report_compiled(f"gluon_walk_kernel {name} K=V={D} C={gluon_walk.C_WALK} BV={block_v} ({cfg}: "
                        f"{cfg.final_only_stages if final_only else cfg.stages} slots), "
                        + (f"initial state {states}, final state True" if final_only
                           else f"initial/final state {states}"), kernel, dump,
                        f"gluon_walk_bv{block_v}_{name}_states{int(states)}")
    print(f"triton {triton.__version__}, target sm_90")
    return 0


def partition_summary(ttgir: str) -> None:
    """Per region of the ttg.warp_specialize op (default, then each partition): its warps and requested
    registers, products (warp_group_dot), their waits and mbarrier operations."""
    head = re.search(r"ttg\.warp_specialize\(.*?\)(.*?)\n", ttgir)
    regs = re.search(r"requestedRegisters = array<i32: ([\d, ]+)>", ttgir)
    print("  TTGIR warp_specialize:", head.group(1).strip() if head else "none",
          "| requested registers", regs.group(1) if regs else "?")
    start = ttgir.find("ttg.warp_specialize")
    regions = re.split(r"\n\s*(partition\d+\([^\n]*|default \{)", ttgir[start:])
    names = ["(before)"] + regions[1::2]
    for name, body in zip(names, regions[0::2]):
        if name == "(before)":
            continue
        count = lambda p: len(re.findall(p, body))  # noqa: E731
        print(f"    {name.split('(')[0].strip():<12} warp_group_dot {count(r'ttng.warp_group_dot ')}, waits "
              f"{count(r'ttng.warp_group_dot_wait')}, mbarrier wait {count(r'ttng.wait_barrier')} / arrive "
              f"{count(r'ttng.arrive_barrier')}, TMA loads {count(r'ttng.async_tma_copy_global_to_local')}, "
              f"gpu.barrier {count(r'gpu.barrier')}")


def probe_main(doc: str, default_configs, compare, offline) -> int:
    """main() of this probe and gluon_reverse.py: compare(config, measure) at each of --configs (bench.CONFIGS
    names), or with --offline offline(dump) (the sm_90 compile, --dump: where the TTGIR and PTX go)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=default_configs)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 instead of running")
    parser.add_argument("--dump", help="--offline: write the TTGIR and PTX into this folder")
    args = parser.parse_args()
    if args.offline:
        return offline(args.dump)
    import triton

    known = {c.name: c for c in bench.CONFIGS}
    for name in args.configs:
        compare(known[name], lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100))
    return 0


def main() -> int:
    return probe_main(__doc__, ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b1-t32768-h16-k128"], compare, offline)


if __name__ == "__main__":
    sys.exit(main())
