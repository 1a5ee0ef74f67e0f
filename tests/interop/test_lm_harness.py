"""lm-evaluation-harness (issue 23, item 2): ``--model diffattn`` evaluates any folder load_pretrained reads, every
attention type, on tasks defined by local YAML over local JSONL files (a multiple-choice task, a rolling-perplexity
task, a generation task), offline. Each request type is checked against its definition computed here one request
at a time; for models that export to transformers, ``--model hf`` on the exported folder gives the same numbers
and transformers' own greedy generate gives the same generations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from diffattn.attention.registry import ATTENTION  # noqa: E402
from diffattn.checkpoint.format import save_checkpoint  # noqa: E402
from diffattn.interop.lm_harness import DiffattnLM  # noqa: E402  (registers --model diffattn)
from diffattn.model.config import ModelConfig  # noqa: E402
from diffattn.model.generate import generate  # noqa: E402
from diffattn.model.tokenizer import build_tokenizer  # noqa: E402
from diffattn.model.transformer import TransformerClassifier, TransformerLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "the cat sat on a mat and dog ran to log but soft what light through yonder window breaks".split()
CONTEXT = 24  # tokens: some texts below span several rolling windows


def _texts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def _yaml(name: str, data: Path, cache: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {cache}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """Three tasks over JSONL files: multiple choice (acc), rolling perplexity, generation until a stop string."""
    d = tmp_path_factory.mktemp("tasks")
    cache = d / "hf-datasets-cache"
    q, a = _texts(6, 1, 2, 0), _texts(18, 1, 1, 1)  # question + answer fit in the context
    mc = [{"question": q[i], "choices": a[3 * i:3 * i + 3], "answer": i % 3} for i in range(6)]
    ppl = [{"text": t} for t in _texts(2, 1, 4, 2) + _texts(2, 9, 14, 3)]  # short, and several windows long
    gen = [{"prompt": t, "answer": "the"} for t in _texts(5, 1, 4, 4)]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "t_mc.yaml").write_text(_yaml("t_mc", d / "mc.jsonl", cache, (
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")))
    (d / "t_ppl.yaml").write_text(_yaml("t_ppl", d / "ppl.jsonl", cache, (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")))
    (d / "t_gen.yaml").write_text(_yaml("t_gen", d / "gen.jsonl", cache, (
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['t', 'o']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")))
    return d


TOKENIZER = build_tokenizer("char", " \n" + "".join(WORDS))


def _run_folder(tmp_path: Path, attention: str, tokenizer=TOKENIZER, **kw) -> tuple[Path, TransformerLM]:
    torch.manual_seed(0)
    n_heads = 2 if ATTENTION[attention].head_split == 2 else 4
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=n_heads, attention=attention,
                      max_seq_len=CONTEXT, init_std=0.3, **kw)
    model = TransformerLM(cfg).eval()
    run = tmp_path / attention
    save_checkpoint(run / "ckpt", model, tokenizer=tokenizer, train_state={"step": 1},
                    run_config={"task": "lm", "model": cfg.to_dict()})
    return run, model


def _evaluate(model: str, model_args: dict, tasks: Path, names=("t_mc", "t_ppl", "t_gen")) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(names),
                                   task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                   batch_size=3,
                                   bootstrap_iters=0, log_samples=True, device="cpu")


@torch.no_grad()
def _logprob(model: TransformerLM, context: list[int], cont: list[int]) -> float:
    """log p(cont | context), one plain forward (the inputs here fit in the context)."""
    seq = context + cont
    assert len(seq) - 1 <= CONTEXT
    logp = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0].double(), -1)
    return sum(logp[j - 1, seq[j]].item() for j in range(len(context), len(seq)))


def _cut(text: str, until: list[str]) -> str:
    for u in until:
        text = text.split(u)[0]
    return text


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_every_attention_type_answers_each_request_type_by_its_definition(tmp_path, tasks, attention):
    run, model = _run_folder(tmp_path, attention)
    res = _evaluate("diffattn", {"pretrained": str(run)}, tasks)
    enc, nl = TOKENIZER.encode, TOKENIZER.encode("\n")  # the default prefix token: the line break
    for s in res["samples"]["t_mc"]:
        for (ctx, cont), [(score, _)] in zip(s["arguments"], s["resps"]):
            whole, c = enc(ctx + cont), enc(ctx)
            assert math.isclose(score, _logprob(model, c, whole[len(c):]), rel_tol=1e-5, abs_tol=1e-5)
    for s in res["samples"]["t_ppl"]:
        ids = enc(s["arguments"][0][0])
        if len(ids) <= CONTEXT:  # one window: every token given the prefix and the tokens before it
            assert math.isclose(s["resps"][0][0], _logprob(model, nl, ids), rel_tol=1e-5, abs_tol=1e-5)
    assert any(len(enc(s["arguments"][0][0])) > CONTEXT for s in res["samples"]["t_ppl"])
    for s in res["samples"]["t_gen"]:
        prompt, kw = s["arguments"][0]
        alone = TOKENIZER.decode(generate(model, enc(prompt), 6, temperature=0))
        assert s["resps"][0][0] == _cut(alone, kw["until"])
    assert {"t_mc", "t_ppl", "t_gen"} <= set(res["results"])
    assert 0 <= res["results"]["t_mc"]["acc,none"] <= 1 and res["results"]["t_ppl"]["bits_per_byte,none"] > 0


def _assert_same_numbers(ours: dict, theirs: dict, what: str) -> None:
    """Every float metric of t_mc and t_ppl, and every request's score, the same under both models."""
    print(f"{what}: t_mc acc diffattn {ours['results']['t_mc']['acc,none']:.4f}, "
          f"hf {theirs['results']['t_mc']['acc,none']:.4f}")
    for task in ("t_mc", "t_ppl"):
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert math.isclose(value, theirs["results"][task][key], rel_tol=1e-5), (task, key)
        assert len(ours["samples"][task]) == len(theirs["samples"][task]) > 0
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            for x, y in zip(a["resps"], b["resps"]):
                got, want = (x[0][0], y[0][0]) if task == "t_mc" else (x[0], y[0])
                assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("attention", ["standard", "diff", "diff_v2"])
