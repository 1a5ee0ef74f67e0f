"""Device, precision and process-group set-up for one training run: torchrun + DDP or FSDP2 (``fully_shard``),
nccl on CUDA and gloo on CPU. The loop in train.py calls these and knows no parallel engine itself."""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from diffattn.checkpoint.format import Checkpoint, CheckpointError
from diffattn.system.atomic_files import Refused, printable


@dataclass
class DistInfo:
    world: int = 1
    rank: int = 0
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


class LaunchEnvError(Refused):
    """A torchrun variable in the environment is not a usable whole number (one-line message naming it)."""


# What torchrun sets for each process; a stale or mistyped one (RANK=abc) is refused in one line, not a traceback
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")


def env_int(name: str, default: int = 0) -> int:
    """The torchrun variable ``name`` as a whole number >= 0 (``default`` when unset); LaunchEnvError otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or len(raw) > 9:
        raise LaunchEnvError(f"{name}={printable(repr(raw))} in the environment is not a process number (torchrun "
                             f"sets {', '.join(TORCHRUN_VARS[:3])}); unset it to train in one process, or start the "
                             "run with torchrun")
    return int(raw)


def check_launch_env() -> tuple[int, int]:
    """(world size, rank) from the torchrun variables, every one of them checked (:func:`env_int`)."""
    values = {n: env_int(n, 1 if n == "WORLD_SIZE" else 0) for n in TORCHRUN_VARS}
    world, rank = values["WORLD_SIZE"], values["RANK"]
    if world < 1 or rank >= world or values["MASTER_PORT"] > 65535:
        raise LaunchEnvError(f"the torchrun variables do not fit together (WORLD_SIZE={world}, RANK={rank}, "
                             f"MASTER_PORT={values['MASTER_PORT']}); unset them to train in one process, or start "
                             "the run with torchrun")
    return world, rank


RENDEZVOUS_ENV = "DIFFATTN_DIST_TIMEOUT"
RENDEZVOUS_S = 300  # how long the processes of a run wait for each other to start (torchrun starts them together)


def rendezvous_timeout() -> int:
    """Seconds the processes of a run wait for each other at the start: $DIFFATTN_DIST_TIMEOUT, else 300."""
    raw = os.environ.get(RENDEZVOUS_ENV, "").strip()
    if not raw:
        return RENDEZVOUS_S
    if not raw.isdigit() or not 0 < int(raw) <= 86400:
        raise LaunchEnvError(f"{RENDEZVOUS_ENV}={printable(repr(raw))} is not a number of seconds (1 to 86400)")
    return int(raw)


def _rendezvous(world: int, rank: int) -> dist.Store:
    """The store every process of the run meets at (MASTER_ADDR:MASTER_PORT, rank 0 serving it), waited for at
    most :func:`rendezvous_timeout` seconds, saying so first: a process started alone (WORLD_SIZE=2 and no
    second process) ends in one line, not a silent wait."""
    addr, port = os.environ.get("MASTER_ADDR", "").strip(), env_int("MASTER_PORT", 29500)
    if not addr:
        raise LaunchEnvError(f"WORLD_SIZE={world} but MASTER_ADDR is not set (torchrun sets both); unset WORLD_SIZE "
                             "to train in one process, or start the run with torchrun")
    wait = rendezvous_timeout()
    if rank == 0:
        print(f"waiting up to {wait} s for the {world - 1} other process{'es' if world > 2 else ''} of this run "
              f"(WORLD_SIZE={world}) to join at {printable(addr)}:{port} ({RENDEZVOUS_ENV} sets how long)",
              file=sys.stderr, flush=True)
    try:
        return dist.TCPStore(addr, port, world, rank == 0, timeout=timedelta(seconds=wait), wait_for_workers=True)
    except (RuntimeError, OSError) as e:  # DistStoreError, DistNetworkError: RuntimeErrors
        raise LaunchEnvError(f"rank {rank}: the run's {world} processes did not all meet at {printable(addr)}:{port} "
                             f"within {wait} s ({printable(str(e).splitlines()[0] if str(e) else type(e).__name__)}); "
                             "start every process (torchrun --nproc_per_node N), or unset WORLD_SIZE and RANK to "
                             "train in one") from None


def setup_distributed() -> DistInfo:
    """Under torchrun (WORLD_SIZE > 1) initialize the default process group: nccl on CUDA, gloo on CPU; processes
    started without torchrun meet first (:func:`_rendezvous`, bounded)."""
    world, rank = check_launch_env()
    if world <= 1:
        return DistInfo()
    here = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(env_int("LOCAL_RANK"))
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun started them all and serves the store itself
            dist.init_process_group(backend)
        else:  # started by hand (the variables set in a shell): a lone process must not wait silently
            dist.init_process_group(backend, store=_rendezvous(world, rank), rank=rank, world_size=world)
        here = True
    return DistInfo(dist.get_world_size(), dist.get_rank(), env_int("LOCAL_RANK"), here)


def device_for(dist_info: DistInfo) -> torch.device:
    return torch.device("cuda", dist_info.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def autocast_for(device: torch.device, dtype: str):
    """Autocast context and whether a GradScaler is needed. bf16 autocast works on CPU and recent GPUs; fp16
    only on CUDA (with a GradScaler); elsewhere fall back to float32 with a warning."""
    if dtype == "float32":
        return nullcontext(), False
    if dtype == "bfloat16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            warnings.warn("bfloat16 is not supported on this GPU; training in float32", stacklevel=3)
            return nullcontext(), False
        return torch.autocast(device.type, dtype=torch.bfloat16), False
    if device.type != "cuda":
        warnings.warn(
            f"float16 autocast needs CUDA (device is {device.type}); training in float32", stacklevel=3
        )
        return nullcontext(), False
    return torch.autocast("cuda", dtype=torch.float16), True


def micro_rows(x: Tensor, micro: int, dist_info: DistInfo, b: int) -> Tensor:
    start = (micro * dist_info.world + dist_info.rank) * b
    return x[start : start + b]


def all_reduce_sum(t: Tensor, dist_info: DistInfo) -> Tensor:
    if dist_info.world > 1:
        dist.all_reduce(t)
    return t


def all_reduce_max(t: Tensor, dist_info: DistInfo) -> Tensor:
    if dist_info.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def as_float(t: Tensor | float) -> float:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2 grad norm)
        t = t.full_tensor()
    return float(t)


def wrap_model(model: nn.Module, parallel: str, dist_info: DistInfo, device: torch.device) -> nn.Module:
    """DDP, or FSDP2 ``fully_shard`` on each block and then the root, when running under torchrun."""
    if dist_info.world <= 1:
        return model
    if parallel == "fsdp":
        # FSDP2 is slow to import (seconds): only under torchrun with parallel = "fsdp"
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist_info.world,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP  # only under torchrun

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    # slow to import (seconds): only under torchrun
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=True)
    try:
        set_model_state_dict(model, checkpoint.state_dict, options=opts)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{checkpoint.path}: the checkpoint weights do not fit this model: {e}") from e
    if checkpoint.optimizer_state is None:
        raise CheckpointError(f"{checkpoint.path}: no optimizer state in the checkpoint; cannot resume training")
    set_optimizer_state_dict(model, optimizer, checkpoint.optimizer_state, options=opts)
