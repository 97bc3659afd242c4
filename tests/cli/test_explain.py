"""`deltatron explain` (deltatron/cli/explain.py): the plan of a shape, the gated rule and grouped heads included."""
from deltatron.cli import explain


def test_gated_grouped_layout(capsys):
    assert explain.main(["--batch", "8", "--seqlen", "4096", "--heads", "32", "--key-heads", "16", "--gated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: gated, 8 sequences, 32768 tokens, 16 key heads, 32 value heads")
    assert any(line.startswith("forward:  portable.gate (γ) -> portable.wy") for line in lines)


def test_key_heads_must_divide_heads(capsys):
    assert explain.main(["--heads", "32", "--key-heads", "12"]) == 2
    assert "--key-heads must divide --heads (32), got 12" in capsys.readouterr().err