def test_diffattn_and_hf_on_the_exported_folder_give_the_same_numbers(tmp_path, tasks, attention):
    """Llama, DiffLlama and a custom-code export (trust_remote_code). Our tokenizers have no BOS/EOS, and lm-eval
    0.4.13's hf model decodes its prefix token (BOS, else EOS) on every encode: without ``prefix_token_id`` it
    fails with ``TypeError: 'None' is not an instance of 'Sequence'``. The id `--model diffattn` uses by default
    (the line break's) is what the export's model card tells lm-eval; the export makes none up (a named line
    break would be dropped by skip_special_tokens decodes: test_hf_export.py). Issue 51."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate")
    from diffattn.cli.main import main  # the export command (issue 23, item 1)

    run, model = _run_folder(tmp_path, attention, rope="neox")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", "--out", str(out)]) == 0
    prefix = TOKENIZER.encode("\n")[0]
    custom = attention not in ("standard", "diff")
    card = (out / "README.md").read_text()
    assert f"prefix_token_id={prefix}" in card and ("trust_remote_code=True" in card) == custom
    if attention == "standard" and lm_eval.__version__ == "0.4.13":  # the cause, as that release has it
        with pytest.raises(TypeError, match="'None' is not an instance of 'Sequence'"):
            _evaluate("hf", {"pretrained": str(out), "dtype": "float32"}, tasks, ("t_mc",))
    ours = _evaluate("diffattn", {"pretrained": str(run)}, tasks, ("t_mc", "t_ppl"))
    theirs = _evaluate("hf", {"pretrained": str(out), "dtype": "float32", "prefix_token_id": prefix,
                              **({"trust_remote_code": True} if custom else {})}, tasks, ("t_mc", "t_ppl"))
    _assert_same_numbers(ours, theirs, attention)
    # generate_until: transformers' greedy generate on the exported model (lm-eval's hf model needs an EOS
    # token for generate_until, and our tokenizers have none)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=custom).eval()
    gen = _evaluate("diffattn", {"pretrained": str(run)}, tasks, ("t_gen",))
    for s in gen["samples"]["t_gen"]:
        prompt, kw = s["arguments"][0]
        ids = torch.tensor([TOKENIZER.encode(prompt)])
        with torch.no_grad():
            new = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert s["resps"][0][0] == _cut(TOKENIZER.decode(new), kw["until"])


def _bos_tokenizer():
    """An HF tokenizer (a converted model's kind) whose post-processor adds a BOS, as a converted Llama's does."""
    from tokenizers import processors  # only this test builds one

    from diffattn.model.tokenizer import HFTokenizer

    bpe = build_tokenizer("bpe", " \n".join(WORDS * 4), vocab_size=300).tok
    bpe.add_special_tokens(["<s>"])
    bos = ("<s>", bpe.token_to_id("<s>"))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return HFTokenizer(bpe)


@pytest.mark.parametrize("attention", ["standard", "diff", "diff_v2"])
def test_hf_needs_no_prefix_argument_when_the_tokenizer_has_a_bos(tmp_path, tasks, attention):
    """Issue 51: an export whose tokenizer adds a BOS names it ``bos_token``, so plain ``--model hf`` (no
    ``prefix_token_id``) conditions a text's first token on the BOS, as ``--model diffattn`` does on the run, and
    both give the same numbers: Llama, DiffLlama and a custom-code export."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate")
    from diffattn.cli.main import main

    tok = _bos_tokenizer()
    run, _ = _run_folder(tmp_path, attention, tokenizer=tok, rope="neox")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", "--out", str(out)]) == 0
    assert "prefix_token_id" not in (out / "README.md").read_text()
    custom = attention not in ("standard", "diff")
    ours = _evaluate("diffattn", {"pretrained": str(run)}, tasks, ("t_mc", "t_ppl"))
    theirs = _evaluate("hf", {"pretrained": str(out), "dtype": "float32",
                              **({"trust_remote_code": True} if custom else {})}, tasks, ("t_mc", "t_ppl"))
    _assert_same_numbers(ours, theirs, attention)
    bos = tok.tok.token_to_id("<s>")
    ctx, cont = ours["samples"]["t_mc"][0]["arguments"][0]
    assert tok.encode(ctx + cont)[0] == bos  # the runs scored texts that start with the BOS


