"""`diffattn serve RUN`: vLLM's OpenAI-compatible server on a model, through diffattn's plugin.

RUN is a folder vLLM reads (``diffattn export --to vllm``, a transformers DiffLlama or Llama folder) or any
folder diffattn loads a language model from (a run folder, its ckpt/, a convert output): that one is exported
for vLLM first, into a temporary folder removed when the server stops. Everything is checked before vLLM
starts, each refusal one line with exit 2: the serve extra and vLLM's version, the model (a causal LM whose
attention type has a vLLM recipe, of a size this machine can hold) and, without CUDA, the head widths vLLM's
CPU attention takes. Arguments after ``--`` go to ``vllm serve`` as they are; ``--host``, ``--port`` and
``--api-key`` among them count as this command's (:mod:`diffattn.interop.vllm.server`), so the address printed is
the one vLLM listens on, and a server open beyond this machine without an API key is warned about. While vLLM
starts (minutes on a CPU) a line says what it is doing, and another when it answers. On Linux the server dies with
this process, even a SIGKILLed one (:mod:`.serve_child`); Ctrl-C or SIGTERM stops it with one SIGTERM.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from diffattn.cli.options import model_folder_refused, usage_error
from diffattn.cli.serve_child import start_child, stop_child
from diffattn.fileio import printable, read_json
from diffattn.train.signals import sigterm_raises

DESCRIPTION = "Serve a model with vLLM's OpenAI-compatible server (diffattn's vLLM plugin; the serve extra)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a vLLM folder (diffattn export --to vllm, a DiffLlama or Llama folder) or any "
                               "folder diffattn loads a language model from (exported for vLLM on the fly)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only; "
                   "0.0.0.0: every interface, which warns unless --api-key is set)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key of every request under /v1 (Authorization: Bearer KEY); given to vLLM in "
                        "its environment. To keep the key out of the process list altogether, set VLLM_API_KEY "
                        "instead of this option")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto, float32, bfloat16, float16)")
    # after --: vLLM's own arguments, passed on as they are (e.g. -- --max-num-seqs 32)
    p.set_defaults(_accepts_extra=True)
    p.epilog = "Arguments after -- go to vLLM's OpenAI server as they are, e.g. -- --max-num-seqs 32."


def _vllm_ready(folder: Path) -> bool:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.interop.vllm.served import SERVED_MODEL_TYPES

    try:  # a FIFO or a config nested too deeply is refused (a ValueError), not waited on
        raw = read_json(folder / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in SERVED_MODEL_TYPES


def prepare(run: str, cpu: bool) -> tuple[Path, Path | None]:
    """The folder vLLM serves for ``run`` and the temporary folder to remove afterwards (or None). Raises
    ValueError / CheckpointError (one line) for what vLLM cannot serve."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.interop.vllm.export import export_vllm
    from diffattn.interop.vllm.served import folder_problems, model_problems

    folder = Path(run)
    if _vllm_ready(folder):
        problems = folder_problems(folder, cpu=cpu)
        if problems:
            raise ValueError(f"vLLM cannot serve {run}: " + "; ".join(problems))
        return folder, None
    checkpoint = open_model_folder(run)
    model = checkpoint.build_model()
    problems = model_problems(model, cpu=cpu)
    if problems:
        raise ValueError(f"vLLM cannot serve {run}: " + "; ".join(problems))
    tmp = Path(tempfile.mkdtemp(prefix="diffattn-serve-"))
    try:
        export_vllm(model, checkpoint.tokenizer, tmp / "model", provenance={"source": str(run)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp / "model", tmp


def run(args: argparse.Namespace) -> int:
    from diffattn.interop.vllm import version_problem  # light: reads vLLM's version without importing it

    # refusals first, before torch is imported: the folder given, then this machine's vLLM
    if (refused := model_folder_refused(args.run)) is not None:
        return refused
    problem = version_problem()
    if problem is not None:
        return usage_error(problem)
    # the library: imported when the command runs (--help imports no torch), after the refusals above
    import torch

    from diffattn.checkpoint.format import CheckpointError  # (the library, as above)
    from diffattn.interop.vllm import server  # the library: imported when the command runs (as above)

    cpu = not torch.cuda.is_available()
    try:
        srv = server.server_args(args.host, args.port, getattr(args, "api_key", None), args._extra)
        folder, tmp = prepare(args.run, cpu)
    except (ValueError, OSError, CheckpointError) as e:
        return usage_error(str(e))
    name = Path(args.run).resolve().name
    try:
        return _serve(server, srv, folder, name, args.dtype, cpu)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _serve(server: Any, srv: Any, folder: Path, name: str, dtype: str, cpu: bool) -> int:
    """Start vLLM's server on ``folder`` and wait for it, saying where it listens and when it answers; Ctrl-C or
    SIGTERM stop it (one SIGTERM, :func:`stop_child`) before the caller removes an exported folder."""
    print(printable(server.listening_line(folder, srv, name)), file=sys.stderr)
    warning = server.exposure_warning(srv)
    if warning:
        print(printable(warning), file=sys.stderr)
    print(server.STARTING, file=sys.stderr, flush=True)
    proc = start_child(server.command(str(folder), srv, dtype, name), server.environment(srv, cpu))
    watch = server.wait_ready(srv, lambda: proc.poll() is None, lambda line: print(line, file=sys.stderr, flush=True))
    try:
        with sigterm_raises():  # SIGTERM stops vLLM and removes the export, as Ctrl-C does
            code = proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM (this process's only: vLLM runs in its own session)
        stop_child(proc)
        raise
    watch.join(timeout=10)  # it ends once the server is gone: its last line comes before ours
    return code
