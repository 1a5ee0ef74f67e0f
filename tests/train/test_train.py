"""Training loop: learning, gradient-accumulation equivalence, lr schedule, NaN stop, exact resume after
SIGKILL (through the CLI in a subprocess), run-config parsing/overrides, and the shipped configs."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli.train import main as train_main
from diffattn.configs.packaged import packaged_configs
from diffattn.configs.run_config import (
    ClassifyConfig,
    ConfigError,
    TrainConfig,
    apply_overrides,
    load_run_config,
    parse_overrides,
    resolve_model_config,
)
from diffattn.configs.toml_writer import to_toml
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.loop import train
from diffattn.train.optim import lr_at
from diffattn.train.run_state import NonFiniteLossError
from diffattn.train.runlog import read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


class ArithmeticSource:
    """In-test BatchSource: rows are arithmetic progressions mod V with a random start and stride (learnable
    from context); the first target of each row is ignored (-100) so the ignore path is exercised."""

    def __init__(self, vocab_size: int = 24, seq_len: int = 16):
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator):
        if split not in ("train", "val"):
            raise ValueError(split)
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        y[:, 0] = -100
        return x, y


def _model(**kw) -> TransformerLM:
    cfg = dict(vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, attention="diff")
    cfg.update(kw)
    return TransformerLM(ModelConfig(**cfg))


def _tcfg(**kw) -> TrainConfig:
    base = dict(steps=30, batch_size=8, seq_len=16, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_every=10,
                eval_batches=2, log_every=1, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_decreases(tmp_path: Path) -> None:
    tcfg = _tcfg(steps=24, lr=5e-3, eval_every=8, eval_batches=1)
    res = train(_model(), ArithmeticSource(), tcfg, out_dir=tmp_path, progress=False)
    h = res.history
    assert [r["step"] for r in h] == list(range(1, 25))
    first, last = sum(r["train_loss"] for r in h[:5]) / 5, sum(r["train_loss"] for r in h[-5:]) / 5
    assert last < first - 0.5, (first, last)
    vals = [r["val_loss"] for r in h if r["val_loss"] is not None]
    assert len(vals) == 3 and vals[-1] < vals[0]
    assert res.best_val_loss == min(vals)
    assert res.tokens_seen == 24 * 8 * 16
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in h]  # repr floats round-trip exactly
    ck = load_checkpoint(tmp_path / "ckpt")
    assert ck.train_state["step"] == 24 and ck.train_state["best_val_loss"] == res.best_val_loss


def test_grad_accumulation_equivalence() -> None:
    """grad_accum 2 × batch 4 draws the same rows as grad_accum 1 × batch 8 and averages the same gradient
    (and evaluates on the same validation rows)."""
    m1 = _model()
    m2 = copy.deepcopy(m1)
    r1 = train(m1, ArithmeticSource(), _tcfg(steps=6, batch_size=8, eval_every=3), progress=False)
    r2 = train(m2, ArithmeticSource(), _tcfg(steps=6, batch_size=4, grad_accum=2, eval_every=3),
                  progress=False)
    for a, b in zip(r1.history, r2.history):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5, abs=1e-6)
        if a["val_loss"] is not None:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5, abs=1e-6)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5)


def test_lr_schedule_shape() -> None:
    t = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    lrs = [lr_at(s, t) for s in range(100)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warmup to lr
    assert lrs[10] == pytest.approx(1e-3)  # cosine starts at the peak
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then decays monotonically
    assert lr_at(55, t) == pytest.approx((1e-3 + 1e-4) / 2)  # half-way through the cosine
    assert lr_at(100, t) == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)
    assert lr_at(0, TrainConfig(steps=5, warmup_steps=0, lr=2e-3, min_lr=0.0)) == pytest.approx(2e-3)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path) -> None:
    model = _model()
    calls = {"n": 0}

    def poison(module, inputs, output):  # training forward number 8 onwards returns NaN logits
        if module.training:
            calls["n"] += 1
            if calls["n"] >= 8:
                return output * float("nan")
        return output

    model.register_forward_hook(poison)
    with pytest.raises(NonFiniteLossError, match=r"non-finite training loss \(nan\) at step 8.*step 6"):
        train(model, ArithmeticSource(), _tcfg(steps=20, ckpt_every=3, eval_every=0), out_dir=tmp_path,
                 progress=False)
    ck = load_checkpoint(tmp_path / "ckpt")
    assert ck.train_state["step"] == 6
    assert all(torch.isfinite(t).all() for t in ck.state_dict.values())
    ck.build_model()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.csv")] == list(range(1, 8))


# ------------------------------------------------------------------------------------------- run configs


def test_overrides_are_typed_and_checked() -> None:
    cfg = load_run_config("tiny", ["--model.d_model", "64", "--train.lr=5e-4", "--train.deterministic",
                                   "true", "--model.n_kv_heads", "none", "--model.lambda_init", "0.5",
                                   "--model.attn_options.qk_norm", "true", "--data.path", "123",
                                   "--train.steps", "7"])
    assert cfg.model.d_model == 64 and cfg.model.n_kv_heads is None
    assert cfg.model.attn_options == {"lambda_init": 0.5, "qk_norm": True}  # the old spelling: V1's option
    assert resolve_model_config(cfg, 65).options.qk_norm is True  # the attention type's typed options
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['window'\] for attention 'diff'"):
        resolve_model_config(load_run_config("tiny", ["--model.attn_options.window", "8"]), 65)
    assert cfg.train.lr == 5e-4 and cfg.train.deterministic is True and cfg.train.steps == 7
    assert cfg.data.path == "123" and cfg.data.tokenizer == "char"  # str fields stay strings
    assert cfg.train.batch_size == 16  # from tiny.toml; untouched fields keep their values
    with pytest.raises(ConfigError, match=r"unknown train field 'stepz'.*'steps'"):
        load_run_config("tiny", ["--train.stepz", "3"])
    with pytest.raises(ConfigError, match=r"--train.steps: expected an int, got 'many'"):
        load_run_config("tiny", ["--train.steps", "many"])
    with pytest.raises(ConfigError, match="steps must be a positive int"):
        load_run_config("tiny", ["--train.steps", "0"])
    with pytest.raises(ConfigError, match="bool"):
        load_run_config("tiny", ["--train.compile", "maybe"])
    with pytest.raises(ConfigError, match=r"unknown data field 'pth'"):
        load_run_config("tiny", ["--data.pth", "x"])
    with pytest.raises(ConfigError, match="section"):
        parse_overrides(["--lr", "3"])
    with pytest.raises(ConfigError, match="needs a value"):
        load_run_config("tiny", ["--train.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_run_config("no_such_config")
    # synthetic tasks take extra data keys as task parameters
    cfg = apply_overrides({"data": {"synthetic": "needle"}}, parse_overrides(["--data.n_needles", "2"]))
    assert cfg["data"]["n_needles"] == 2
    assert load_run_config(None, ["--data.synthetic", "needle", "--data.n_needles", "2"]).data.params == \
        {"n_needles": 2}  # in the typed config: the task's parameters


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_run_config("tiny", ["--data.path", 'we"ird\\path\n\x7f.txt']).resolve_model(65)
    as_dict = cfg.to_dict()
    back = tomllib.loads(to_toml(as_dict))
    expect = {k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
              for k, v in as_dict.items()}
    assert back == expect
    # the written file reloads as the same run config
    (tmp_path / "r.toml").write_text(to_toml(as_dict))
    again = load_run_config(str(tmp_path / "r.toml"))
    assert again == cfg and resolve_model_config(again, 65) == cfg.model


def test_resolve_model_config() -> None:
    cfg = load_run_config("tiny")
    m = resolve_model_config(cfg, 65)
    assert m.vocab_size == 65 and m.max_seq_len >= cfg.train.seq_len
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        resolve_model_config(load_run_config("tiny", ["--model.vocab_size", "10"]), 65)
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        resolve_model_config(load_run_config("tiny", ["--train.seq_len", "256"]), 65)
    with pytest.raises(ConfigError, match="n_heads"):
        resolve_model_config(load_run_config("tiny", ["--model.n_heads", "3"]), 65)


def test_every_shipped_config_builds_a_valid_model_config() -> None:
    names = packaged_configs()
    assert {"tiny", "tiny_baseline", "diff_830m", "base_830m", "diff_1.4b", "base_1.4b", "diff_3b",
            "base_3b"} <= set(names)
    resolved = {}
    for name in names:
        cfg = load_run_config(name)  # parses, checks every field name and type, builds a TrainConfig
        resolved[name] = resolve_model_config(cfg, 32000)  # ModelConfig validation; no model is instantiated
    # each DIFF config's matched baseline (twice the heads) is exactly the shipped baseline
    for diff, base in [("tiny", "tiny_baseline"), ("diff_830m", "base_830m"), ("diff_1.4b", "base_1.4b"),
                       ("diff_3b", "base_3b")]:
        assert resolved[diff].attention == "diff"
        assert matched_baseline(resolved[diff]) == resolved[base]
        assert load_run_config(diff).train == load_run_config(base).train
    m3 = resolved["diff_3b"]
    assert (m3.d_model, m3.n_layers, m3.n_heads, m3.d_model // (2 * m3.n_heads)) == (3072, 28, 12, 128)
    t3 = load_run_config("diff_3b").train
    assert (t3.seq_len, t3.lr, t3.warmup_steps, t3.beta1, t3.beta2, t3.weight_decay,
            t3.dtype) == (4096, 3.2e-4, 1000, 0.9, 0.95, 0.1, "bfloat16")
    assert (resolved["diff_830m"].d_model, resolved["diff_830m"].n_layers) == (1536, 24)
    assert (resolved["diff_1.4b"].d_model, resolved["diff_1.4b"].n_heads) == (2048, 8)


# ----------------------------------------------------------------------------------------- CLI + resume


def _write_run(tmp_path: Path) -> tuple[Path, list[str]]:
    text = "".join(f"the {w} sat on the mat; " for w in ("cat", "dog", "bird", "fox", "hen")) * 40
    (tmp_path / "corpus.txt").write_text(text)
    cfg = tmp_path / "run.toml"
    cfg.write_text("""
