"""The plugin inside a real vLLM (issue 33; marked vllm): the CPU head widths it checks are vLLM's; tensor
parallelism over 2 CPU workers splits DINT's diff-heads (V1's [K1|K2] layout, and both of its attention layers),
ALiBi's slopes and the sinks (the values our code picks by rank) and gives the same greedy tokens; and `diffattn serve`
answers an OpenAI completion request with diffattn's greedy text, then stops with the server.

Each tensor-parallel engine costs 50-80 s on the shared 2-core machine (two spawned workers import vLLM), so
only those three run: V2's head pairs, gated attention's gate and GDA's groups are split with the query heads by
construction (a head count tensor parallelism does not divide is refused at start-up) and are not run here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from servecases import TEXT, close, engine, export_case, tiny_model, tokenizer

from diffattn.interop.vllm.served import CPU_HEAD_SIZES
from diffattn.model.generate import generate

pytestmark = pytest.mark.vllm
SRC = Path(__file__).resolve().parents[2] / "src"


def test_cpu_head_sizes_are_vllm_s(vllm):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dint", "alibi", "sink"])
def test_tensor_parallel_2_gives_the_same_tokens(vllm, tmp_path, monkeypatch, case):
    """Two CPU workers (one core each; vLLM's CPU build binds them only when told which cores)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tok = tokenizer()
    model = tiny_model(case, tok.vocab_size)
    ids = tok.encode(TEXT)
    batch = [ids[:20], ids[30:75]]
    llm = engine(vllm, export_case(case, model, tok, tmp_path / case), "float32", tensor_parallel_size=2,
                 distributed_executor_backend="mp")
    try:
        outs = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in batch],
                            vllm.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    finally:
        close(llm)
    for prompt, out in zip(batch, outs):
        assert list(out.outputs[0].token_ids) == generate(model, prompt, 10, temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_diffattn_serve_answers_openai_requests(vllm, tmp_path):
    from diffattn.checkpoint.format import save_checkpoint

    tok = tokenizer()
    model = tiny_model("diff", tok.vocab_size)
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", model, tokenizer=tok, train_state={"step": 1},
                    run_config={"task": "lm", "model": model.config.to_dict()})
    port = _free_port()
    # one unbound OpenMP thread in vLLM's processes, as this process runs its engines (conftest.py)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "diffattn", "serve", str(run), "--port", str(port), "--dtype",
                             "float32", "--", "--enforce-eager", "--max-model-len", "128", "--kv-cache-memory-bytes",
                             str(32 << 20)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        body = _complete(port, proc, {"prompt": "ROMEO: But", "max_tokens": 8, "temperature": 0})
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
    want = tok.decode(generate(model, tok.encode("ROMEO: But"), 8, temperature=0))
    text = (tmp_path / "serve.log").read_text()
    assert body["choices"][0]["text"] == want, text[-2000:]
    served = Path(text.split("serving ", 1)[1].split(" with vLLM", 1)[0])
    # the export is kept in diffattn's cache (the tests' own, conftest.py) for the next start, not in the run
    from diffattn.interop.vllm.export_cache import cache_root

    assert served.is_relative_to(cache_root()) and (served / "config.json").is_file(), served
    assert not served.is_relative_to(run), "serve wrote into the folder it serves"


def _complete(port: int, proc: subprocess.Popen, request: dict) -> dict:
    """POST /v1/completions once the server is up (polling /health; bounded, and never past the server's
    end)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(1)
    assert proc.poll() is None, "diffattn serve stopped before it served"
    models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30))
    assert [m["id"] for m in models["data"]] == ["run"]  # the run folder's name, not a temporary path
    data = json.dumps({"model": "run", **request}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
