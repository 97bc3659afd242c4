"""`deltatron explain` (deltatron/cli/explain.py): the plan of a shape, the gated rule, KDA's calls and grouped heads
included."""
from deltatron.cli import explain


def test_gated_grouped_layout(capsys):
    assert explain.main(["--batch", "8", "--seqlen", "4096", "--heads", "32", "--key-heads", "16", "--gated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: gated, 8 sequences, 32768 tokens, 16 key heads, 32 value heads")
    assert any(line.startswith("forward:  portable.gate (γ) -> portable.wy") for line in lines)


def test_chunk_states(capsys):
    # output_chunk_states: the portable walk that stores the state entering each chunk, for every rule
    for rule in ([], ["--gated"], ["--kda"]):
        assert explain.main([*rule, "--inference", "--chunk-states"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].endswith("inference, output_chunk_states")
        assert any(line.split()[:2] == ["walk", "portable"] and "stores the state entering each chunk" in line
                   for line in lines)


def test_key_heads_must_divide_heads(capsys):
    assert explain.main(["--heads", "32", "--key-heads", "12"]) == 2
    assert "--key-heads must divide --heads (32), got 12" in capsys.readouterr().err


def test_kda_inference(capsys):
    # KDA's per-channel gate: the portable walk (the Hopper walk takes the per-head gate only), the gate's sums within
    # sub-chunks before the WY stage (no γ stage), no backward
    assert explain.main(["--batch", "1", "--seqlen", "8192", "--heads", "32", "--key-heads", "16", "--kda",
                         "--inference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: per-channel gate (KDA), 1 sequences, 8192 tokens, 16 key heads")
    assert any(line.split()[:2] == ["walk", "portable"] and "per-head gate only" in line for line in lines)
    assert any(line.startswith("forward:  portable.gate (KDA's sums within sub-chunks) -> portable.wy (T~, W, U; "
                               "KDA's per-channel") for line in lines)
    assert not any(line.startswith("backward:") for line in lines)


def test_kda_training(capsys):
    # a KDA training call: the portable stages forward and backward, the gate's sums within sub-chunks made once each
    # way (no γ stage), the serial passes' decays made by the WY stage beside W, the scores P in the parallel stages
    # (the WY stage beside A, for the output and kept for the local dV' before the reverse pass), dg per key channel
    assert explain.main(["--batch", "2", "--seqlen", "4096", "--heads", "16", "--kda"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["reverse", "portable"] for line in lines)
    assert any(line.split()[:2] == ["recompute", "two_launch"] and "per-head gate only" in line for line in lines)
    forward = [line for line in lines if line.startswith("forward:")]
    assert forward == ["forward:  portable.gate (KDA's sums within sub-chunks) -> portable.wy (T~, W, U; KDA's "
                       "per-channel decays from the gate's sums, the walk's decayed K beside W; the output's scores P "
                       "beside A, exp(Γ) ⊙ Q beside W) -> portable.walk -> portable.output (the WY stage's scores P, "
                       "kept for the backward's local dV')"]
    backward = [line for line in lines if line.startswith("backward:")]
    assert backward == ["backward: portable.gate (KDA's sums within sub-chunks) -> portable.wy (W, U from T~; KDA's decayed K, Q for both serial passes beside W) -> "
                        "portable.walk -> portable.grads (local dV' from the forward's scores P) -> "
                        "portable.reverse (reads the local dV') -> portable.grads, portable.wy_bwd -> "
                        "portable.gate (dg per key channel)"]


def test_kda_largest_heads(capsys):
    # K = V = 256: KDA's chunk kernels as at 128 where the shared memory holds them (sm_90: the portable stages, the
    # reverse pass at block_v 32), the token-serial kernels where it does not (sm_80)
    assert explain.main(["--kda", "--head-dim", "256"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: per-channel gate (KDA)") and "K = 256, V = 256" in lines[0]
    assert any(line.split()[:3] == ["reverse", "portable", "[block_v"] and "32," in line for line in lines)
    assert explain.main(["--kda", "--head-dim", "256", "--gpu", "sm80"]) == 0
    assert capsys.readouterr().out.startswith("form: fused_recurrent: KDA's chunk kernels at K or V > 128 (here K = "
                                              "256, V = 256) need 229,376 B of shared memory a block and sm80 (108 "
                                              "SMs) has 166,912")
    assert explain.main(["--kda", "--head-dim", "256", "--gpu", "sm80", "--chunk-states"]) == 2
    assert "--chunk-states needs the chunk kernels' walk" in capsys.readouterr().err

