"""The engine layer imports nothing above it (docs/architecture.md: imports only go down): not the API (llm.py), the
server, the command line, the evaluation or the benchmarks; a worker rank's process builds its rank from engine/
alone (engine/rank.py)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import flash_dllm

PACKAGE = Path(flash_dllm.__file__).parent
ABOVE_ENGINE = ("llm", "serve", "cli", "eval", "bench")


def imported_modules(path: Path, package: str) -> set[str]:
    """The absolute names a module of `package` imports, in functions too (`from .. import x`: x as a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) + 1 - node.level]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def is_above_engine(name: str) -> bool:
    return any(name == f"flash_dllm.{top}" or name.startswith(f"flash_dllm.{top}.") for top in ABOVE_ENGINE)


def test_no_engine_module_imports_a_layer_above_it():
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        above = sorted(filter(is_above_engine, imported_modules(path, "flash_dllm.engine")))
        assert not above, f"engine/{path.name} imports {', '.join(above)}"


def test_the_tensor_parallel_modules_load_without_the_api():
    """In a fresh interpreter, with a bare package standing in for flash_dllm/__init__.py (which imports the API for
    its users): importing the engine's tensor-parallel modules loads no module above the engine."""
    code = f"""if True:
        import json, sys, types
        package = types.ModuleType("flash_dllm")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["flash_dllm"] = package
        import flash_dllm.engine.rank, flash_dllm.engine.tensor_parallel, flash_dllm.engine.worker
        print(json.dumps(sorted(name for name in sys.modules if name.startswith("flash_dllm."))))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = json.loads(run.stdout.splitlines()[-1])
    assert "flash_dllm.engine.tensor_parallel" in loaded
    assert not [name for name in loaded if is_above_engine(name)]
