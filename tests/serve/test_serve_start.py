"""How ``diffattn serve`` starts and stops vLLM's server, tested without vLLM (issue 39): the address it really
listens on (``-- --host 0.0.0.0`` wins, as in vLLM), a warning when that is beyond this machine and no API key is
set, ``--api-key`` passed in the server's environment, the size check of every reader before vLLM starts, a line
while it starts and one when it answers, and a stop that is one SIGTERM to a server in its own session."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from clirun import run_main

from diffattn.interop.vllm import server
from diffattn.interop.vllm.served import folder_problems
from diffattn.interop.vllm.server_child import start_child, stop_child

WAIT = 60.0  # a bound for a loaded machine; every wait below ends on an event


def test_the_address_given_after_the_separator_is_the_one_printed():
    """main: `serve FOLDER -- --host 0.0.0.0` printed http://127.0.0.1:8000/v1 while vLLM listened on every
    interface."""
    s = server.server_args("127.0.0.1", 8000, None, ["--", "--host", "0.0.0.0", "--max-num-seqs", "4",
                                                     "--port=9001"], env={})
    assert (s.host, s.port, s.api_key, s.extra) == ("0.0.0.0", 9001, None, ["--max-num-seqs", "4"])
    assert server.listening_line("m", s, "tiny") == ("serving m with vLLM on http://0.0.0.0:9001/v1 (every interface) "
                                                     "(model name 'tiny')")
    assert server.url(server.server_args("::", 8000, None, [], env={})) == "http://[::]:8000/v1"
    with pytest.raises(ValueError, match="not a port number"):
        server.server_args("127.0.0.1", 8000, None, ["--port", "http"], env={})


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("::", None, True), ("example.org", None, True),
                                             ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
                                             ("::1", None, False), ("localhost", None, False)])
def test_a_server_open_beyond_this_machine_without_a_key_is_warned_about(host, key, warned):
    warning = server.exposure_warning(server.server_args(host, 8000, key, [], env={}))
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith(f"warning: vLLM listens on {host} (not only this machine) with no API key")


def test_the_api_key_goes_to_vllm_in_its_environment_not_its_command_line():
    s = server.server_args("0.0.0.0", 8000, "s3cret", [], env={})
    cmd, env = server.command("/m", s, "auto", "tiny"), server.environment(s, cpu=True, base={})
    assert "s3cret" not in " ".join(cmd) and env["VLLM_API_KEY"] == "s3cret" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--served-model-name") + 1] == "tiny"
    given = server.server_args("0.0.0.0", 8000, None, ["--api-key", "k2"], env={})  # vLLM's own flag, after --
    assert given.api_key == "k2" and server.exposure_warning(given) is None
    assert server.command("/m", given, "auto", "t")[-4:-2] == ["--api-key", "k2"]  # left to vLLM as given
    assert server.server_args("0.0.0.0", 8000, None, [], env={"VLLM_API_KEY": "k3"}).api_key == "k3"


def _vllm_folder(tmp: Path, **config: object) -> Path:
    folder = tmp / "v"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("sizes", [{"vocab_size": 10**9}, {"n_layers": 10**6}], ids=["vocab-1e9", "layers-1e6"])
def test_a_vllm_folder_too_large_for_this_machine_is_refused_before_vllm_starts(tmp_path, sizes):
    """main: passed the pre-start check and failed inside vLLM with four tracebacks."""
    cfg = {"vocab_size": 256, "d_model": 64, "n_layers": 1, "n_heads": 2, "attention": "standard", **sizes}
    folder = _vllm_folder(tmp_path, model_type="diffattn", diffattn_class="TransformerLM", config=cfg)
    problems = folder_problems(folder)
    assert len(problems) == 1 and problems[0].startswith("vLLM: the model") and (
        "of memory" in problems[0] or "modules to build" in problems[0]), problems


def test_a_llama_folder_is_checked_for_its_size_only(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
             "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 64,
             "rope_scaling": {"rope_type": "llama3"}, "hidden_act": "silu"}  # settings vLLM serves itself
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    assert folder_problems(_vllm_folder(tmp_path / "a", vocab_size=100, **llama)) == []
    problems = folder_problems(_vllm_folder(tmp_path / "b", vocab_size=10**10, **llama))
    assert len(problems) == 1 and "of memory" in problems[0]


# ------------------------------------------------------------------------------------------ start and stop

FAKE_VLLM = """
import http.server, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        if self.path == "/health":
            self.server.answered = True
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), Health)
srv.answered = False
while not srv.answered:  # a server that answers /health once, then stops as vLLM would on its SIGTERM
    srv.handle_request()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_says_where_it_listens_and_when_the_server_answers(tmp_path, monkeypatch):
    """The whole command, a stand-in server in vLLM's place: the lines in order, and what vLLM was given; the
    second start serves the same export (not written again), a changed run a new one."""
    import diffattn.interop.vllm.serving as serving
    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.configs.run_config import RunConfig
    from diffattn.model.config import ModelConfig
    from diffattn.model.transformer import TransformerLM

    cfg = ModelConfig(vocab_size=20, d_model=64, n_layers=1, n_heads=2, attention="standard", max_seq_len=16)
    save_checkpoint(tmp_path / "tiny", TransformerLM(cfg), run_config=RunConfig.of_model(cfg))
    started: list[tuple[list[str], dict]] = []

    def start(cmd, env=None):
        started.append((cmd, env))
        return start_child([sys.executable, "-c", FAKE_VLLM, *cmd[cmd.index("--port"):]], env)

    monkeypatch.setattr(serving, "version_problem", lambda: None)
    monkeypatch.setattr(serving, "start_child", start)
    monkeypatch.setenv("DIFFATTN_CACHE_DIR", str(tmp_path / "cache"))
    port = _free_port()
    r = run_main("serve", tmp_path / "tiny", "--", "--host", "0.0.0.0", "--port", port)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("serving ") and f"on http://0.0.0.0:{port}/v1 (every interface)" in lines[0]
    assert lines[1].startswith("warning: vLLM listens on 0.0.0.0 (not only this machine) with no API key")
    assert lines[2].startswith("starting vLLM: it loads the model") and "not a hang" in lines[2]
    assert lines[3].startswith("vLLM is ready after ") and f"http://0.0.0.0:{port}/v1" in lines[3]
    cmd, env = started[0]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd.count("--host") == 1 and "VLLM_API_KEY" not in env
    export = Path(cmd[cmd.index("--model") + 1])
    assert export.is_relative_to(tmp_path / "cache") and (export / "config.json").is_file()
    written = {p.name: p.stat().st_mtime_ns for p in export.iterdir()}
    assert run_main("serve", tmp_path / "tiny", "--port", _free_port()).returncode == 0  # started again: reused
    again = Path(started[1][0][started[1][0].index("--model") + 1])
    assert again == export and {p.name: p.stat().st_mtime_ns for p in export.iterdir()} == written
    save_checkpoint(tmp_path / "tiny", TransformerLM(cfg), run_config=RunConfig.of_model(cfg))  # the run changed
    assert run_main("serve", tmp_path / "tiny", "--port", _free_port()).returncode == 0
    changed = Path(started[2][0][started[2][0].index("--model") + 1])
    assert changed != export and changed.is_dir() and not export.exists()  # a new export; the stale one went
    assert [p.parent for p in (tmp_path / "cache").rglob("config.json")] == [changed]  # one export per run


