"""`diffattn serve RUN`: vLLM's OpenAI-compatible server on a model, through diffattn's plugin.

The command line of :func:`diffattn.interop.vllm.serving.serve`, which does the work: RUN is a folder vLLM reads
(``diffattn export --to vllm``, a transformers DiffLlama or Llama folder) or any folder diffattn loads a language
model from (a run folder, its ckpt/, a convert output), exported for vLLM into the user's cache and reused while RUN
is unchanged. Everything is checked before vLLM starts, the port first, each refusal one line with exit 2.
Arguments after ``--`` go to ``vllm serve`` as they are; ``--host``, ``--port`` and ``--api-key`` among them count
as this command's (:mod:`diffattn.interop.vllm.server`), so the address printed is the one vLLM listens on.
"""

from __future__ import annotations

import argparse

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


def run(args: argparse.Namespace) -> int:
    """``diffattn serve RUN``: the library checks, exports (or reuses the export) and runs vLLM's server."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.interop.vllm.serving import serve

    return serve(args.run, host=args.host, port=args.port, api_key=getattr(args, "api_key", None),
                 extra=args._extra, dtype=args.dtype)