def test_what_cannot_be_evaluated_is_a_clear_error(tmp_path):
    cfg = ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
                      attention="standard")
    TransformerClassifier(cfg, num_classes=2).save_pretrained(tmp_path / "cls", tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="evaluates language models"):
        DiffattnLM(pretrained=str(tmp_path / "cls"))
    TransformerLM(cfg).save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="no tokenizer"):
        DiffattnLM(pretrained=str(tmp_path / "bare"))
    TransformerLM(cfg).save_pretrained(tmp_path / "lm", tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="dtype"):
        DiffattnLM(pretrained=str(tmp_path / "lm"), dtype="float8")
    with pytest.raises(ValueError, match="max_length"):
        DiffattnLM(pretrained=str(tmp_path / "lm"), max_length=17)
    lm = DiffattnLM(pretrained=str(tmp_path / "lm"), prefix_token_id=3, batch_size="auto", max_batch_size=5)
    assert (lm.prefix_token_id, lm.batch_size, lm.max_gen_toks, lm.max_length) == (3, 5, 8, 16)


def test_a_char_model_meeting_an_unseen_character_is_one_line(tmp_path, tasks, monkeypatch, capsys):
    """The harness on a task with a character the char model never saw: an error naming it (not a traceback
    from deep inside lm-eval), and the command line prints it as one line and exits 2."""
    import diffattn.interop.lm_harness as harness

    run, _ = _run_folder(tmp_path, "standard")
    (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "the cat sat on a mat \u00e9"}) + "\n")
    (tmp_path / "t_odd.yaml").write_text(_yaml("t_odd", tmp_path / "odd.jsonl", tmp_path / "cache", (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n")))
    with pytest.raises(harness.UnscorableText, match=r"'\u00e9' \(U\+00E9\).*own alphabet") as e:
        lm_eval.simple_evaluate(model="diffattn", model_args={"pretrained": str(run)}, tasks=["t_odd"],
                                task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                bootstrap_iters=0, device="cpu")
    import lm_eval.__main__ as lm_eval_cli

    def evaluate_raising() -> None:
        raise e.value

    monkeypatch.setattr(lm_eval_cli, "cli_evaluate", evaluate_raising)
    capsys.readouterr()  # the harness's own progress lines above
    with pytest.raises(SystemExit) as done:
        harness.main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and err.startswith("error: character '\u00e9' (U+00E9)"), err


@pytest.mark.slow  # lm-eval's command line indexes its ~10k built-in task files first (10-20 s here)
def test_the_command_line_runs_a_local_task(tmp_path, tasks):
    """`python -m diffattn.interop.lm_harness` takes lm_eval's own arguments, with --model diffattn known."""
    from clirun import run_diffattn

    run, _ = _run_folder(tmp_path, "diff")
    res = run_diffattn("--model", "diffattn", "--model_args", f"pretrained={run}", "--tasks", "t_mc",
                       "--include_path", tasks, "--batch_size", "2", "--limit", "2", "--device", "cpu",
                       module="diffattn.interop.lm_harness", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "t_mc" in res.stdout and "acc" in res.stdout


def test_the_entry_point_names_the_model_class():
    """pyproject's `lm_eval.models` entry point (what lm-eval releases with plugin discovery read) resolves."""
    import importlib

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["lm_eval.models"]["diffattn"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is DiffattnLM


def test_generate_until_truncates_to_the_context_batches_and_samples_reproducibly(tmp_path):
    from lm_eval.api.instance import Instance

    run, model = _run_folder(tmp_path, "diff_v2")
    long = " ".join(WORDS) * 3  # three times the context: only its last CONTEXT - 4 tokens are seen

    def ask(lm, kwargs, prompts):
        return lm.generate_until([Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(prompts)],
                                 disable_tqdm=True)

    prompts = [long, "the cat", "a", "yonder window"]
    greedy = {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}
    one = DiffattnLM(pretrained=str(run), batch_size=1)
    three = DiffattnLM(pretrained=str(run), batch_size=3)
    got = ask(three, greedy, prompts)
    assert got == ask(one, greedy, prompts)
    for p, text in zip(prompts, got):
        ids = TOKENIZER.encode(p)[-(CONTEXT - 4):]
        assert text == _cut(TOKENIZER.decode(generate(model, ids, 4, temperature=0)), ["\n"])
    sampled = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 1.5, "top_k": 10}
    draws = [ask(DiffattnLM(pretrained=str(run), batch_size=2, seed=7), sampled, prompts) for _ in range(2)]
    assert draws[0] == draws[1] and all(len(TOKENIZER.encode(t)) == 6 for t in draws[0])
    with pytest.raises(ValueError, match="does not know"):
        ask(one, {"until": [], "max_gen_toks": 2, "num_beams": 4}, ["a"])
    with pytest.raises(ValueError, match="less than the context"):
        ask(one, {"until": [], "max_gen_toks": CONTEXT}, ["a"])