def test_a_port_another_process_holds_is_refused_in_one_line_before_vllm(tmp_path, monkeypatch):
    """main: `serve RUN --port 8000` with the port taken failed after 128 s, exit 1, with a 39-line traceback
    (OSError: [Errno 98] Address already in use) from inside vLLM. The check comes first: no vLLM, no model."""
    import diffattn.interop.vllm.serving as serving

    monkeypatch.setattr(serving, "start_child", lambda *a, **k: pytest.fail("vLLM was started"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_main("serve", tmp_path / "no-such-run", "--port", port)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: port {port} on 127.0.0.1 is in use by another process: stop "
                                             "it, or give another --port"]
    assert not (tmp_path / "no-such-run").exists()


def _wait_for_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, "the child died before it was ready"
    return line


def test_the_server_runs_in_its_own_session_and_stops_on_one_sigterm():
    proc = start_child([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert os.getsid(proc.pid) == proc.pid  # a terminal's Ctrl-C reaches `diffattn serve` alone
        assert stop_child(proc, wait_s=WAIT) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_server_that_ignores_sigterm_is_killed_with_its_session():
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
              "print(c.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        grandchild = int(_wait_for_line(proc))
        assert stop_child(proc, wait_s=1.0) == -signal.SIGKILL
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and _alive(grandchild):
            time.sleep(0.05)
        assert not _alive(grandchild)  # the engine processes go with it
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_ready_watch_says_so_once_the_server_answers():
    said: list[str] = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        args = server.server_args("0.0.0.0", srv.server_address[1], None, [], env={})
        server.wait_ready(args, lambda: True, said.append, poll_s=0.05).join(WAIT)
    finally:
        srv.shutdown()
    assert len(said) == 1 and said[0].startswith("vLLM is ready after ")


def test_the_top_level_help_names_both_export_targets():
    r = run_main("--help")
    line = " ".join(r.stdout.split())
    assert "export a run: --to hf, a transformers folder (Llama / DiffLlama); --to vllm, a folder vLLM serves" in line
