"""Hangs and exhaustion (issue 39): a config of a million thin layers, a FIFO where a file is read, a thread count
no machine has, a data file of 30 GB or one that is binary from its first byte, a process told it has a peer that
never comes. Each ends in one line, exit 2, within seconds, before anything is written or read whole."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import SRC, run_main
from faultinject import tiny_run
from hostile import copy_run, one_line_refusal, run_entry, set_config, train_tiny, tree

import diffattn.model.blocks as blocks
from diffattn.interop.vllm.served import folder_problems

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("hangs"))


@pytest.fixture
def few_blocks(monkeypatch) -> list[int]:
    """The blocks built: a refusal may count one (on the meta device), never build the model."""
    built: list[int] = []
    real = blocks.Block.__init__

    def init(self, *a, **kw):
        built.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(blocks.Block, "__init__", init)
    return built


# ------------------------------------------------------------------------------------------ the build cost


def test_a_toml_of_a_million_thin_layers_is_refused_before_anything_is_built(tmp_path, few_blocks):
    """main: train printed nothing and grew to 3.2 GB until killed at 120 s (the memory check counted bytes)."""
    cfg, corpus = tiny_run(tmp_path)
    toml = tmp_path / "deep.toml"
    toml.write_text(cfg.read_text().replace("d_model = 16", "d_model = 2\nffn_hidden = 2")
                    .replace("n_layers = 1", "n_layers = 1000000").replace('"diff"', '"standard"'))
    t0 = time.monotonic()
    r = run_main("train", "--config", toml, "--data.path", corpus, "--out", tmp_path / "out")
    one_line_refusal(r, "1,000,000 layers", "modules to build", "diffattn builds at most 200,000")
    assert time.monotonic() - t0 < 30 and len(few_blocks) <= 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("point", ["generate", "resume", "eval", "info"])
def test_a_checkpoint_of_300000_thin_layers_is_refused_by_every_reader(run, tmp_path, few_blocks, point):
    """main: generate hung at 6.5 GB, train --resume at 4.4 GB, eval ended in SystemError at 8 GB."""
    folder = copy_run(run, tmp_path / "r")
    set_config(folder / "ckpt", n_layers=300_000, d_model=4, n_heads=1, ffn_hidden=2, attention="standard")
    before = tree(folder)
    few_blocks.clear()
    r = run_entry(point, folder, tmp_path)
    one_line_refusal(r, "300,000 layers", "modules to build")
    assert len(few_blocks) <= 1 and tree(folder) == before


# ------------------------------------------------------------------------------------------ not a regular file


def test_a_fifo_as_data_or_config_is_refused_not_waited_on(tmp_path):
    """main: a FIFO named x.jsonl made train hang (a FIFO .txt was refused)."""
    cfg, _ = tiny_run(tmp_path)
    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)
    one_line_refusal(run_main("train", "--config", cfg, "--data.path", fifo, "--out", tmp_path / "o"),
                     "x.jsonl is not a regular file (a FIFO)")
    os.mkfifo(tmp_path / "run.toml.fifo")
    one_line_refusal(run_main("train", "--config", tmp_path / "run.toml.fifo", "--out", tmp_path / "o"),
                     "is not a regular file (a FIFO)")
    assert not (tmp_path / "o").exists()


def test_a_fifo_config_in_a_folder_to_serve_is_refused_before_vllm_starts(tmp_path):
    """main: serve hung before vLLM started. The check needs no vLLM: it runs before vLLM is touched."""
    from diffattn.interop.vllm.serving import served_folder

    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    with pytest.raises(ValueError):  # not a vLLM folder, then not a folder diffattn reads: one line each
        served_folder(str(folder), cpu=True, cache=tmp_path / "cache")
    assert folder_problems(folder) == [f"{folder / 'config.json'} cannot be read as JSON ({folder / 'config.json'} "
                                       "is not a regular file (a FIFO); diffattn reads files)"]


def test_eval_refuses_a_fifo_as_its_data(run, tmp_path):
    os.mkfifo(tmp_path / "data.txt")
    one_line_refusal(run_main("eval", run, "--data", tmp_path / "data.txt", "--what", "ppl"), "not a regular file")


# ------------------------------------------------------------------------------------------ the machine's bounds


@pytest.mark.parametrize("command", ["train", "eval", "generate", "compare", "study"])
def test_a_thread_count_beyond_the_machine_is_refused_before_anything_is_written(tmp_path, command):
    """main: libgomp tried to allocate 216 GB, exit 1, and left a folder holding .diffattn.lock and resolved.toml."""
    r = run_main(command, "--threads", "1000000000", "--out", tmp_path / "out")
    one_line_refusal(r, f"--threads must be at most {os.cpu_count()} (this machine's CPUs), got 1000000000")
    assert not (tmp_path / "out").exists()


def _sparse(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def test_a_30_gb_data_file_is_refused_by_its_size_before_it_is_read(tmp_path, run, monkeypatch):
    """main: MemoryError in train after 53 s, and in eval."""
    big = _sparse(tmp_path / "big.txt", 30 * 10**9, b"the quick brown fox. " * 4000)
    reads: list[Path] = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")
    cfg, _ = tiny_run(tmp_path)
    t0 = time.monotonic()
    one_line_refusal(run_main("train", "--config", cfg, "--data.path", big, "--out", tmp_path / "o"),
                     "30 GB of text input is read whole", "available", "records")
    one_line_refusal(run_main("eval", run, "--data", big, "--what", "ppl"), "30 GB of text input")
    assert time.monotonic() - t0 < 60 and reads == [] and not (tmp_path / "o").exists()


def test_a_binary_data_file_is_refused_by_its_first_bytes(tmp_path, monkeypatch):
    """main: a 2 GB file was read whole (2.5 GB RSS) before the NUL at offset 0 was refused."""
    nul = _sparse(tmp_path / "zeros.txt", 2 * 10**9)
    reads: list[Path] = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")
    cfg, _ = tiny_run(tmp_path)
    one_line_refusal(run_main("train", "--config", cfg, "--data.path", nul, "--out", tmp_path / "o"),
                     "NUL byte at byte offset 0")
    assert reads == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_process_whose_peers_never_come_says_what_it_waits_for_and_gives_up(tmp_path):
    """main: WORLD_SIZE=2 RANK=0 with MASTER_ADDR set and no second process waited silently (torch: 30 min)."""
    cfg, corpus = tiny_run(tmp_path)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DIFFATTN_DIST_TIMEOUT": "2"}
    r = subprocess.run([sys.executable, "-m", "diffattn", "train", "--config", str(cfg), "--data.path", str(corpus),
                        "--out", str(tmp_path / "o"), "--no-progress"], env=env, capture_output=True, text=True,
                       timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 2, r.stderr
    assert lines[0] == (f"waiting up to 2 s for the 1 other process of this run (WORLD_SIZE=2) to join at "
                        f"127.0.0.1:{port} (DIFFATTN_DIST_TIMEOUT sets how long)")
    assert lines[1].startswith(f"error: rank 0: the run's 2 processes did not all meet at 127.0.0.1:{port} within 2 s")
    assert not (tmp_path / "o").exists()
