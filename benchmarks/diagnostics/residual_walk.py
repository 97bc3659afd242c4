"""The forward's residual form (state.RESIDUAL_WALK: wy.tinv_pair_fwd makes Tb = T~ diag(beta) as its 16-bit pair
instead of W and U, and the Gluon walk forms V' = Tb (V - K S) itself) against the W, U form, on the H200; where the
sequence split runs, the split's residual form (seq_split.RESIDUAL_SPLIT) against its W, U form.

Per config (the benchmark's bf16 inputs and dO): whether the residual form runs there (state.residual_walk_runs, or
seq_split.residual_runs where the split runs); o and the final state (split: o of the whole forward and pass 1's
partition states) of True against False (rel RMS, within BOUND: the same V' rounded at other points); the gradients
through the API with True against False (bitwise: the backward reads only T~, the same bits both ways); then READINGS
interleaved rounds of
    wy stage   wy_fwd (T~, W, U) against tinv_pair_fwd (T~, Tb), both storing T~ as the training forward does;
    walk       the Gluon walk on W, U against the residual walk on Tb, V (no final state, as the forward runs it);
               split: pass 1 and the combine (seq_split.partition_states) on W, U against Tb, V;
    forward    the API's inference forward (no autograd), the training forward (autograd recording) and the
               forward+backward.

    python benchmarks/diagnostics/residual_walk.py [--configs b8-t2048-h16-k128 ...]
"""
from __future__ import annotations

import os
import sys

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

# switch_probe: same folder (sys.path[0] when run as a script)
from switch_probe import (SETTINGS, api_fwd_bwd, gpu_probe_main, gradients_agree, interleaved, rel,  # noqa: E402
                          with_settings)

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import seq_split, state, wy  # noqa: E402

CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128", "varlen20-t32768-h16-k128"]
BOUND = 1e-2  # bf16's, DESIGN.md §6
C = 64


def compare(cfg: bench.Config, device: torch.device, measure) -> bool:
    """Prints where the residual form runs, the comparisons and the readings; whether o and the final state agree
    within BOUND and the gradients bitwise."""
    from deltatron.kernels.chunk import gluon_walk

    x, fwd_bwd, info = api_fwd_bwd(cfg, device)
    q, k, v, beta = (x[n].detach().reshape(1, -1, *x[n].shape[2:]) for n in ("q", "k", "v", "beta"))
    plan = seq_split.plan_for(k, v, info, C)
    # unsplit: state.RESIDUAL_WALK switched; split: seq_split.RESIDUAL_SPLIT (RESIDUAL_WALK on)
    module, name = (state, "RESIDUAL_WALK") if plan is None else (seq_split, "RESIDUAL_SPLIT")

    def switch(on, fn):
        return with_settings(module, {name: on}, fn)

    if plan is None:
        runs = switch(True, lambda: state.residual_walk_runs(q, k, v, info, C))
    else:
        runs = switch(True, lambda: seq_split.residual_runs(q, k, v, plan, C))
    print(f"\n{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads, {'no split' if plan is None else 'split'}; "
          f"{name} " + ("runs the residual form" if runs else "changes nothing here (the same launches both ways)"))
    call = bench.resolve("deltatron.chunk", smoke=False)

    h0 = torch.randn(info.num_seqs, cfg.H, cfg.K, cfg.K, device=device)
    scale = cfg.K ** -0.5
    _, w, u = wy.wy_fwd(k, v, beta, info, C, store_tinv=False)
    _, tb = wy.tinv_pair_fwd(k, beta, info, C, store_tinv=False)

    def walk(final=False):
        on = getattr(module, name)
        if plan is not None:  # the split's pass 1 and combine: the states entering the partitions
            return seq_split.partition_states(q, k, tb if on else w, v if on else u, h0, plan, C, on), None
        if on:
            return gluon_walk.gluon_state_output_fwd(q, k, tb, v, scale, h0, final, info, residual=True)
        return gluon_walk.gluon_state_output_fwd(q, k, w, u, scale, h0, final, info)

    def inference():
        with torch.no_grad():
            return call(x)

    if plan is None:
        (o_wu, s_wu), (o_res, s_res) = (switch(s, lambda: walk(True)) for s in SETTINGS)
        label = "walk"
    else:  # the whole forward's o, and pass 1's partition states
        o_wu, o_res = (switch(s, inference) for s in SETTINGS)
        s_wu, s_res = (switch(s, walk)[0] for s in SETTINGS)
        label = "forward (o) and pass 1 (partition states)"
    err_o, err_s = rel(o_res, o_wu), rel(s_res, s_wu)
    walks_agree = err_o < BOUND and err_s < BOUND and bool(torch.isfinite(o_res).all())
    print(f"  {label}, residual against W, U form: o {err_o:.2e}, states {err_s:.2e}"
          + ("  OK" if walks_agree else "  DIFFER"))
    grads_agree = gradients_agree({s: switch(s, fwd_bwd) for s in SETTINGS})

    def wy_stage():
        if getattr(module, name):
            return wy.tinv_pair_fwd(k, beta, info, C)
        return wy.wy_fwd(k, v, beta, info, C)

    interleaved(measure, switch, {"wy stage": wy_stage, "walk" if plan is None else "pass 1 + combine": walk}, name)
    interleaved(measure, switch, {"forward": inference, "training forward": lambda: call(x),
                                  "forward+backward": fwd_bwd}, name)
    return walks_agree and grads_agree


if __name__ == "__main__":
    sys.exit(gpu_probe_main(__doc__, CONFIGS, compare))
