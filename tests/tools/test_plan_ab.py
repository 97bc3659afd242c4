"""tools/plan_ab.py (two plans of a chunk op against each other, for the GPU): its override parser, and its
smoke mode in Triton's interpreter, where two plans that compute the same results agree and the table prints."""
import sys

import pytest

from . import TOOLS, run_tool


def run(*args):
    return run_tool("plan_ab", *args)


def test_parse_overrides():
    sys.path.insert(0, str(TOOLS))
    try:
        import plan_ab
    finally:
        sys.path.remove(str(TOOLS))
    assert plan_ab.parse_overrides("") == {}
    assert plan_ab.parse_overrides("hopper_walk=0, split_partitions=3,keep_states=true,segments=none") == dict(
        hopper_walk=False, split_partitions=3, keep_states=True, segments=None)
    for bad in ("hopper_walk", "no_such=1", "residual=2", "segments=x"):
        with pytest.raises(ValueError):
            plan_ab.parse_overrides(bad)


def test_unknown_configuration_and_override_are_refused():
    assert run("--smoke", "--configs", "no-such-config").returncode == 2
    assert run("--smoke", "--a", "no_such=1").returncode == 2


def test_smoke_same_plan_twice_is_bitwise_equal():
    """Both sides the shipped plan: the results are bitwise equal and both phases are timed, on a dense and a
    packed batch."""
    proc = run("--smoke", "--readings", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK (bitwise)") == 2 and "DIFFER" not in proc.stdout
    assert proc.stdout.count("forward+backward ") == 2 and "B / A" in proc.stdout


def test_smoke_plain_walk_against_fused_output():
    """The portable walk with and without the output fused in: each side's plan explained, the results within
    the given bound (the interpreter computes the same bits)."""
    proc = run("--smoke", "--a", "fused_output=0", "--b", "fused_output=1", "--bound", "1e-2", "--explain",
               "--configs", "b2-t40-h1-k16", "--readings", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plan A:" in proc.stdout and "plan B:" in proc.stdout and "OK (" in proc.stdout


def test_smoke_gated_register_caps():
    """--gated: chunk_gated_delta_rule on a grouped configuration under two register caps of the WY kernel, the
    gate's gradient among the results compared (the interpreter ignores the cap: bitwise equal)."""
    proc = run("--smoke", "--gated", "--a", "wy_maxnreg=168", "--b", "wy_maxnreg=0", "--configs",
               "b2-t40-hk1-hv2-k16", "--readings", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dg bitwise" in proc.stdout and "OK (bitwise)" in proc.stdout


def test_smoke_kda_local_dv_in_the_pass():
    """--kda: chunk_kda with its local dV' computed in the reverse pass against the rule's (apart, grads.dv_local):
    dg among the results, within the given bound (the pass keeps it in fp32, dv_local rounds it by its store)."""
    proc = run("--smoke", "--kda", "--a", "local_dv_apart=0,fused_output=1", "--b", "", "--bound", "1e-2",
               "--explain", "--configs", "b2-t40-h1-k16", "--readings", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dg " in proc.stdout and "OK (within" in proc.stdout
    assert "local_dv     in the pass" in proc.stdout and "local_dv     apart" in proc.stdout


def test_grouped_configuration_needs_gated():
    assert run("--smoke", "--configs", "b2-t40-hk1-hv2-k16").returncode == 2
