"""deltatron/kernels/chunk/plan.py on the CPU: the plan table (every choice of the benchmark's shapes and others on sm90,
sm80 and the interpreter, training or not, save_states or not), each rule on its own, the overrides (nesting,
restoring, refusing what cannot run) and explain. The expected values are written down from the rules in plan.py
(and docs/DESIGN.md §6), not read back from make_plan."""
import pytest
import torch

from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.plan import Overrides, plan_for_shape

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
PACKED_20 = (1638, ) * 20  # 20 packed sequences of 1638 tokens

# (B, T, H, K = V, dtype, gpu, lengths, training, save_states) ->
#     (walk, walk block_v, residual, split partitions, keep_states, recompute, overlap, segments, reverse, reverse block_v)
TABLE = [
    # the benchmark's shapes on sm90 (the H200: 132 SMs)
    ((8, 2048, 16, 128, bf16, "sm90", None, True, False), ("hopper", 128, True, 1, False, "on_chip", False, 1, "hopper", 128)),
    ((8, 2048, 16, 128, bf16, "sm90", None, True, True), ("hopper", 128, False, 1, True, "none", False, 1, "hopper", 128)),
    ((8, 2048, 16, 128, bf16, "sm90", None, False, False), ("hopper", 128, True, 1, False, "none", False, 1, "none", 128)),
    ((8, 2048, 16, 128, fp16, "sm90", None, True, False), ("hopper", 128, True, 1, False, "on_chip", False, 1, "hopper", 128)),
    ((4, 4096, 16, 128, bf16, "sm90", None, True, False), ("hopper", 64, True, 1, False, "on_chip", False, 1, "hopper", 64)),
    ((4, 4096, 16, 128, bf16, "sm90", None, True, True), ("hopper", 64, False, 1, True, "none", False, 1, "hopper", 64)),
    ((2, 8192, 32, 128, bf16, "sm90", None, True, False), ("hopper", 64, True, 1, False, "on_chip", False, 1, "hopper", 64)),
    ((1, 32768, 16, 128, bf16, "sm90", None, True, False), ("hopper", 64, True, 3, False, "two_launch", False, 2, "hopper", 64)),
    ((1, 32768, 16, 128, bf16, "sm90", None, True, True), ("hopper", 64, True, 3, False, "two_launch", False, 2, "hopper", 64)),
    ((1, 32768, 16, 128, fp16, "sm90", None, True, False), ("hopper", 64, True, 3, False, "two_launch", False, 2, "hopper", 64)),
    # inference: one segment, nothing kept, the split as in training; no backward choices
    ((1, 32768, 16, 128, bf16, "sm90", None, False, True), ("hopper", 64, True, 3, False, "none", False, 1, "none", 16)),
    ((1, 32768, 64, 128, bf16, "sm90", None, True, False), ("hopper", 64, True, 1, False, "on_chip", False, 1, "hopper", 64)),
    ((1, 32768, 64, 128, bf16, "sm90", None, True, True), ("hopper", 64, False, 1, True, "none", False, 1, "hopper", 64)),
    ((1, None, 16, 128, bf16, "sm90", PACKED_20, True, False), ("hopper", 128, True, 1, False, "on_chip", False, 1, "portable", 64)),
    ((16, 2048, 8, 64, bf16, "sm90", None, True, False), ("portable_fused", 64, False, 1, False, "on_chip", False, 1, "portable", 64)),
    ((4, 4096, 16, 256, bf16, "sm90", None, True, False), ("portable", 64, False, 1, False, "two_launch", False, 1, "portable", 32)),
    # fp32: never the Hopper walk, never fused, always the two-launch recompute
    ((4, 4096, 16, 128, fp32, "sm90", None, True, False), ("portable", 64, False, 1, False, "two_launch", False, 1, "portable", 64)),
    ((1, 32768, 16, 128, fp32, "sm90", None, True, False), ("portable", 16, False, 1, False, "two_launch", False, 2, "portable", 16)),
    ((1, 8192, 16, 128, fp32, "sm90", None, True, False), ("portable", 16, False, 1, False, "two_launch", True, 1, "portable", 16)),
    # sm80: no Hopper kernels, two streams
    ((1, 32768, 16, 128, bf16, "sm80", None, True, False), ("portable", 16, False, 1, False, "two_launch", False, 2, "portable", 16)),
    ((8, 2048, 16, 128, bf16, "sm80", None, True, False), ("portable_fused", 128, False, 1, False, "on_chip", False, 1, "portable", 64)),
    ((8, 2048, 16, 128, bf16, "sm80", None, True, True), ("portable_fused", 128, False, 1, False, "on_chip", False, 1, "portable", 64)),
    # the interpreter: no Hopper kernels, no streams (no overlap, no segments), V-blocks not shrunk
    ((8, 2048, 16, 128, bf16, "cpu", None, True, False), ("portable_fused", 128, False, 1, False, "on_chip", False, 1, "portable", 128)),
    ((1, 32768, 16, 128, bf16, "cpu", None, True, False), ("portable_fused", 128, False, 1, False, "on_chip", False, 1, "portable", 128)),
    ((1, 32768, 16, 128, bf16, "cpu", None, True, True), ("portable_fused", 128, False, 1, False, "on_chip", False, 1, "portable", 128)),
    ((1, 8192, 16, 128, fp32, "cpu", None, True, False), ("portable", 64, False, 1, False, "two_launch", False, 1, "portable", 64)),
]


