"""Sizes that would exhaust the machine (issue 32): a checkpoint, config.json or TOML asking for 10¹² positions,
d_model 10⁷, a vocabulary of 10⁹ or 10⁶ layers is refused by every loader in one line, exit 2, naming the size and
the need, before anything is allocated or built (counting the model builds one block on the meta device); `plan`
answers such a config, and refuses a nonsensical machine; a refused resume changes nothing in its folder; `info`
says when a checkpoint's config disagrees with its weights; torchrun variables and the cache folder are checked."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import run_main
from faultinject import tiny_run
from hostile import ENTRY_POINTS, copy_run, llama_folder, one_line_refusal, run_entry, set_config, train_tiny, tree

import diffattn.model.blocks as blocks
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import ModelTooLarge, check_fits, footprint, human_bytes
from diffattn.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

# The sizes, made large enough to exceed any machine's memory (a 10⁹ vocabulary or 10⁶ layers of these tiny
# blocks would fit in 128 GB, and the test would then build them)
HUGE = {"max_seq_len": {"max_seq_len": 10**12}, "d_model": {"d_model": 10**7, "n_heads": 1},
        "vocab_size": {"vocab_size": 10**10}, "n_layers": {"n_layers": 10**8}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("sizes"))


@pytest.fixture
def few_blocks(monkeypatch):
    """Counts the blocks built: a refusal must not have built the model (at most the one block it counts)."""
    built: list[int] = []
    real = blocks.Block.__init__

    def init(self, cfg, layer_idx):
        built.append(layer_idx)
        real(self, cfg, layer_idx)

    monkeypatch.setattr(blocks.Block, "__init__", init)
    return built


@pytest.mark.parametrize("size", sorted(HUGE))
@pytest.mark.parametrize("point", ENTRY_POINTS)
def test_a_checkpoint_asking_for_too_much_memory_is_refused_by_every_loader(run, tmp_path, few_blocks, point, size):
    """main: a traceback after trying to allocate up to 400 TB (info printed the config; resume also rewrote
    resolved.toml)."""
    folder = copy_run(run, tmp_path / "r")
    set_config(folder / "ckpt", **HUGE[size])
    before = tree(folder)
    r = run_entry(point, folder, tmp_path)
    err = one_line_refusal(r, "needs", "of memory", "this machine has", f"{list(HUGE[size].values())[0]:,}")
    assert tree(folder) == before  # resolved.toml included
    assert len(few_blocks) <= 2, err  # one block counted (a classifier's or a KV cache's check: one more)


@pytest.mark.parametrize("size", sorted(HUGE))
def test_a_toml_asking_for_too_much_memory_is_refused_before_the_data_is_read(tmp_path, few_blocks, size):
    cfg, corpus = tiny_run(tmp_path)
    key, value = next((k, v) for k, v in HUGE[size].items())
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", tmp_path / "out", f"--model.{key}",
                 value, *(f"--model.{k}={v}" for k, v in HUGE[size].items() if k != key))
    one_line_refusal(r, "train: the model", "needs")
    assert not (tmp_path / "out").exists() and len(few_blocks) <= 1


def test_a_transformers_config_asking_for_too_much_is_refused(tmp_path, few_blocks):
    src = llama_folder(tmp_path / "llama", max_position_embeddings=10**12, vocab_size=10**9)
    few_blocks.clear()  # the folder's own model
    one_line_refusal(run_main("convert", src, "--to", "diff", "--out", tmp_path / "out"), "needs", "1,000,000,000")
    assert len(few_blocks) <= 1


def test_a_shape_beyond_64_bits_is_one_line(run, tmp_path):
    folder = copy_run(run, tmp_path / "r")
    set_config(folder / "ckpt", d_model=10**10, n_heads=1)
    one_line_refusal(run_main("info", folder), "too large to build on any machine")


def test_the_count_is_the_built_models(make_config):
    for kw in ({}, {"attention": "standard", "tie_embeddings": False}, {"attention": "dint"}, {"attention": "alibi"}):
        cfg = make_config(**kw)
        model = TransformerLM(cfg)
        fp = footprint(cfg, kv_batch=2)
        assert fp.params == model.num_params()
        assert fp.weights == 4 * model.num_params()
        model.setup_cache(2)
        kv = sum(b.numel() * b.element_size() for blk in model.blocks for b in blk.attn.cache.buffers())
        assert fp.kv_cache == kv


def test_check_fits_names_the_size_and_the_need(make_config):
    cfg = make_config(max_seq_len=10**12)
    with pytest.raises(ModelTooLarge, match=r"^X: the model \(2 layers, d_model 32, vocab_size 50, max_seq_len "
                                            r"1,000,000,000,000\) needs .* TB of memory .*; this machine has .* "
                                            "available$"):
        check_fits(cfg, "X")
    check_fits(make_config(), "X", training=True, kv_batch=4)  # a tiny model fits
    assert [human_bytes(n) for n in (512, 1500, 2.5e9, 3.2e13, 1e24)] == ["512 bytes", "1.5 kB", "2.5 GB", "32 TB",
                                                                       "1.0e+24 bytes"]


def test_the_kv_cache_is_counted_before_it_is_allocated(make_config):
    model = TransformerLM(make_config())
    with pytest.raises(ModelTooLarge, match="the KV cache: .* needs"):
        model.setup_cache(10**9)  # 10⁹ sequences of 32 tokens


def test_info_says_when_the_config_disagrees_with_the_weights(run, tmp_path):
    folder = copy_run(run, tmp_path / "r")
    set_config(folder / "ckpt", n_layers=3)
    one_line_refusal(run_main("info", folder), "config and its weights disagree",
                     "the config describes 3 layers, but the weights hold 1")
    set_config(folder / "ckpt", n_layers=1, d_model=24, n_heads=1)
    one_line_refusal(run_main("info", folder), "has shape")
    r = run_main("generate", folder, "--prompt", "the")  # the loaders say the same in one line
    one_line_refusal(r, "weights do not match the model config", "has shape")


# ------------------------------------------------------------------------------------------------ plan


def test_plan_answers_a_config_of_a_million_layers(tmp_path, few_blocks, capsys):
    cfg, _ = tiny_run(tmp_path)
    toml = tmp_path / "deep.toml"
    toml.write_text(cfg.read_text().replace("n_layers = 1", "n_layers = 1000000"))
    r = run_main("plan", "--config", toml, "--gpus", "8", "--gpu-memory-gb", "80")  # main: minutes, 6.8 GB
    assert r.returncode == 0, r.stderr
    assert "1000000 layers" in r.stdout and "no" in r.stdout.split("budget")[0]
    assert len(few_blocks) <= 10  # a one-block count, three traced blocks, a few more for the batch search


@pytest.mark.parametrize("args", [["--gpu-memory-gb", "nan"], ["--gpu-memory-gb", "inf"], ["--gpu-memory-gb", "-1"],
                                  ["--gpus", str(10**20)], ["--seq-len", "0"]])
def test_plan_refuses_a_nonsensical_machine(args):
    one_line_refusal(run_main("plan", "--config", "tiny", *args), args[0])


def test_plan_counts_the_same_with_one_block_traced():
    from diffattn.train.plan import count_params, plan

    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=5, n_heads=2, max_seq_len=64)
    counts = count_params(cfg)
    assert counts["total"] == TransformerLM(cfg).num_params()
    p = plan(cfg, batch_size=2, seq_len=32, world=2, gpu_memory_gb=1, activation_checkpointing="full")
    deep = plan(cfg.replace(n_layers=50), batch_size=2, seq_len=32, world=2, gpu_memory_gb=1,
                activation_checkpointing="full")
    assert p.layouts["ddp"].blocks[1:4] == [p.layouts["ddp"].blocks[1]] * 3  # the middle blocks are alike
    assert deep.layouts["ddp"].peak > p.layouts["ddp"].peak and deep.max_batch["ddp"] < p.max_batch["ddp"]


# ----------------------------------------------------------------------------------- environment, cache


@pytest.mark.parametrize("var,value", [("RANK", "abc"), ("WORLD_SIZE", "two"), ("LOCAL_RANK", "-1"),
                                       ("MASTER_PORT", "99999"), ("RANK", "3")])
def test_a_malformed_torchrun_variable_is_one_line(tmp_path, monkeypatch, var, value):
    cfg, corpus = tiny_run(tmp_path)
    monkeypatch.setenv(var, value)
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", tmp_path / "out")  # main: ValueError
    one_line_refusal(r, "unset them" if value in ("99999", "3") else var, "torchrun")
    assert not (tmp_path / "out").exists()


def test_a_cache_folder_that_is_a_file_names_its_setting(tmp_path, monkeypatch):
    data = tmp_path / "recs.jsonl"
    data.write_text("".join(json.dumps({"text": "the quick brown fox"}) + "\n" for _ in range(50)))
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("DIFFATTN_CACHE_DIR", str(tmp_path / "afile"))
    cfg, _ = tiny_run(tmp_path)
    r = run_main("train", "--config", cfg, "--data.path", data, "--out", tmp_path / "out")
    one_line_refusal(r, "afile is a file", "DIFFATTN_CACHE_DIR")  # main: "[Errno 17] File exists"
    monkeypatch.delenv("DIFFATTN_CACHE_DIR")
    r = run_main("train", "--config", cfg, "--data.path", data, "--out", tmp_path / "out",
                 "--data.cache_dir", tmp_path / "afile" / "sub")
    one_line_refusal(r, "--data.cache_dir")


def test_eval_refuses_a_kv_cache_or_model_too_large_for_the_device(run, tmp_path):
    """The device's own memory is what counts on a GPU (CUDA: its free memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    free = torch.cuda.mem_get_info()[0]
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
    with pytest.raises(ModelTooLarge, match="cuda"):
        check_fits(cfg, "X", kv_batch=int(free // 1000), device="cuda")


def test_a_resume_refused_after_it_started_leaves_the_folder_as_it_was(run, tmp_path):
    """A refusal that comes only when the checkpoint is restored (a model override that does not fit its
    weights): resolved.toml, rewritten at the start, is put back (main left the refused command's config)."""
    folder = copy_run(run, tmp_path / "r")
    before = tree(folder)
    r = run_main("train", "--out", folder, "--resume", "--model.d_model", "24", "--no-progress")
    assert r.returncode == 2 and "has shape" in r.stderr.strip().splitlines()[-1]
    assert tree(folder) == before
