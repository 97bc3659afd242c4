"""`deltatron train`: the MQAR data, the linear-attention baseline, the Gated DeltaNet mixer's heads and modes, a
short CPU run of each mixer that learns, seeding."""
import json

import pytest
import torch

from deltatron import cli
from deltatron.reference.common import l2norm
from deltatron.cli import train as train_module
from deltatron.cli.train import Config, DeltaNetLM, LinearAttention, mqar_batch, train
from deltatron.layers import GatedDeltaNet

TINY = ["--device", "cpu", "--steps", "40", "--batch-size", "16", "--seq-len", "24", "--num-kv", "4",
        "--vocab-size", "32", "--d-model", "32", "--num-heads", "2", "--eval-every", "20", "--eval-size", "32", "--lr", "1e-2"]


@pytest.fixture(autouse=True)
def torch_backend_one_thread(monkeypatch):
    # many small ops: one thread is faster than two, and much faster when other work shares the cores
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_mqar_batch_asks_every_key_for_its_value():
    inputs, targets = mqar_batch(8, 40, 6, 32, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (8, 40)
    for x, y in zip(inputs.tolist(), targets.tolist()):
        pairs = dict(zip(x[0:12:2], x[1:12:2]))
        assert len(pairs) == 6 and all(1 <= k < 16 and 16 <= v < 32 for k, v in pairs.items())
        asked = [(x[t], y[t]) for t in range(12, 40) if y[t] != -100]
        assert sorted(asked) == sorted(pairs.items())  # every key once, with its value as the target
        asked_at = {t for t in range(12, 40) if y[t] != -100}
        assert all(x[t + 1] == y[t] for t in asked_at)
        assert all(x[t] == 0 for t in range(12, 40) if t not in asked_at and t - 1 not in asked_at)  # filler
    again, _ = mqar_batch(8, 40, 6, 32, torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)


def test_mqar_batch_rejects_impossible_settings():
    with pytest.raises(ValueError, match="num_kv"):
        mqar_batch(2, 16, 8, 64, torch.Generator())


def test_linear_attention_is_the_additive_recurrence():
    torch.manual_seed(0)
    layer = LinearAttention(hidden_size=16, num_heads=2)
    B, T, H, K, V = 2, 7, 2, 8, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    o, _ = layer._attend(q, k, v, None, None, False, None)
    qn, kn = l2norm(q), l2norm(k)
    S = torch.zeros(B, H, K, V)
    for t in range(T):
        S = S + kn[:, t, :, :, None] * v[:, t, :, None, :]
        assert torch.allclose(o[:, t], K ** -0.5 * torch.einsum("bhk,bhkv->bhv", qn[:, t], S), atol=1e-5)
    with pytest.raises(NotImplementedError):
        layer._attend(q, k, v, None, None, True, None)


@pytest.mark.parametrize("mixer", ["delta", "linear", "gated_deltanet"])
def test_short_run_lowers_the_loss_and_writes_its_log(mixer, tmp_path, capsys):
    assert cli.main(["train", *TINY, "--mixer", mixer, "--out", str(tmp_path)]) == 0
    log = json.loads((tmp_path / f"mqar_{mixer}.json").read_text())
    losses = log["losses"]
    assert len(losses) == 40 and all(l == l for l in losses)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    assert [e["step"] for e in log["evals"]] == [20, 40]
    assert log["final_accuracy"] == log["evals"][-1]["accuracy"] and log["config"]["mixer"] == mixer
    out = capsys.readouterr()
    assert f"{mixer}: final held-out answer accuracy" in out.out and "mqar " + mixer in out.err
    assert "train loss" in out.err and "(mean of last 20 steps), held-out answer accuracy" in out.err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out.out and not (tmp_path / "mqar.png").exists()
    else:
        assert (tmp_path / "mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("num_heads, key_heads", [(4, 2), (2, 1), (3, 3)])
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_gated_deltanet_mixer_heads_and_mode(num_heads, key_heads, mode):
    """--mixer gated_deltanet: GatedDeltaNet layers with --num-heads value heads of d_model / num_heads and half as
    many query/key heads when that is even (Qwen3-Next's grouping), in the --mode given; the model runs."""
    torch.manual_seed(0)
    model = DeltaNetLM(vocab_size=16, d_model=12 * num_heads, num_layers=2, num_heads=num_heads,
                       mixer="gated_deltanet", mode=mode)
    for block in model.blocks:
        layer = block.mixer
        assert isinstance(layer, GatedDeltaNet) and layer.mode == mode
        assert (layer.num_v_heads, layer.num_k_heads, layer.head_k_dim, layer.head_v_dim) == (num_heads, key_heads,
                                                                                               12, 12)
    logits = model(torch.randint(0, 16, (2, 9)))
    assert logits.shape == (2, 9, 16) and torch.isfinite(logits).all()


class _Quiet:
    """A progress bar that shows nothing."""

    def __init__(self, total, desc):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def test_same_seed_same_losses():
    cfg = Config.preset("cpu", steps=6, batch_size=8, seq_len=24, num_kv=4, vocab_size=32, d_model=16, num_heads=2,
                        eval_every=3, eval_size=16)
    first, second = train(cfg, _Quiet), train(cfg, _Quiet)
    assert first["losses"] == second["losses"] and first["evals"][-1]["loss"] == second["evals"][-1]["loss"]
    other = train(Config(**dict(vars(cfg), seed=1)), _Quiet)
    assert other["losses"] != first["losses"]


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "16", "--num-kv", "8"], "num_kv"),
    (["--steps", "0"], "argument --steps: must be a positive int, got 0"),
    (["--steps", "-5"], "argument --steps: must be a positive int, got -5"),
    (["--lr", "0"], "argument --lr: must be a positive float, got 0"),
    (["--batch-size", "two"], "argument --batch-size: expected a positive int, got 'two'"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--d-model", "30", "--num-heads", "4"], "--d-model (30) must be divisible by --num-heads (4)"),
    (["--mixer", "linear", "--mode", "fused_recurrent"], "--mode applies to the delta and gated_deltanet mixers only"),
    (["--mixer", "gated", "--steps", "1"], "argument --mixer: invalid choice: 'gated'"),
])
def test_cli_rejects_bad_settings(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_cli_device_errors_are_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["train", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == "deltatron train: --device cuda but no CUDA device is available\n"
    assert cli.main(["train", "--device", "tpu"]) == 2
    assert capsys.readouterr().err == "deltatron train: --device must be cpu, cuda or cuda:N, got 'tpu'\n"


@pytest.mark.parametrize("spelling, expected", [("fp32", "fp32"), ("float32", "fp32"), ("bf16", "bf16"),
                                                ("bfloat16", "bf16")])
def test_dtype_spellings(spelling, expected, tmp_path):
    seen = []
    real_train = train_module.train

    def recording_train(cfg, *args, **kwargs):
        seen.append(cfg.dtype)
        return real_train(Config(**dict(vars(cfg), steps=2, eval_every=2)), _Quiet)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(train_module, "train", recording_train)
        assert cli.main(["train", *TINY, "--dtype", spelling, "--out", str(tmp_path)]) == 0
    assert seen == [expected]
    assert json.loads((tmp_path / "mqar_delta.json").read_text())["config"]["dtype"] == expected


def test_diverging_run_stops_with_an_error(monkeypatch, tmp_path, capsys):
    # a loss that is not finite (a kernel bug, say) ends the run at that step with exit code 1 and says
    # why, instead of training on and reporting accuracy 0 with exit code 0
    real_loss, calls = train_module.recall_loss, []

    def loss_going_nan(logits, targets):
        calls.append(1)
        loss = real_loss(logits, targets)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(train_module, "recall_loss", loss_going_nan)
    assert cli.main(["train", *TINY, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "the training loss is nan at step 3 of 40" in err and "DELTATRON_BACKEND=torch" in err
    assert not list(tmp_path.glob("mqar_*.json"))