def shape_id(case):
    (B, T, H, D, dtype, gpu, lengths, training, save_states), _ = case
    shape = f"{len(lengths)}x{lengths[0]}" if lengths else f"b{B}-t{T}"
    return (f"{shape}-h{H}-d{D}-{str(dtype)[6:]}-{gpu}" + ("" if training else "-inference")
            + ("-save_states" if save_states else ""))


@pytest.mark.parametrize("shape, expected", TABLE, ids=[shape_id(c) for c in TABLE])
def test_plan_table(shape, expected):
    B, T, H, D, dtype, gpu, lengths, training, save_states = shape
    p = plan_for_shape(B, T, H, D, D, dtype, gpu, lengths=lengths, training=training, save_states=save_states)
    got = (p.walk, p.walk_launch.block_v, p.residual, p.split_partitions, p.keep_states, p.recompute, p.overlap,
           p.segments, p.reverse, p.reverse_launch.block_v)
    assert got == expected
    assert p.split == (p.split_partitions > 1) and p.split_min_tokens == plan.SPLIT_MIN_TOKENS
    assert {name for name, _ in p.reasons} == {"walk", "split", "segments", "keep_states", "residual", "recompute",
                                               "overlap", "reverse", "local_dv"} and all(p.reason(name)
                                                                                         for name, _ in p.reasons)
    assert not p.local_dv_apart  # the local dV' in the pass, but for KDA


def test_plan_is_frozen_and_problem_counts():
    p = plan_for_shape(1, None, 16, 128, 128, bf16, lengths=PACKED_20)
    assert (p.problem.num_seqs, p.problem.total_tokens, p.problem.states) == (20, 32760, 320)
    with pytest.raises(Exception):  # dataclasses.FrozenInstanceError
        p.walk = "portable"


# ---------------------------------------------------------------- the rules one at a time (sm90, K = V = 128)

@pytest.mark.parametrize("N, H, forced, expected", [(1, 16, None, "hopper"), (4, 16, None, "hopper"),
                                                     (1, 8, None, "portable"), (3, 5, None, "portable"),
                                                     (1, 8, True, "hopper"), (8, 16, False, "portable_fused")])
def test_hopper_walk_from_16_sequences_x_heads(N, H, forced, expected):
    # where the Hopper walk fits (sm90, 16-bit, K = V = 128, chunk 64), from 16 sequences x heads (the fewest it was
    # measured faster at) unless forced either way; else the portable walk: fused at 8 x 16 (a 128-wide V-block), unfused
    # at 8 and 15 sequences x heads, where the V-block shrinks to 16 to give 128 programs (the fused walk wants 64+)
    with plan.overrides(hopper_walk=forced):
        assert plan_for_shape(N, 1024, H, 128, 128, bf16).walk == expected


