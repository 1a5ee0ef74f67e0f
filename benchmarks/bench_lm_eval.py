"""lm-evaluation-harness on diffattn runs, and the same tasks under transformers: `--model diffattn` on each run
against `--model hf` on its `diffattn export` folder, on local tasks built from a text file.

    python benchmarks/bench_lm_eval.py RUN [RUN ...] --text input.txt --out bench-lm-eval
    # needs the `eval` extra and transformers + accelerate (for --model hf)

For each run: the export's max |Δlogits| (fp32, 2 × 64 random ids) and, per task, every metric under both models
with its relative difference and the wall time of each evaluation. The tasks are written into OUT/tasks (YAML over
JSONL, nothing downloaded) from the last tenth of the text: `text_ppl` (rolling perplexity over --docs passages),
`text_next_line` (multiple choice: a line's true next line among 4, acc) and `text_complete` (the next line's
first word, greedy until a space or a line break, exact match; diffattn only: lm-eval's hf model needs an EOS
token for generate_until, and diffattn's tokenizers have none). Results: OUT/results.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

import diffattn.interop.lm_harness  # noqa: F401  (registers --model diffattn)
from diffattn import load_pretrained_tokenizer
from diffattn.checkpoint.model_folders import open_model_folder
from diffattn.interop.hf_export import check_export, export_hf

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
{body}"""


def write_tasks(text: str, out: Path, docs: int, items: int, seed: int = 0) -> list[str]:
    """The three tasks over the last tenth of ``text`` (module docstring); returns their names."""
    held = text[int(len(text) * 0.9):]
    lines = [ln for ln in held.splitlines() if len(ln.split()) >= 3]
    rng = random.Random(seed)
    size = len(held) // docs
    passages = [held[i * size:(i + 1) * size].strip() for i in range(docs)]
    starts = rng.sample(range(len(lines) - 1), items)
    mc, gen = [], []
    for i in starts:
        wrong = rng.sample([ln for j, ln in enumerate(lines) if j not in (i, i + 1)], 3)
        answer = rng.randrange(4)
        mc.append({"context": lines[i], "choices": wrong[:answer] + [lines[i + 1]] + wrong[answer:], "answer": answer})
        gen.append({"context": lines[i], "word": lines[i + 1].split()[0]})
    out.mkdir(parents=True, exist_ok=True)
    files = {"ppl": [{"text": p} for p in passages], "mc": mc, "gen": gen}
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bodies = {
        "text_ppl": ("ppl", "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                     "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                     "  - metric: bits_per_byte\n"),
        "text_next_line": ("mc", "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ntarget_delimiter: \"\\n\"\n"
                           "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n"
                           "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"),
        "text_complete": ("gen", "output_type: generate_until\ndoc_to_text: \"{{context}}\\n\"\n"
                          "doc_to_target: '{{word}}'\ntarget_delimiter: ''\ngeneration_kwargs:\n"
                          "  until: [' ', \"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
                          "metric_list:\n  - metric: exact_match\n"),
    }
    for name, (data, body) in bodies.items():
        (out / f"{name}.yaml").write_text(YAML.format(name=name, data=(out / f"{data}.jsonl").resolve(), body=body))
    return list(bodies)


def evaluate(model: str, args: dict, tasks: list[str], tm: TaskManager, batch_size: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=tm, batch_size=batch_size,
                                  bootstrap_iters=0, log_samples=False, device="cpu")
    return res["results"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="diffattn run folders (standard or diff attention, char or BPE)")
    ap.add_argument("--text", required=True, help="the text the tasks are cut from (its last tenth)")
    ap.add_argument("--out", required=True, help="folder for the tasks, the exports and results.json")
    ap.add_argument("--docs", type=int, default=20, help="passages of the perplexity task")
    ap.add_argument("--items", type=int, default=100, help="items of the multiple-choice and generation tasks")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    out = Path(args.out)
    names = write_tasks(Path(args.text).read_text(encoding="utf-8"), out / "tasks", args.docs, args.items)
    tm = TaskManager(include_path=str(out / "tasks"), include_defaults=False)
    results = {}
    for run in args.runs:
        ck = open_model_folder(run)
        model, tok = ck.build_model().eval(), ck.tokenizer
        hf_dir = out / f"hf-{Path(run).name}"
        export_hf(model, tok, hf_dir, provenance={"source": run})
        check = check_export(model, tok, hf_dir)
        prefix = load_pretrained_tokenizer(run).encode("\n")[0]
        ours, t_ours = evaluate("diffattn", {"pretrained": run}, names, tm, args.batch_size)
        theirs, t_hf = evaluate("hf", {"pretrained": str(hf_dir), "dtype": "float32", "prefix_token_id": prefix},
                                names[:2], tm, args.batch_size)
        results[run] = {"attention": model.config.attention, "export": check, "diffattn": ours, "hf": theirs,
                        "seconds": {"diffattn (3 tasks)": t_ours, "hf (2 tasks)": t_hf}}
        print(f"\n{run} ({model.config.attention}): export max |Δlogits| {check['max_abs_logits']:.3g}, "
              f"tokenizer ids {'same' if check['same_ids'] else 'DIFFERENT'}; wall: diffattn {t_ours:.1f} s "
              f"(3 tasks), hf {t_hf:.1f} s (2 tasks)")
        print("| task | metric | --model diffattn | --model hf | relative difference |\n|---|---|---|---|---|")
        for task in names:
            for key, value in ours[task].items():
                if not isinstance(value, float) or "stderr" in key:
                    continue
                other = theirs.get(task, {}).get(key)
                rel = f"{abs(value - other) / max(abs(other), 1e-12):.1e}" if other is not None else "n/a"
                shown = f"{other:.6g}" if other is not None else "n/a"
                print(f"| {task} | {key.split(',')[0]} | {value:.6g} | {shown} | {rel} |")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
