"""The wheel: built from the source tree without downloads, it holds every file of the package (the embedded model,
the task data, the kernels' tables), the license and the console script; installed on its own, it generates."""
from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flash_dllm

ROOT = Path(__file__).parents[1]
DIST_INFO = f"flash_dllm-{flash_dllm.__version__}.dist-info"
PROMPT = ("Tom has 3 apples. Anna has 4 more apples than Tom. Anna buys 5 more apples. "
          "How many apples does Anna have now?")


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, args[:4]))} ...: exit {result.returncode}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the files the wheel is made of, so that the build's scratch (build/, egg-info) stays
    out of the checkout; without build isolation or an index, so nothing is downloaded (setuptools comes from
    the test extra)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", out,
        source)
    [wheel] = out.glob("flash_dllm-*.whl")
    return wheel


def test_wheel_holds_the_package_license_and_console_script(wheel):
    package = ROOT / "src" / "flash_dllm"
    sources = {f"flash_dllm/{p.relative_to(package).as_posix()}" for p in package.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert sources - names == set()  # package data included: the model, the task data, the kernels' json
        assert {"flash_dllm/assets/default/model.safetensors", "flash_dllm/assets/default/config.json",
                "flash_dllm/assets/default/tokenizer.json", "flash_dllm/tasks/data/arith.jsonl.gz"} <= names
        assert z.read(f"{DIST_INFO}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert "License-Expression: Apache-2.0" in z.read(f"{DIST_INFO}/METADATA").decode().splitlines()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(f"{DIST_INFO}/entry_points.txt").decode())
    assert dict(entry_points["console_scripts"]) == {"flash-dllm": "flash_dllm.cli:main"}


def test_installed_wheel_generates_with_the_embedded_model(wheel, tmp_path):
    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target, wheel)
    # The console script pip wrote, run isolated from the checkout (-I: no PYTHONPATH, no working directory on
    # sys.path) with the installed copy ahead of the editable install on sys.path.
    code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import flash_dllm; "
            "print('flash_dllm:', flash_dllm.__file__, file=sys.stderr); sys.argv = sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = run(sys.executable, "-I", "-c", code, target, target / "bin" / "flash-dllm", "generate",
                 "--max-tokens", "64", "--no-progress", PROMPT, cwd=tmp_path)
    assert f"flash_dllm: {target / 'flash_dllm' / '__init__.py'}" in result.stderr.splitlines()
    assert "#### 12" in result.stdout, result.stdout