@pytest.mark.parametrize("N, H, T, sms, expected", [
    (1, 16, 32768, 132, 3),  # b1-t32768-h16: (2P - 3) x 16 x 2 <= 132 up to P = 3
    (1, 22, 32768, 132, 3), (1, 23, 32768, 132, 1),  # 3 x 23 x 2 > 132: no P >= 3 fits
    (2, 8, 16384, 132, 1), (2, 8, 65536, 264, 4),  # two sequences: (4P - 3) x 8 x 2 <= SMs (fillers counted)
    (1, 16, 32768, 264, 5),  # more SMs, more partitions
    (1, 16, 8192, 264, 4),  # partitions of 2048 tokens at least
    (1, 8, 32768, 132, 1),  # below 16 sequences x heads
    (1, 64, 32768, 132, 1), (2, 32, 8192, 132, 1), (20, 16, 32768, 132, 1),  # 64 and more
    (1, 16, 8191, 132, 1), (2, 8, 16382, 132, 1),  # sequences shorter than 8192 tokens on average
])
def test_split_partitions_rule(N, H, T, sms, expected):
    assert plan.split_partitions(N, H, T, sms) == expected


@pytest.mark.parametrize("gpu, dtype, forced, expected", [
    ("sm90", bf16, None, 3), ("sm90", fp32, None, 1),  # the Hopper walk only (measured there)
    ("sm90", bf16, 1, 1), ("sm90", bf16, 5, 5), ("cpu", fp32, 4, 4), ("sm80", bf16, 2, 2)])  # forced: any walk
def test_split_on_the_hopper_walk_unless_forced(gpu, dtype, forced, expected):
    with plan.overrides(split_partitions=forced, split_min_tokens=None if forced is None else 64):
        p = plan_for_shape(1, 32768, 16, 128, 128, dtype, gpu)
    assert p.split_partitions == expected
    assert p.split_min_tokens == (plan.SPLIT_MIN_TOKENS if forced is None else 64)
    if expected > 1 and p.walk == "hopper":  # pass 1 fits one wave at two programs a head
        assert (p.walk_launch.block_v, p.walk_launch.warps) == (64, 4)


@pytest.mark.parametrize("N, T, H, forced, expected, expected_gated", [
    (2, 8192, 32, None, True, True), (1, 32768, 16, None, True, True), (1, 8192, 132, None, True, True),
    (16, 8192, 1, None, True, True), (1, 8192, 15, None, False, False), (1, 8192, 133, None, False, True),
    (20, 8192, 16, None, False, False), (8, 4096, 32, None, False, True), (1, 8192, 264, None, False, True),
    (1, 8192, 265, None, False, False), (4, 4096, 16, None, True, True), (8, 2048, 16, None, True, True),
    (16, 2047, 8, None, False, False), (8, 1024, 16, None, False, False), (4, 4096, 16, True, True, True),
    (8, 1024, 16, True, True, True), (2, 8192, 32, False, False, False), (8, 4096, 32, False, False, False)])
@pytest.mark.parametrize("gated, key_heads", [(False, 0), (True, 0), (False, 1), (True, 1)])
def test_hopper_reverse_from_16_to_one_wave_on_long_sequences(N, T, H, forced, expected, expected_gated, gated,
                                                              key_heads):
    # where the Hopper reverse pass fits (what the Hopper walk needs, and a backward), from 16 sequences x heads (the
    # fewest measured) while one program a sequence and head fits one wave of the 132 SMs (two waves for the gated
    # rule: measured faster at Qwen3-Next's B 8, T 4096, 32 value heads), on sequences of 2,048 tokens or more on
    # average, unless forced either way; its V-block as the Hopper walk's (hopper_block_v). Grouped value heads (one
    # key head here; H counts the value heads) take the same rule and overrides
    with plan.overrides(hopper_reverse=forced):
        p = plan_for_shape(N, T, H, 128, 128, bf16, gated=gated, key_heads=key_heads)
    assert p.reverse == ("hopper" if (expected_gated if gated else expected) else "portable")
    if expected:
        assert p.reverse_launch.block_v == plan.hopper_block_v(N * H, 132)


@pytest.mark.parametrize("states, sms, expected", [(1, 132, 64), (16, 132, 64), (64, 132, 64), (66, 132, 64),
                                                   (67, 132, 128), (128, 132, 128), (320, 132, 128)])
