"""A package ready to publish (issue 23, item 4): `python -m build` makes a wheel and an sdist from a copy of the
checkout; each installs into a fresh virtual environment and, run from a folder outside the checkout, imports,
answers `diffattn --version`, finds its packaged configs inside the installed package, and (the wheel) runs
`diffattn compare --quick`. The metadata names the license, the project URLs and classifiers."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import diffattn

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "src" / "diffattn" / "configs").glob("*.toml"))
SKIP = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", "runs", "reports", ".venv",
                              ".pytest_cache", ".ruff_cache")


def _copy_checkout(dest: Path) -> Path:
    """The files git tracks (or, outside a git checkout, the tree without build outputs), so building never
    writes into the checkout (setuptools leaves build/ and *.egg-info behind)."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=SKIP)
        return dest
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _run(argv: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the installed package
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{argv}\n--- stdout:\n{res.stdout[-2000:]}\n--- stderr:\n{res.stderr[-3000:]}"
    return res


def _smoke(venv: Path, cwd: Path) -> None:
    """Import from the venv (not the checkout, not another install), the version, the packaged configs."""
    py, exe = venv / "bin" / "python", venv / "bin" / "diffattn"
    code = ("import diffattn, sys; from diffattn.configs.packaged import config_path, packaged_configs; "
            "print(diffattn.__file__); print(config_path('tiny')); print(','.join(sorted(packaged_configs())))")
    where, tiny, names = _run([py, "-c", code], cwd).stdout.split()
    root = str(venv.resolve())
    assert where.startswith(root) and tiny.startswith(root), (where, tiny)
    assert sorted(n + ".toml" for n in names.split(",")) == CONFIGS
    assert _run([exe, "--version"], cwd).stdout.split()[:2] == ["diffattn", diffattn.__version__]


def _venv_seeing_this_environment(venv: Path, cwd: Path) -> None:
    """A fresh venv whose own site-packages takes the package, and which finds torch and the other dependencies
    where this interpreter finds them (nothing is downloaded), through a .pth file naming this environment's
    site-packages folders. That holds wherever the test runs: a venv (where ``--system-site-packages`` would see
    the base interpreter's, without torch), a system install or a user site. The venv's own site-packages comes
    first on sys.path, so its diffattn is the one imported (``_smoke`` checks)."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd).stdout.strip())
    here = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    dirs = [d for d in dict.fromkeys(here) if Path(d).is_dir() and Path(d).resolve() != purelib.resolve()]
    (purelib / "_test_environment.pth").write_text("".join(f"{d}\n" for d in dirs))
    _run([py, "-c", "import torch, numpy, safetensors, tokenizers"], cwd)  # the dependencies resolve


@pytest.mark.slow  # 30 s of CPU (35-75 s wall on a busy 2-core machine): a build, two installs, compare --quick
def test_wheel_and_sdist_build_install_and_run_outside_the_checkout(tmp_path):
    pytest.importorskip("build", reason="the `build` package is not installed (pip install build)")
    src = _copy_checkout(tmp_path / "checkout")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], tmp_path)
    wheel, = dist.glob("diffattn-*.whl")
    sdist, = dist.glob("diffattn-*.tar.gz")
    assert wheel.name.startswith(f"diffattn-{diffattn.__version__}-py3-none-any")

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"diffattn-{diffattn.__version__}.dist-info"
        meta = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {f"diffattn/configs/{c}" for c in CONFIGS} <= names
    assert f"{info}/licenses/LICENSE" in names
    assert "License-Expression: MIT" in meta and "Project-URL: Repository" in meta and "Classifier:" in meta
    assert "diffattn = diffattn.cli.main:main" in entry_points
    assert "[lm_eval.models]" in entry_points
    with tarfile.open(sdist) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    assert {"LICENSE", "CHANGELOG.md", "pyproject.toml", "src/diffattn/configs/tiny.toml"} <= members

    venv, cwd = tmp_path / "venv", tmp_path / "elsewhere"
    cwd.mkdir()
    _venv_seeing_this_environment(venv, tmp_path)
    # This environment's pip installs into the venv (--python), which needs no pip or setuptools of its own.
    # --force-reinstall: the venv also sees this environment's own diffattn (an editable install, same version),
    # which pip leaves alone (outside the venv) but would otherwise take as already installed.
    pip = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet", "--no-deps",
           "--no-index", "--force-reinstall"]
    _run([*pip, wheel], cwd)
    _smoke(venv, cwd)
    _run([venv / "bin" / "diffattn", "compare", "--quick", "--out", cwd / "quick"], cwd)
    assert (cwd / "quick" / "report.md").is_file()

    _run([*pip, "--no-build-isolation", sdist], cwd)  # the sdist builds and installs too
    _smoke(venv, cwd)
