"""The vLLM server as a child that dies with ``diffattn serve``.

``diffattn serve`` stops vLLM itself on Ctrl-C and SIGTERM, but a parent killed with SIGKILL (``kill -9``, the
OOM killer) runs no code: its child would keep serving, holding the port and memory. On Linux the child asks
the kernel, between fork and exec, to send it SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
SIGTERM rather than SIGKILL so that vLLM's server shuts down its own engine processes as on any SIGTERM. On
other systems nothing changes: the child is started as before and outlives a SIGKILLed parent.

The kernel ties the signal to the thread that forked the child: :func:`start_child` must be called from a
thread that lives as long as the parent (``diffattn serve``: the main thread).

The child runs in a session of its own, so a Ctrl-C at the terminal reaches ``diffattn serve`` alone, which then
stops the server with one SIGTERM (:func:`stop_child`): vLLM shuts its engine processes down in order, instead of
each of them getting the SIGINT at once (the engine dying under the server is what printed an ``EngineDeadError``
traceback). A server that has not ended after :data:`STOP_WAIT_S` seconds is killed with its session.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Sequence

from diffattn.system.child_process import parent_death_signal


def _die_with_parent_hook() -> Callable[[], None] | None:
    """The function a child runs before exec so that it gets SIGTERM when its parent dies (Linux), or None."""
    arm = parent_death_signal()  # looked up here: the forked child only calls it
    if arm is None:
        return None
    parent = os.getpid()

    def hook() -> None:
        if not arm(signal.SIGTERM):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def start_child(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` as a child process, in a session of its own, that, on Linux, is sent SIGTERM when this
    process dies, SIGKILL included. Call it from a thread that lives as long as this process (module docstring)."""
    return subprocess.Popen(list(cmd), env=env, preexec_fn=_die_with_parent_hook(), start_new_session=True)


STOP_WAIT_S = 60.0  # vLLM's own shutdown waits for its engine processes; past this, they are killed


def stop_child(proc: subprocess.Popen, wait_s: float = STOP_WAIT_S) -> int:
    """Stop the child with one SIGTERM and wait for it; after ``wait_s`` seconds kill its whole session (its own
    children too). -> its exit status."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        return proc.wait()