def test_hopper_block_v_while_the_doubled_grid_fits_one_wave(states, sms, expected):
    # two programs a head while 2 x sequences x heads fit the H200's 132 SMs (measured faster there), else one
    assert plan.hopper_block_v(states, sms) == expected


@pytest.mark.parametrize("N, T, H, expected", [
    (1, 32768, 16, True), (2, 8192, 16, True), (1, 8192, 32, True), (32, 8192, 1, True),
    (1, 32768, 33, False), (1, 32768, 64, False), (2, 8192, 32, False),  # too many sequences x heads
    (1, 8191, 16, False), (4, 4096, 8, False), (8, 2048, 2, False)])  # sequences too short
def test_overlap_on_few_long_sequences_x_heads(N, T, H, expected):
    # the two-launch recompute (fp32 here) overlaps the reverse pass at most 32 sequences x heads, 8,192 tokens or
    # more a sequence on average, on two streams, unsegmented (segments forced to 1: their own rule would take some)
    with plan.overrides(segments=1):
        p = plan_for_shape(N, T, H, 128, 128, fp32)
        assert p.recompute == "two_launch" and p.overlap == expected
        assert plan_for_shape(N, T, H, 128, 128, fp32, "cpu").overlap is False  # no streams


@pytest.mark.parametrize("N, T, H, expected", [
    (1, 32768, 16, 2), (2, 16384, 16, 2), (1, 16384, 32, 2), (32, 16384, 1, 2),
    (1, 32768, 33, 1), (1, 32768, 64, 1), (2, 16384, 32, 1),  # too many sequences x heads
    (1, 16383, 16, 1), (4, 8192, 8, 1), (8, 2048, 2, 1)])  # sequences too short
def test_segments_on_few_long_sequences_x_heads(N, T, H, expected):
    # 2 segments at most 32 sequences x heads of 16,384 tokens or more on average, on two streams only (on one
    # stream the segments would only add launches), in training only
    assert plan_for_shape(N, T, H, 128, 128, bf16).segments == expected
    assert plan_for_shape(N, T, H, 128, 128, bf16, "sm80").segments == expected
    assert plan_for_shape(N, T, H, 128, 128, bf16, "cpu").segments == 1
    assert plan_for_shape(N, T, H, 128, 128, bf16, training=False).segments == 1


@pytest.mark.parametrize("forced, expected", [({}, True), (dict(hopper_walk=False), False),
                                              (dict(segments=2), False), (dict(split_partitions=3), False)])
def test_keeps_states_only_where_its_backward_reads_them(forced, expected):
    # save_states keeps the forward's states where the walk is the Hopper one (the only one that saves them), with
    # neither a split nor a segmented backward (those recompute on their own terms); forcing it elsewhere is refused
    with plan.overrides(**forced):
        p = plan_for_shape(4, 4096, 16, 128, 128, bf16, save_states=True)
        assert p.keep_states == expected and p.residual == (not expected and p.walk == "hopper")
        assert p.recompute == ("none" if expected else "on_chip")
        if not expected:
            with pytest.raises(ValueError, match="keep_states"), plan.overrides(keep_states=True):
                plan_for_shape(4, 4096, 16, 128, 128, bf16)
    with plan.overrides(keep_states=True):  # as save_states=True on every training call
        assert plan_for_shape(4, 4096, 16, 128, 128, bf16).keep_states is True
        assert plan_for_shape(4, 4096, 16, 128, 128, bf16, training=False).keep_states is False
    with plan.overrides(keep_states=False):
        assert plan_for_shape(4, 4096, 16, 128, 128, bf16, save_states=True).keep_states is False


def test_residual_form_on_the_hopper_walk_unless_states_are_kept():
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16).residual is True
    with plan.overrides(residual=False):
        assert plan_for_shape(8, 2048, 16, 128, 128, bf16).residual is False
    with plan.overrides(residual=True), pytest.raises(ValueError, match="kept states need W"):
        plan_for_shape(8, 2048, 16, 128, 128, bf16, save_states=True)


# ---------------------------------------------------------------- overrides

