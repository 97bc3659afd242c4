"""`deltatron explain` (deltatron/cli/explain.py): the plan of a shape, the gated rule, KDA's inference calls and
grouped heads included."""
from deltatron.cli import explain


def test_gated_grouped_layout(capsys):
    assert explain.main(["--batch", "8", "--seqlen", "4096", "--heads", "32", "--key-heads", "16", "--gated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: gated, 8 sequences, 32768 tokens, 16 key heads, 32 value heads")
    assert any(line.startswith("forward:  portable.gate (γ) -> portable.wy") for line in lines)


def test_key_heads_must_divide_heads(capsys):
    assert explain.main(["--heads", "32", "--key-heads", "12"]) == 2
    assert "--key-heads must divide --heads (32), got 12" in capsys.readouterr().err


def test_kda_inference(capsys):
    # KDA's per-channel gate: the portable walk (the Hopper walk takes the per-head gate only), no γ stage, no backward
    assert explain.main(["--batch", "1", "--seqlen", "8192", "--heads", "32", "--key-heads", "16", "--kda",
                         "--inference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: per-channel gate (KDA), 1 sequences, 8192 tokens, 16 key heads")
    assert any(line.split()[:2] == ["walk", "portable"] and "per-head gate only" in line for line in lines)
    assert any(line.startswith("forward:  portable.wy (T~, W, U; KDA's per-channel") for line in lines)
    assert not any(line.startswith("backward:") for line in lines)


def test_kda_plans_inference_only(capsys):
    assert explain.main(["--kda"]) == 2
    assert "--kda plans inference calls only" in capsys.readouterr().err
