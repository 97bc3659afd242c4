"""tools/host_time.py (host time against GPU time per stage, for the GPU) runs its smoke mode:
every stage of stage_times' breakdown and the three API calls timed on the host and by the GPU timer, the sums
over the stages the calls run, the backward alone (through autograd, and the form's without it), autograd through a
bare Function, the forward+backward split by layer, the Gluon rows skipped with their reason, cProfile's top
functions per call and the short table last, all in the JSON."""
import json

from benchmarks import configs

from . import run_tool

API_CALLS = {"whole forward (API, no_grad)", "whole forward (API, autograd node)", "whole forward+backward (API)"}
SUMS = {"sum of forward stages", "sum of all stages"}
BACKWARD = {"backward alone (autograd.grad on a kept graph)", "backward alone (chunk.backward, no autograd)",
            "whole forward+backward (API) [autograd on the calling thread]",
            "backward alone (autograd.grad on a kept graph) [autograd on the calling thread]"}
BARE = "autograd.grad through a bare Function (cpu tensors)"  # host only (smoke: CPU tensors, no CUDA rows)


def test_host_time_smoke(tmp_path):
    out = tmp_path / "host.json"
    proc = run_tool("host_time", "--smoke", "--profile", "--out", out, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["meta"]["mode"] == "smoke"
    chunk_configs = [c.name for c in configs.SMOKE_CONFIGS if not c.decode and c.Hk == c.H]  # the delta rule's
    assert set(results) == {"meta", *chunk_configs}
    for name in chunk_configs:
        report = results[name]
        rows = report["rows"]
        assert API_CALLS | SUMS | BACKWARD | {BARE} <= set(rows)
        # stage_times' stages: wy_fwd, the fused walk, the plain pair, 3 recompute launches, 3 more backward,
        # 2 unfused (stage_configs' count)
        assert len(set(rows) - API_CALLS - SUMS - BACKWARD - {BARE}) == 12
        assert set(rows.pop(BARE)) == {"host_ms"}
        for row in rows.values():
            assert row["host_ms"] > 0 and row["gpu_ms"] > 0 and "gpu_queued_ms" not in row
            assert "host_queued_ms" not in row
        # the forward+backward split by layer: the whole call, the API forward and DeltaRuleFunction's backward
        # in it, the chunk form's forward and backward and their stages; the layers inside a layer add up to no
        # more than it
        for split in (report["split"], report["split_calling_thread"]):
            assert {"whole forward+backward (autograd.grad)", "API forward (checks, Function.apply)",
                    "DeltaRuleFunction.forward", "chunk.forward", "fwd stage: wy_fwd", "DeltaRuleFunction.backward",
                    "chunk.backward", "bwd stage: state_bwd", "bwd stage: dqkw", "bwd stage: wy_bwd"} <= set(split)
            assert all(t["total_us"] > 0 and t["own_us"] >= 0 for t in split.values())
        assert rows["sum of all stages"]["host_ms"] > rows["sum of forward stages"]["host_ms"]
        assert set(report["gluon_skipped"]) == {"hopper_walk", "hopper_reverse"}
        assert all("interpreter" in reason for reason in report["gluon_skipped"].values())
        assert not any("[hopper_" in row for row in rows)
        assert len(report["profile"]) == 25 and all(e["tottime_us"] >= 0 for e in report["profile"])
    assert "hopper_reverse rows skipped: Gluon does not run in Triton's interpreter" in proc.stdout
    table = proc.stdout.split("Host time against GPU time")[-1]
    assert all(name in table for name in chunk_configs) and "whole forward+backward (API)" in table