def test_overrides_nest_and_restore():
    assert plan.current_overrides() == Overrides()
    with plan.overrides(segments=2, overlap=False) as outer:
        assert outer == plan.current_overrides() == Overrides(segments=2, overlap=False)
        with plan.overrides(segments=3, residual=True) as inner:  # inner ones win, the others combine
            assert inner == Overrides(segments=3, overlap=False, residual=True)
        assert plan.current_overrides() == Overrides(segments=2, overlap=False)
        with plan.overrides(overlap=None):  # None: the rule's again
            assert plan.current_overrides() == Overrides(segments=2)
    assert plan.current_overrides() == Overrides()


def test_overrides_restored_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with plan.overrides(hopper_walk=False):
            with plan.overrides(split_partitions=4):
                raise RuntimeError("inside")
    assert plan.current_overrides() == Overrides()
    p = plan_for_shape(8, 2048, 16, 128, 128, bf16)
    assert p.walk == "hopper" and p.split_partitions == 1


def test_overrides_apply_to_the_plans_made_inside():
    before = plan_for_shape(1, 32768, 16, 128, 128, bf16)
    with plan.overrides(segments=1, hopper_reverse=False, split_partitions=1):
        p = plan_for_shape(1, 32768, 16, 128, 128, bf16)
        assert (p.segments, p.reverse, p.split_partitions) == (1, "portable", 1)
        assert "forced by overrides(hopper_reverse=False)" in p.reason("reverse")
    assert plan_for_shape(1, 32768, 16, 128, 128, bf16) is before


def test_wy_register_cap_override():
    """The forward WY kernel's register cap: the rule's 168 for 16-bit heads up to 128, any cap forced (0: none) for
    that kernel alone, a negative one refused; the WY backward's the same way."""
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16).wy_launch.maxnreg == 168
    for cap in (0, 232):
        with plan.overrides(wy_maxnreg=cap):
            p = plan_for_shape(8, 2048, 16, 128, 128, bf16)
        assert p.wy_launch.maxnreg == cap and p.wy_launch.options() == ({"maxnreg": cap} if cap else {})
        assert p.recompute_wy_launch.maxnreg == 0 and p.wy_bwd_launch.maxnreg == 168
    # the per-head gated rule's W, U variant and KDA's forward (the output's scores beside A) uncapped (they spill
    # under 168), the gated residual form's pair capped as the ungated one
    assert plan_for_shape(8, 4096, 32, 128, 128, bf16, gated=True, key_heads=16).wy_launch.maxnreg == 168
    with plan.overrides(residual=False):
        assert plan_for_shape(8, 4096, 32, 128, 128, bf16, gated=True, key_heads=16).wy_launch.maxnreg == 0
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16, gated=True, per_channel=True).wy_launch.maxnreg == 0
    with pytest.raises(ValueError, match="wy_maxnreg=-1"):
        with plan.overrides(wy_maxnreg=-1):
            plan_for_shape(8, 2048, 16, 128, 128, bf16)
    # the WY backward: capped at 168 but for the per-head gated rule's variant (it spills under the cap); forced caps
    # for that kernel alone
    gated = plan_for_shape(8, 4096, 32, 128, 128, bf16, gated=True, key_heads=16)
    assert gated.wy_bwd_launch.maxnreg == 0 and plan_for_shape(8, 2048, 16, 128, 128, bf16).wy_bwd_launch.maxnreg == 168
    with plan.overrides(wy_bwd_maxnreg=0):
        p = plan_for_shape(8, 2048, 16, 128, 128, bf16)
    assert p.wy_bwd_launch.maxnreg == 0 and p.wy_launch.maxnreg == 168
    with pytest.raises(ValueError, match="wy_bwd_maxnreg=-1"):
        with plan.overrides(wy_bwd_maxnreg=-1):
            plan_for_shape(8, 2048, 16, 128, 128, bf16)
    # dqkw: 4 warps; forced warps for that kernel alone, a power of two
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16).dqkw_launch.warps == 4
    with plan.overrides(dqkw_warps=8):
        p = plan_for_shape(8, 4096, 32, 128, 128, bf16, gated=True, key_heads=16)
    assert p.dqkw_launch.warps == 8 and p.wy_bwd_launch == gated.wy_bwd_launch
    with pytest.raises(ValueError, match="dqkw_warps=3"):
        with plan.overrides(dqkw_warps=3):
            plan_for_shape(8, 2048, 16, 128, 128, bf16)
    # the portable walks' and reverse pass's V-blocks, forced for those launches alone; the Hopper pass has its own
    kda = plan_for_shape(1, 32768, 16, 128, 128, bf16, per_channel=True)
    assert kda.walk_launch.block_v == kda.recompute_launch.block_v == kda.reverse_launch.block_v == 16
    with plan.overrides(walk_block_v=64, reverse_block_v=32):
        wide = plan_for_shape(1, 32768, 16, 128, 128, bf16, per_channel=True)
    assert (wide.walk_launch.block_v, wide.recompute_launch.block_v, wide.reverse_launch.block_v) == (64, 64, 32)
    assert (wide.walk_launch.warps, wide.reverse_launch.warps) == (kda.walk_launch.warps, kda.reverse_launch.warps)
    with pytest.raises(ValueError, match="walk_block_v=48"):
        with plan.overrides(walk_block_v=48):
            plan_for_shape(1, 32768, 16, 128, 128, bf16, per_channel=True)
    with pytest.raises(ValueError, match="Hopper pass"):
        with plan.overrides(reverse_block_v=64):
            plan_for_shape(8, 2048, 16, 128, 128, bf16)
    # grouped value heads: the gradient stages as one launch a group member, as explain says
    assert "portable.wy_bwd (each 2 launches: one a member of each key head's group" in " -> ".join(plan.kernels(p)[1])
    assert "launches" not in " -> ".join(plan.kernels(plan_for_shape(8, 2048, 16, 128, 128, bf16))[1])


