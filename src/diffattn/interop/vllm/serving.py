"""``diffattn serve RUN``: vLLM's OpenAI-compatible server on a folder, through diffattn's plugin (:func:`serve`).

RUN is a folder vLLM reads (``diffattn export --to vllm``, a transformers DiffLlama or Llama folder), served as it
is, or any folder diffattn loads a language model from (a run folder, its ckpt/, a convert output), whose export
for vLLM is kept in the user's cache and reused while RUN is unchanged (:mod:`.export_cache`). Everything is
checked before vLLM starts, each refusal one line (:class:`ServeRefused`, exit 2): first the address (a port
another process holds is refused at once, not after vLLM's minutes of loading), then the serve extra and vLLM's
version, the model (a causal LM whose attention type has a vLLM recipe, of a size this machine can hold) and,
without CUDA, the head widths vLLM's CPU attention takes. While vLLM starts a line says what it is doing, and
another when it answers. On Linux the server dies with this process, even a SIGKILLed one (:mod:`.server_child`);
Ctrl-C or SIGTERM stops it with one SIGTERM.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from diffattn.checkpoint.folder_kind import CheckpointError, model_folder_kind
from diffattn.interop.vllm import server, version_problem
from diffattn.interop.vllm.server_child import start_child, stop_child
from diffattn.system.atomic_files import Refused, printable, read_json
from diffattn.train.signals import sigterm_raises


class ServeRefused(Refused):
    """What ``diffattn serve`` refuses before vLLM starts (one line, exit 2)."""


def check_port(host: str, port: int) -> None:
    """Refuse (ServeRefused) an address this machine cannot listen on, a port another process holds above all,
    by binding it as vLLM's server will (SO_REUSEADDR: a port left in TIME_WAIT is free) and letting it go."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ServeRefused(f"port {port} on {host} is in use by another process: stop it, or give another "
                               "--port") from None
        raise ServeRefused(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _vllm_ready(folder: Path) -> bool:
    from diffattn.interop.vllm.served import SERVED_MODEL_TYPES  # heavy (torch): after the light checks

    try:  # a FIFO or a config nested too deeply is refused (a ValueError), not waited on
        raw = read_json(folder / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in SERVED_MODEL_TYPES


def served_folder(run: str, cpu: bool, cache: Path | None = None) -> Path:
    """The folder vLLM serves for ``run``: ``run`` itself when vLLM reads it, else its export in the cache
    (``cache``, default the user's: :func:`.export_cache.cache_root`), reused while ``run`` is unchanged. Raises
    ServeRefused (one line) for what vLLM cannot serve."""
    # heavy (torch): imported once the address and vLLM's version have been checked
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.interop.vllm.export import export_vllm
    from diffattn.interop.vllm.export_cache import reuse_or_export
    from diffattn.interop.vllm.served import folder_problems, model_problems

    folder = Path(run)
    try:
        if _vllm_ready(folder):
            problems = folder_problems(folder, cpu=cpu)
        else:
            def write(out: Path) -> None:
                checkpoint = open_model_folder(run)
                model = checkpoint.build_model()
                problems = model_problems(model, cpu=cpu)
                if problems:
                    raise ServeRefused(f"vLLM cannot serve {run}: " + "; ".join(problems))
                export_vllm(model, checkpoint.tokenizer, out, provenance={"source": str(run)})

            folder, reused = reuse_or_export(run, write, cache)
            problems = folder_problems(folder, cpu=cpu) if reused else []
    except (ValueError, OSError, CheckpointError) as e:
        raise e if isinstance(e, ServeRefused) else ServeRefused(str(e)) from None
    if problems:
        raise ServeRefused(f"vLLM cannot serve {run}: " + "; ".join(problems))
    return folder


def serve(run: str, *, host: str, port: int, api_key: str | None, extra: Sequence[str], dtype: str,
          cache: Path | None = None) -> int:
    """``diffattn serve RUN``: check the address, vLLM and the model, then run vLLM's server on it until it stops
    (module docstring); -> its exit status. Raises ServeRefused (one line) before vLLM starts."""
    try:
        srv = server.server_args(host, port, api_key, extra)
    except ValueError as e:
        raise ServeRefused(str(e)) from None
    check_port(srv.host, srv.port)
    model_folder_kind(run)  # a folder that holds no model: the one message every command gives (NotAModelFolder)
    problem = version_problem()
    if problem is not None:
        raise ServeRefused(problem)
    import torch  # heavy: after the refusals that need none of it

    cpu = not torch.cuda.is_available()
    folder = served_folder(run, cpu, cache)
    name = Path(run).resolve().name
    print(printable(server.listening_line(folder, srv, name)), file=sys.stderr)
    warning = server.exposure_warning(srv)
    if warning:
        print(printable(warning), file=sys.stderr)
    print(server.STARTING, file=sys.stderr, flush=True)
    proc = start_child(server.command(str(folder), srv, dtype, name), server.environment(srv, cpu))
    watch = server.wait_ready(srv, lambda: proc.poll() is None, lambda line: print(line, file=sys.stderr, flush=True))
    try:
        with sigterm_raises():  # SIGTERM stops vLLM, as Ctrl-C does
            code = proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM (this process's only: vLLM runs in its own session)
        stop_child(proc)
        raise
    watch.join(timeout=10)  # it ends once the server is gone: its last line comes before ours
    return code
