"""docs/howto/families.md runs as written (issue 40): its Python blocks as scripts in a new process, its
``diffattn`` commands in this one, in page order, in one scratch folder. (The docs tests of issue 43 run every page
the same way; this one keeps the page honest until they do.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import run_main

pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "families.md"


def _steps(text: str) -> list[tuple[str, str]]:
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang == "python":
            out.append(("python", body))
        elif lang == "bash":
            for line in re.sub(r"[ \t]*\\\n\s*", " ", body).splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                if line:
                    out.append(("shell", line))
    return out


@pytest.mark.slow
def test_the_families_page_runs_as_written(tmp_path: Path, one_thread) -> None:
    steps = _steps(PAGE.read_text(encoding="utf-8"))
    assert [k for k, _ in steps].count("shell") >= 6
    env = {**os.environ, "PYTHONPATH": str(PAGE.parents[2] / "src")}
    for kind, text in steps:
        if kind == "python":
            res = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=600)
            assert res.returncode == 0, f"{text}\n{res.stderr[-3000:]}"
            continue
        argv = shlex.split(text)
        assert argv[0] == "diffattn", text
        r = run_main(*argv[1:], cwd=tmp_path)
        assert r.returncode == 0, f"{text}\n{r.stderr[-3000:]}"
        if "--check" in argv and argv[1] == "convert":
            assert float(r.stdout.split("vs transformers (Qwen2ForCausalLM, fp32):")[1].split()[0]) < 1e-4