@pytest.mark.parametrize("K, V", [(16, 16), (32, 32), (64, 32), (40, 24), (32, 128), (128, 128), (256, 192)])
@pytest.mark.parametrize("element_size", [2, 4])
def test_wy_tiles_64_wide(K, V, element_size):
    # narrower WY tiles gave wrong W, U on the H200 (plan.wy_launch), so narrow heads take masked 64-wide tiles
    for fused in (True, False):
        tiles = plan.wy_launch(K, V, element_size, fused)
        assert (tiles.tile_k, tiles.tile_v) == (64, 64)


def test_unknown_override_raises_type_error():
    with pytest.raises(TypeError, match="unknown choices"):
        with plan.overrides(gluon_walk=True):
            pass
    with pytest.raises(TypeError, match="SEQ_SPLIT"):
        with plan.overrides(segments=2, SEQ_SPLIT=True):
            pass
    assert plan.current_overrides() == Overrides()


@pytest.mark.parametrize("forced, gpu, dtype, D, match", [
    (dict(hopper_walk=True), "cpu", bf16, 128, "hopper_walk=True"),
    (dict(hopper_walk=True), "sm80", bf16, 128, "hopper_walk=True"),
    (dict(hopper_walk=True), "sm90", fp32, 128, "hopper_walk=True"),
    (dict(hopper_walk=True), "sm90", bf16, 64, "hopper_walk=True"),
    (dict(overlap=True), "cpu", fp32, 128, "two CUDA streams"),  # the two-launch recompute, no streams
    (dict(overlap=True, segments=2), "sm90", fp32, 128, "overlap=True"),  # the segments' own side stream
    (dict(residual=True), "sm90", fp32, 128, "residual=True"),  # the portable walk
    (dict(residual=True), "sm80", bf16, 128, "residual=True"),
    (dict(residual=True, hopper_walk=False), "sm90", bf16, 128, "residual=True"),
    (dict(hopper_reverse=True), "cpu", bf16, 128, "hopper_reverse=True"),
    (dict(hopper_reverse=True), "sm90", bf16, 256, "hopper_reverse=True"),
    (dict(keep_states=True), "cpu", bf16, 128, "keep_states=True"),
    (dict(split_partitions=0), "sm90", bf16, 128, "split_partitions"),
])
def test_impossible_forced_choices_raise_at_plan_time(forced, gpu, dtype, D, match):
    with plan.overrides(**forced), pytest.raises(ValueError, match=match):
        plan_for_shape(1, 8192, 16, D, D, dtype, gpu)