[model]
attention = "diff"
d_model = 32
n_layers = 1
n_heads = 2
[train]
steps = 30
batch_size = 4
seq_len = 16
lr = 3e-3
warmup_steps = 5
eval_every = 10
eval_batches = 1
log_every = 1
ckpt_every = 5
deterministic = true
seed = 11
[data]
tokenizer = "char"
""")
    return cfg, ["--data.path", str(tmp_path / "corpus.txt"), "--no-progress"]


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "diffattn", "train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ckpt_step(ckdir: Path) -> int | None:
    try:
        return json.loads((ckdir / "config.json").read_text())["train_state"]["step"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_exact_resume_after_sigkill(tmp_path: Path) -> None:
    cfg, extra = _write_run(tmp_path)
    full = _cli("--config", str(cfg), "--out", str(tmp_path / "full"), *extra)
    killed = _cli("--config", str(cfg), "--out", str(tmp_path / "killed"), *extra)
    deadline = time.time() + 120
    while (_ckpt_step(tmp_path / "killed" / "ckpt") or 0) < 5:
        assert killed.poll() is None, killed.communicate()
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    step_at_kill = load_checkpoint(tmp_path / "killed" / "ckpt").train_state["step"]
    assert 5 <= step_at_kill < 30  # killed mid-way
    # resume in this process (1 thread, like the OMP_NUM_THREADS=1 subprocesses): saves a start-up
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        assert train_main(["--config", str(cfg), "--out", str(tmp_path / "killed"), "--resume", *extra]) == 0
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    out, err = full.communicate(timeout=180)
    assert full.returncode == 0, err
    a, b = read_metrics(tmp_path / "full" / "metrics.csv"), read_metrics(tmp_path / "killed" / "metrics.csv")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 31))
    for ra, rb in zip(a, b):  # bit-for-bit: deterministic mode, same data generator state
        assert (ra["train_loss"], ra["val_loss"], ra["lr"], ra["grad_norm"]) == \
            (rb["train_loss"], rb["val_loss"], rb["lr"], rb["grad_norm"]), ra["step"]
    wa = load_checkpoint(tmp_path / "full" / "ckpt").state_dict
    wb = load_checkpoint(tmp_path / "killed" / "ckpt").state_dict
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    resolved = tomllib.loads((tmp_path / "full" / "resolved.toml").read_text())
    vocab = load_checkpoint(tmp_path / "full" / "ckpt").model_config.vocab_size
    assert resolved["model"]["vocab_size"] == vocab


def test_cli_errors(tmp_path: Path, capsys) -> None:
    cfg, extra = _write_run(tmp_path)
    assert train_main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--train.nope", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert "unknown train field 'nope'" in err and "'steps'" in err
    assert train_main(["--config", str(cfg), "--out", str(tmp_path / "o2"), "--resume", *extra]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "does not exist" in err
    assert train_main(["--out", str(tmp_path / "o3")]) == 2
    assert "--config is required" in capsys.readouterr().err


def test_bf16_autocast_on_cpu_and_fp16_fallback() -> None:
    tcfg = _tcfg(steps=2, dtype="bfloat16", eval_every=2, eval_batches=1)
    res = train(_model(), ArithmeticSource(), tcfg, progress=False)
    assert all(math.isfinite(h["train_loss"]) for h in res.history) and res.final_val_loss is not None
    with pytest.warns(UserWarning, match="float16 autocast needs CUDA"):
        train(_model(), ArithmeticSource(), _tcfg(steps=1, dtype="float16", eval_every=0), progress=False)


def test_task_classify_builds_a_classifier(tmp_path: Path, monkeypatch, capsys) -> None:
    calls = []

    def build_classifier(run, ck):
        calls.append(run)
        raise ConfigError("stop here")

    fake = types.ModuleType("diffattn.train.classify")
    fake.build_classifier = build_classifier
    monkeypatch.setitem(sys.modules, "diffattn.train.classify", fake)
    cfg = tmp_path / "c.toml"
    cfg.write_text('task = "classify"\n[model]\nd_model = 32\n'
                   '[classify]\nnum_classes = 3\npooling = "first"\n')
    assert train_main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--classify.num_classes", "4",
                       "--no-progress"]) == 2
    got, = calls
    assert got.task == "classify" and got.classify == ClassifyConfig(num_classes=4, pooling="first")
    assert got.model.d_model == 32 and "error: stop here" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before the folder was claimed
    assert train_main(["--config", "tiny", "--task", "classify", "--out", str(tmp_path / "p")]) == 2
    assert calls[-1].task == "classify"
