"""Initialising a model in place, so that a large one can be built without memory first.

Build on the meta device (shapes only), shard it with FSDP2 or move it for DDP, then :func:`materialize`:
``to_empty`` allocates each rank's share, and the model's ``init_weights()`` writes the values. No rank ever
holds the whole fp32 model before sharding.

``init_weights()`` replays what the constructors did, in the order they did it: every module's own
``reset_parameters()`` (children before their parent, the order in which the constructors created parameters
and drew random numbers), then the GPT-2 initialisation. So for a given torch seed it gives exactly the
weights, buffers and RNG state of a model built eagerly on one process. A parameter that is sharded (DTensor) or
not on the CPU is initialised as a full CPU tensor, one parameter at a time, and its shard copied in; the values
therefore do not depend on the world size or the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _own_tensors(module: nn.Module) -> list[tuple[str, Tensor, bool]]:
    """(name, tensor, is_parameter) for the module's own parameters and buffers (not its children's)."""
    out = [(n, p, True) for n, p in module._parameters.items() if p is not None]
    return out + [(n, b, False) for n, b in module._buffers.items() if b is not None]


def copy_into(target: Tensor, full: Tensor) -> None:
    """Copy a full tensor into ``target``: its shard when ``target`` is a DTensor."""
    if _is_dtensor(target):
        # torch.distributed.tensor is slow to import and only needed for a sharded (FSDP2) model
        from torch.distributed.tensor import distribute_tensor

        mesh = target.device_mesh
        # src_data_rank=None: every rank holds the same full tensor and keeps its own slice (no communication)
        local = distribute_tensor(full.to(mesh.device_type), mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


@contextmanager
def full_tensors(module: nn.Module, *, discard: bool = False) -> Iterator[None]:
    """Within the block, ``module``'s own parameters and buffers are full, plain CPU tensors; on exit their
    values are copied back (into each rank's shard under FSDP2). When they already are plain CPU tensors this
    changes nothing. ``discard``: use fresh full tensors and drop their values on exit (to draw the random
    numbers of a tied weight, which another module initialises, without overwriting it)."""
    own = _own_tensors(module)
    if not discard and all(t.device.type == "cpu" and not _is_dtensor(t) for _, t, _ in own):
        yield
        return
    originals = []
    for name, t, is_param in own:
        full = torch.empty(t.shape, dtype=t.dtype)
        if is_param:
            module._parameters[name] = nn.Parameter(full, requires_grad=t.requires_grad)
        else:
            module._buffers[name] = full
        originals.append((name, t, is_param))
    ok = False
    try:
        yield
        ok = True
    finally:
        for name, t, is_param in originals:
            table = module._parameters if is_param else module._buffers
            full = table[name]
            table[name] = t
            if ok and not discard:
                with torch.no_grad():
                    copy_into(t, full.detach())


def replay_init(module: nn.Module) -> None:
    """Call ``reset_parameters()`` on every module under ``module`` that holds parameters or buffers itself,
    children before their parent: the order in which their constructors created them. A module holding tensors
    without a ``reset_parameters()`` is a TypeError (it could not be built on the meta device).

    A module whose constructor did not create its tensors in that order (one that replaces a child its parent
    class built) defines ``reset_subtree()`` instead: it replays its whole constructor, children included."""
    subtree = getattr(module, "reset_subtree", None)
    if subtree is not None:
        with torch.no_grad(), ExitStack() as stack:
            for m in module.modules():
                stack.enter_context(full_tensors(m))
            subtree()
        return
    for child in module.children():
        replay_init(child)
    own = _own_tensors(module)
    if not own:
        return
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        names = ", ".join(n for n, _, _ in own)
        raise TypeError(f"{type(module).__name__} holds {names} but has no reset_parameters(), so it cannot be "
                        "initialised in place (built on the meta device); give it one that does what its "
                        "constructor does")
    with torch.no_grad(), full_tensors(module):
        reset()


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built without memory)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device (and possibly FSDP2-sharded) model on ``device`` and initialise it in place with
    its ``init_weights()``: for the current torch seed, the values of a model built eagerly. Returns it."""
    model.to_empty(device=device)
    init = getattr(model, "init_weights", None)
    if init is None:
        raise TypeError(f"{type(model).__name__} has no init_weights(): it cannot be initialised in place")
    init()
    return model
