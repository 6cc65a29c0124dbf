"""Hub repo ids resolved through huggingface_hub's cache, offline, and the errors of resolve_checkpoint."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from flash_dllm import LLM, SamplingParams
from flash_dllm.llm import default_model_path
from flash_dllm.models import resolve_checkpoint
from flash_dllm.models.hub import CHECKPOINT_FILES
from conftest import tiny_config, write_checkpoint

REPO = "flash-dllm-test/tiny-llada"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, files: Path, commit: str = COMMIT) -> Path:
    """Lay out `files` as huggingface_hub caches a download of `repo_id` at `commit` (its main branch): contents
    under blobs/ by their etag (an LFS file's sha256, another file's git blob sha1), snapshots/<commit>/ of
    relative symlinks to them, refs/main holding the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / etag).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / etag)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline: HF_HUB_CACHE and HF_HUB_OFFLINE=1 as huggingface_hub holds them once imported
    (it reads them from the environment at its import, then from its constants at each call)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config())


def test_hub_id_resolves_offline_to_the_cached_snapshot(offline_cache, tiny_checkpoint):
    snapshot = cache_repo(offline_cache, REPO, tiny_checkpoint)
    scanned = {repo.repo_id: repo for repo in huggingface_hub.scan_cache_dir(offline_cache).repos}
    assert scanned[REPO].nb_files == len(list(tiny_checkpoint.iterdir()))  # huggingface_hub reads our layout
    assert resolve_checkpoint(REPO) == snapshot
    llm = LLM(resolve_checkpoint(REPO), device="cpu")
    assert llm.tokenizer is not None and llm.config.vocab_size == tiny_config()["vocab_size"]
    [out] = llm.generate(["What is 3 + 4?"], SamplingParams(max_tokens=8, block_length=8))
    assert out.finish_reason in ("stop", "length") and out.text is not None


def test_local_directory_wins_over_a_cached_hub_repo(offline_cache, tiny_checkpoint, tmp_path, monkeypatch):
    cache_repo(offline_cache, REPO, tiny_checkpoint)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_checkpoint, tmp_path / REPO)
    assert resolve_checkpoint(REPO) == Path(REPO)
    assert resolve_checkpoint(tmp_path / REPO) == tmp_path / REPO


def test_allow_patterns_cover_the_files_we_load(tiny_checkpoint):
    from huggingface_hub.utils import filter_repo_objects

    loaded = [p.name for p in (*tiny_checkpoint.iterdir(), *default_model_path().iterdir())]
    loaded += ["vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"]  # Dream's tokenizer files
    assert sorted(filter_repo_objects(loaded, allow_patterns=CHECKPOINT_FILES)) == sorted(loaded)
    remote_code = ["modeling_llada.py", "configuration_llada.py", "README.md", ".gitattributes", "pytorch_model.bin"]
    assert list(filter_repo_objects(remote_code, allow_patterns=CHECKPOINT_FILES)) == []


def one_line_error(spec) -> str:
    with pytest.raises(ValueError) as info:
        resolve_checkpoint(spec)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_local_path_is_named(tmp_path):
    for spec in (tmp_path / "nope", "./nope", "../models/llada", "a/b/c", "GSAI-ML/LLaDA-8B-Instruct/"):
        assert one_line_error(spec) == f"model directory {str(spec)!r} does not exist"
    (tmp_path / "file").write_text("")
    assert one_line_error(tmp_path / "file") == f"model directory {str(tmp_path / 'file')!r} is not a directory"


def test_embedded_models_by_name():
    assert resolve_checkpoint("embedded:default") == default_model_path()
    assert json.loads((resolve_checkpoint("embedded:llada2") / "config.json").read_text())["model_type"] == \
        "llada2_moe"
    assert one_line_error("embedded:llada3") == "embedded:llada3: no such embedded model; they are embedded:default, " \
        "embedded:llada2"


def test_hub_id_offline_and_not_cached(offline_cache):
    message = one_line_error("GSAI-ML/LLaDA-8B-Instruct")
    assert message.startswith("GSAI-ML/LLaDA-8B-Instruct: ") and "HF_HUB_OFFLINE=1" in message
    assert str(offline_cache) in message


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    message = one_line_error("GSAI-ML/LLaDA-8B-Instruct")
    assert "'GSAI-ML/LLaDA-8B-Instruct'" in message and "pip install 'flash-dllm[hub]'" in message


def test_hub_error_is_one_line(monkeypatch):
    def unreachable(repo_id, **kwargs):
        raise OSError("An error happened while trying to locate the files on the Hub.\nPlease check your connection.")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    message = one_line_error("owner/name")
    assert message.startswith("owner/name: ") and "OSError: An error happened" in message
    assert "Please check your connection." in message


def test_offline_environment_in_a_fresh_process(tmp_path, tiny_checkpoint):
    """HF_HUB_OFFLINE and HF_HUB_CACHE as the user sets them: read when huggingface_hub is first imported."""
    snapshot = cache_repo(tmp_path / "hub", REPO, tiny_checkpoint)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = f"from flash_dllm.models.hub import resolve_checkpoint; print(resolve_checkpoint({REPO!r}))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot)
