"""Model names to checkpoint directories: a local directory as it is; `embedded:NAME`, one of the small trained
models in the package; a Hugging Face hub repo id (`owner/name`) through huggingface_hub's cache, downloading only
the files we load (once; HF_HUB_OFFLINE=1 reads the cache only)."""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
# The package's trained models (training/README.md) and the embedded tasks each was trained on.
EMBEDDED_TASKS = {
    "default": ("arith", "trace", "passkey", "multikey"),  # LLaDA format (dense, bidirectional)
    "llada2": ("arith", "trace"),  # LLaDA2.x format (MoE, block-causal), training/train_llada2.py
}

# What load_model and load_tokenizer read (transformers' tokenizer classes read the special tokens, added tokens
# and chat template files); the repos' remote code and other weight formats stay on the hub.
CHECKPOINT_FILES = [
    "config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.json", "*.jinja",
]
# The hub's owner/name: letters, digits, '-', '_' and '.', neither part starting with '.' or '-' (so "./x" and
# "../x" stay paths).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(spec: str) -> bool:
    return HUB_ID.fullmatch(spec) is not None


def embedded_model_path(name: str) -> Path:
    if name not in EMBEDDED_TASKS:
        raise ValueError(f"{EMBEDDED_PREFIX}{name}: no such embedded model; they are "
                         f"{', '.join(EMBEDDED_PREFIX + n for n in EMBEDDED_TASKS)}")
    return Path(str(resources.files("flash_dllm") / "assets" / name))


def embedded_name(spec: str | Path) -> str | None:
    """Which embedded model a model spec names (`embedded:NAME`, an unknown name a one-line error) or a checkpoint
    directory is, if any."""
    if str(spec).startswith(EMBEDDED_PREFIX):
        name = str(spec)[len(EMBEDDED_PREFIX):]
        embedded_model_path(name)
        return name
    resolved = Path(spec).resolve()
    return next((name for name in EMBEDDED_TASKS if embedded_model_path(name).resolve() == resolved), None)


def resolve_checkpoint(spec: str | Path) -> Path:
    """The checkpoint directory that `spec` names: an existing local directory wins; `embedded:NAME` is that
    embedded model's; otherwise a hub repo id resolves to its snapshot in the Hugging Face cache (HF_HUB_CACHE),
    downloaded there first if needed. Raises a one-line ValueError for a missing directory or a repo that cannot be
    had."""
    if str(spec).startswith(EMBEDDED_PREFIX):
        return embedded_model_path(str(spec)[len(EMBEDDED_PREFIX):])
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model directory {str(spec)!r} is not a directory")
    if not is_hub_id(str(spec)):
        raise ValueError(f"model directory {str(spec)!r} does not exist")
    return from_hub(str(spec))


def from_hub(repo_id: str) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise ValueError(f"model directory {repo_id!r} does not exist; to load it as a Hugging Face hub repo, "
                         "pip install 'flash-dllm[hub]'") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES))
    except (OSError, ValueError) as e:  # huggingface_hub's errors are OSErrors (HTTP, not cached) or ValueErrors
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"{repo_id}: no such local directory, and the Hugging Face hub repo is not in the cache "
                             f"{constants.HF_HUB_CACHE} while HF_HUB_OFFLINE=1 forbids downloading it") from None
        reason = " ".join(str(e).split()) or "no message"  # its messages span lines
        raise ValueError(f"{repo_id}: no such local directory, and the Hugging Face hub repo could not be had "
                         f"({type(e).__name__}: {reason})") from None