def test_local_dv_apart():
    # KDA's rule reads the local dV' from grads.dv_local; the ungated portable pass may be forced to; the Hopper
    # pass and the per-head gated one compute it themselves
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16, per_channel=True).local_dv_apart
    with plan.overrides(local_dv_apart=False):
        assert not plan_for_shape(8, 2048, 16, 128, 128, bf16, per_channel=True).local_dv_apart
    with plan.overrides(local_dv_apart=True):
        assert plan_for_shape(8, 2048, 16, 128, 128, bf16, "cpu").local_dv_apart
        assert not plan_for_shape(8, 2048, 16, 128, 128, bf16, "cpu", training=False).local_dv_apart
        for shape in (dict(gated=True), dict(gpu="sm90", T=8192)):
            with pytest.raises(ValueError, match="local_dv_apart=True"):
                plan_for_shape(**{**dict(B=8, T=2048, H=16, K=128, V=128, dtype=bf16, gpu="cpu"), **shape})


def test_forced_overlap_refused_on_the_one_launch_recompute():
    assert plan_for_shape(8, 2048, 16, 128, 128, bf16).recompute == "on_chip"
    with plan.overrides(overlap=True), pytest.raises(ValueError, match="overlap=True"):
        plan_for_shape(8, 2048, 16, 128, 128, bf16)
    with plan.overrides(overlap=True):  # inference has no backward to overlap: the override does not apply
        assert not plan_for_shape(8, 2048, 16, 128, 128, bf16, training=False).overlap


def test_hopper_walk_needs_tma_aligned_inputs():
    problem = plan.Problem(bf16, 16, 128, 128, 8, 16384, tma_aligned=False)
    p = plan.make_plan(problem, plan.named_capabilities("sm90"))
    assert p.walk == "portable_fused" and p.reverse == "portable"
    with plan.overrides(hopper_walk=True), pytest.raises(ValueError, match="16-byte aligned"):
        plan.make_plan(problem, plan.named_capabilities("sm90"))


# ---------------------------------------------------------------- capabilities, caching, explain

def test_named_capabilities():
    sm90, sm80, cpu = (plan.named_capabilities(g) for g in ("sm90", "sm80", "cpu"))
    assert (sm90.hopper, sm90.two_streams, sm90.num_sms) == (True, True, 132)
    assert (sm80.hopper, sm80.two_streams, sm80.num_sms) == (False, True, 108)
    assert (cpu.hopper, cpu.two_streams, cpu.interpret) == (False, False, True)
    assert plan.named_capabilities("interpreter") == cpu
    with pytest.raises(ValueError, match="gpu must be one of"):
        plan.named_capabilities("sm75")


def test_device_capabilities_of_cpu_tensors():
    caps = plan.device_capabilities(torch.device("cpu"))
    assert not caps.hopper and not caps.two_streams and caps.num_sms == 1


def test_make_plan_is_cached():
    problem = plan.Problem(bf16, 16, 128, 128, 1, 32768)
    caps = plan.named_capabilities("sm90")
    p = plan.make_plan(problem, caps)
    assert plan.make_plan(plan.Problem(bf16, 16, 128, 128, 1, 32768), plan.named_capabilities("sm90")) is p
    assert plan_for_shape(1, 32768, 16, 128, 128, bf16) is p
    with plan.overrides(segments=1):
        forced = plan.make_plan(problem, caps)
        assert forced is not p and forced.segments == 1 and plan.make_plan(problem, caps) is forced
    assert plan.make_plan(problem, caps, Overrides(segments=1)) is forced  # explicit overrides, the same key
    assert plan.make_plan(problem, caps) is p


def test_explain_names_the_kernels():
    text = plan.explain(plan_for_shape(1, 32768, 16, 128, 128, bf16))
    lines = text.splitlines()
    assert lines[0].startswith("problem: 1 sequences, 32768 tokens, 16 heads, K = 128, V = 128, bf16, chunk 64")
    assert lines[1] == "device:  sm90 (132 SMs)"
    fwd = [line for line in lines if line.startswith("forward:")]
    bwd = [line for line in lines if line.startswith("backward:")]
    assert fwd == ["forward:  portable.wy (T~ and its Tb pair) -> hopper.walk pass 1 without output, on U (and on W "
                   "beside it, side stream) -> combine (torch) -> hopper.walk pass 2 on 3 partitions a long sequence"]
    assert bwd == ["backward: portable.wy (W, U from T~) -> portable.walk (side stream, beside the reverse pass) -> per "
                   "segment (x2, last first): hopper.reverse; then portable.grads, portable.wy_bwd of the segment "
                   "after it, side stream"]
    for choice in ("walk", "split", "keep_states", "residual", "recompute", "overlap", "reverse", "segments",
                   "launches"):
        assert any(line.split()[:1] == [choice] for line in lines), choice


@pytest.mark.parametrize("gpu, dtype, save_states, forward, backward", [
    ("sm90", bf16, True, "portable.wy (T~, W, U) -> hopper.walk (stores S^T, V'^T per chunk)",
     "hopper.reverse -> portable.grads, portable.wy_bwd"),
    ("cpu", bf16, False, "portable.wy (T~, W, U) -> portable.walk (output fused)",
     "portable.walk (W, U on chip from T~) -> portable.reverse -> portable.grads, portable.wy_bwd"),
    ("cpu", fp32, False, "portable.wy (T~, W, U) -> portable.walk -> portable.output",
     "portable.wy (W, U from T~) -> portable.walk -> portable.reverse -> portable.grads, portable.wy_bwd"),
])
def test_explain_forward_and_backward_lines(gpu, dtype, save_states, forward, backward):
    text = plan.explain(plan_for_shape(4, 4096, 16, 128, 128, dtype, gpu, save_states=save_states))
    assert "forward:  " + forward in text.splitlines()
    assert "backward: " + backward in text.splitlines()


def test_explain_inference_has_no_backward():
    text = plan.explain(plan_for_shape(8, 2048, 16, 128, 128, bf16, training=False))
    assert "inference" in text.splitlines()[0]
    assert "forward:  portable.wy (T~ and its Tb pair) -> hopper.walk" in text
    assert "backward:" not in text


@pytest.mark.parametrize("gated, key_heads", [(True, 0), (False, 8), (True, 8)])
def test_gated_and_grouped_calls_take_the_hopper_walk_unsplit(gated, key_heads):
    # on sm90, where the ungated call of this shape runs the Hopper walk split, the Hopper reverse pass and segments:
    # the gate and grouped heads take the Hopper walk in the residual form and the Hopper reverse pass, whole
    # sequences, one segment
    p = plan_for_shape(1, 32768, 16, 128, 128, bf16, gated=gated, key_heads=key_heads)
    assert p.walk == "hopper" and (p.reverse, p.segments, p.residual, p.split, p.keep_states) == (
        "hopper", 1, True, False, False)
    assert "takes neither the gate nor grouped value heads" in p.reason("split")
    fwd, bwd = plan.kernels(p)
    assert (fwd[0] == "portable.gate (γ)") == gated and (bwd[-1] == "portable.gate (dg)") == gated
    assert "hopper.walk" in fwd
    problem = plan.Problem(bf16, 16, 128, 128, 1, 32768, gated=gated, key_heads=key_heads)
    refused = (dict(segments=2), dict(split_partitions=3), dict(keep_states=True))
    for forced in refused:
        with pytest.raises(ValueError):
            plan.make_plan(problem, plan.named_capabilities("sm90"), Overrides(**forced))
    assert not plan.make_plan(problem, plan.named_capabilities("sm90"), Overrides(residual=False)).residual
    assert plan.make_plan(problem, plan.named_capabilities("sm90"), Overrides(hopper_walk=False)).walk != "hopper"


def test_prepared_varlen_metadata_takes_no_split():
    # prepare_varlen's metadata: a graph may replay the call on other lengths, and the split's partitions are cut from
    # the lengths on the host, so the Hopper walk runs unsplit where it would split, and a forced split is refused
    problem = plan.Problem(bf16, 16, 128, 128, 1, 32768, training=False, prepared=True)
    caps = plan.named_capabilities("sm90")
    assert plan_for_shape(1, 32768, 16, 128, 128, bf16, training=False).split_partitions == 3
    prepared = plan.make_plan(problem, caps)
    assert (prepared.walk, prepared.split_partitions) == ("hopper", 1)
    assert "prepared varlen metadata" in dict(prepared.reasons)["split"]
    with plan.overrides(split_partitions=2), pytest.raises(ValueError, match="prepared varlen metadata"):
        plan.make_plan(problem, caps)
