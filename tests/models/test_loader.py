"""Checkpoint save/load round trips, the errors for broken checkpoints, the LLaDA-8B configuration, and models
refused before allocation when their weights cannot fit the device."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import flash_dllm
from flash_dllm.config import PRESETS
from flash_dllm.cli import main
from flash_dllm.models import build_model, loader, parse_config, random_model, save_checkpoint

P = "model.transformer."
INDEX = "model.safetensors.index.json"
SHARD2 = "model-00002-of-00002.safetensors"


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LLaDA checkpoint without biases, under its Hugging Face name."""
    d, v, mlp = cfg["d_model"], cfg["embedding_size"], cfg["mlp_hidden_size"]
    kv = cfg["n_kv_heads"] * d // cfg["n_heads"]
    shapes = {f"{P}wte.weight": (v, d), f"{P}ln_f.weight": (d,), f"{P}ff_out.weight": (v, d)}
    for i in range(cfg["n_layers"]):
        b = f"{P}blocks.{i}."
        shapes.update({
            b + "attn_norm.weight": (d,), b + "q_proj.weight": (d, d), b + "k_proj.weight": (kv, d),
            b + "v_proj.weight": (kv, d), b + "attn_out.weight": (d, d), b + "ff_norm.weight": (d,),
            b + "ff_proj.weight": (mlp, d), b + "up_proj.weight": (mlp, d), b + "ff_out.weight": (d, mlp),
        })
    return shapes


def logits_of(model, seed: int = 0) -> torch.Tensor:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


# ----------------------------------------------------------------------------- round trip

@pytest.fixture(scope="module")
def tiny_model():
    return random_model("llada-tiny", "cpu", torch.float32)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_round_trip_gives_identical_logits(tiny_model, tmp_path, num_shards):
    save_checkpoint(tiny_model, tmp_path, PRESETS["llada-tiny"], num_shards=num_shards)
    loaded = flash_dllm.load_model(str(tmp_path))
    original = dict(tiny_model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, original[name]), name
    assert torch.equal(logits_of(loaded), logits_of(tiny_model))


def test_sharded_save_writes_index_covering_every_tensor(tiny_model, tmp_path):
    save_checkpoint(tiny_model, tmp_path, PRESETS["llada-tiny"], num_shards=2)
    assert json.loads((tmp_path / "config.json").read_text()) == PRESETS["llada-tiny"]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / INDEX).read_text())
    weight_map = index["weight_map"]
    shard_files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert shard_files == ["model-00001-of-00002.safetensors", SHARD2]
    assert sorted(set(weight_map.values())) == shard_files
    shapes = {}
    for file in shard_files:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            for name in f.keys():
                assert weight_map[name] == file, name
                shapes[name] = tuple(f.get_slice(name).get_shape())
    assert shapes == expected_shapes(PRESETS["llada-tiny"])
    assert set(weight_map) == set(shapes)
    assert index["metadata"]["total_size"] == 4 * sum(torch.Size(s).numel() for s in shapes.values())


def test_sharded_and_single_file_saves_agree(tiny_model, tmp_path):
    save_checkpoint(tiny_model, tmp_path / "one", PRESETS["llada-tiny"])
    save_checkpoint(tiny_model, tmp_path / "two", PRESETS["llada-tiny"], num_shards=2)
    assert (tmp_path / "one" / "model.safetensors").is_file() and not (tmp_path / "one" / INDEX).exists()
    single = load_file(str(tmp_path / "one" / "model.safetensors"))
    sharded = {}
    for file in (tmp_path / "two").glob("*.safetensors"):
        sharded.update(load_file(str(file)))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[n], sharded[n]) for n in single)
    a, b = flash_dllm.load_model(tmp_path / "one"), flash_dllm.load_model(tmp_path / "two")
    assert torch.equal(logits_of(a), logits_of(b))


# ----------------------------------------------------------------------------- broken checkpoints

def set_config(**changes):
    def mutate(path: Path):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return mutate


def drop_config_key(key):
    def mutate(path: Path):
        cfg = json.loads((path / "config.json").read_text())
        del cfg[key]
        (path / "config.json").write_text(json.dumps(cfg))
    return mutate


def shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / INDEX).read_text())["weight_map"][name]


def edit_shard(name: str, edit):
    """Rewrite the shard holding tensor `name` with edit(tensors) applied."""
    def mutate(path: Path):
        file = shard_of(path, name)
        tensors = load_file(str(file))
        edit(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return mutate


def reshape_tensor(name, shape):
    return edit_shard(name, lambda t: t.__setitem__(name, torch.zeros(shape)))


def remove_tensor(name):
    def mutate(path: Path):
        edit_shard(name, lambda t: t.pop(name))(path)
        index = json.loads((path / INDEX).read_text())
        del index["weight_map"][name]
        (path / INDEX).write_text(json.dumps(index))
    return mutate


def write_bytes(file, data_of):
    def mutate(path: Path):
        (path / file).write_bytes(data_of((path / file).read_bytes()))
    return mutate


def remove_files(*patterns):
    def mutate(path: Path):
        for pattern in patterns:
            for file in path.glob(pattern):
                file.unlink()
    return mutate


def copy_tensor_into_other_shard(name):
    def mutate(path: Path):
        tensor = load_file(str(shard_of(path, name)))[name]
        other = next(p for p in path.glob("*.safetensors") if p != shard_of(path, name))
        edit_shard_file = load_file(str(other))
        edit_shard_file[name] = tensor
        save_file(edit_shard_file, str(other), metadata={"format": "pt"})
    return mutate


def missing_dir(path: Path):
    shutil.rmtree(path)


K0 = f"{P}blocks.0.k_proj.weight"
BAD_CHECKPOINTS = {
    # id: (mutation of a copy of the MHA checkpoint (d 64, mlp 128, 2 layers), error type, message part)
    "directory missing": (missing_dir, FileNotFoundError, "does not exist"),
    "config.json missing": (remove_files("config.json"), FileNotFoundError, "config.json is missing"),
    "config.json not JSON": (write_bytes("config.json", lambda b: b[:-5]), ValueError, "not valid JSON"),
    "model_type": (set_config(model_type="dream"), ValueError,
                   "model_type 'dream' is not supported"),
    "attention_layer_norm": (set_config(attention_layer_norm=True), ValueError,
                             "attention_layer_norm=True is not supported"),
    "layer_norm_type": (set_config(layer_norm_type="default"), ValueError,
                        "layer_norm_type='default' is not supported"),
    "activation_type": (set_config(activation_type="gelu"), ValueError,
                        "activation_type='gelu' is not supported"),
    "rope off": (set_config(rope=False), ValueError, "rope=False is not supported"),
    "scale_logits": (set_config(scale_logits=True), ValueError, "scale_logits=True is not supported"),
    "d_model missing": (drop_config_key("d_model"), ValueError, "missing required key 'd_model'"),
    "n_kv_heads": (set_config(n_kv_heads=3), ValueError, "n_heads (4) must be a multiple of n_kv_heads (3)"),
    "d_model not divisible": (set_config(n_heads=5, n_kv_heads=5), ValueError,
                          "d_model (64) is not divisible by n_heads (5)"),
    "index not JSON": (write_bytes(INDEX, lambda b: b"{"), ValueError, "not a valid safetensors index"),
    "shard missing": (remove_files(SHARD2), FileNotFoundError,
                      f"{SHARD2}: shard listed in {INDEX} is missing"),
    "shard garbage": (write_bytes(SHARD2, lambda b: bytes(range(256)) * 4), ValueError,
                      f"{SHARD2}: cannot read safetensors file"),
    "shard truncated": (write_bytes(SHARD2, lambda b: b[: len(b) // 2]), ValueError,
                        f"{SHARD2}: cannot read safetensors file"),
    "shard empty": (write_bytes(SHARD2, lambda b: b""), ValueError, f"{SHARD2}: cannot read safetensors file"),
    "packed tensor shape": (reshape_tensor(K0, (48, 64)), ValueError,
                            f"tensor '{K0}' has shape [48, 64], but config.json implies [64, 64]"),
    "plain tensor shape": (reshape_tensor(f"{P}ln_f.weight", (65,)), ValueError,
                           f"tensor '{P}ln_f.weight' has shape [65], but config.json implies [64]"),
    "transposed tensor": (reshape_tensor(f"{P}blocks.1.ff_out.weight", (128, 64)), ValueError,
                          "has shape [128, 64], but config.json implies [64, 128]"),
    "tensor missing": (remove_tensor(f"{P}blocks.1.up_proj.weight"), ValueError,
                       f"checkpoint is missing tensors: {P}blocks.1.up_proj.weight"),
    "tensor unexpected": (edit_shard(K0, lambda t: t.__setitem__(f"{P}blocks.0.attn_norm.bias", torch.zeros(64))),
                          ValueError, f"unexpected tensor '{P}blocks.0.attn_norm.bias'"),
    "tensor duplicated": (copy_tensor_into_other_shard(K0), ValueError, f"tensor '{K0}' also appears in"),
    "integer tensor": (edit_shard(K0, lambda t: t.__setitem__(K0, torch.zeros(64, 64, dtype=torch.int32))),
                       ValueError, f"tensor '{K0}' has dtype torch.int32, expected floating point"),
    "no safetensors": (remove_files("*.safetensors", INDEX), FileNotFoundError,
                       f"no model.safetensors or {INDEX}"),
}


@pytest.mark.parametrize("mutate, error, message", BAD_CHECKPOINTS.values(),
                         ids=[k.replace(" ", "_") for k in BAD_CHECKPOINTS])
def test_broken_checkpoint_raises_clear_error(mha_checkpoint, tmp_path, mutate, error, message):
    path = tmp_path / "ckpt"
    shutil.copytree(mha_checkpoint, path)
    mutate(path)
    with pytest.raises(error, match=re.escape(message)):
        flash_dllm.load_model(path)


def test_alibi_config_is_refused(mha_checkpoint, tmp_path):
    """alibi=true asks for ALiBi attention biases, which this package does not implement (LLaDA's own code
    refuses it too); loading such a config must fail instead of silently dropping the biases."""
    path = tmp_path / "ckpt"
    shutil.copytree(mha_checkpoint, path)
    set_config(alibi=True)(path)
    try:
        flash_dllm.load_model(path)
    except ValueError as e:
        assert "alibi" in str(e)
    else:
        pytest.fail("BUG: config.json with alibi=true loads silently as a model without ALiBi biases "
                    "(alibi is missing from config._LLADA_REQUIRED)")


def test_bf16_save_round_trip(tiny_model, tmp_path):
    save_checkpoint(tiny_model, tmp_path, PRESETS["llada-tiny"], num_shards=2, dtype=torch.bfloat16)
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 2 * sum(p.numel() for p in tiny_model.parameters())
    loaded = flash_dllm.load_model(tmp_path)  # float32 parameters, filled from bf16 tensors
    original = dict(tiny_model.named_parameters())
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, original[name].bfloat16().float()), name


def test_missing_single_file_tensor(tmp_path):
    model = random_model("llada-tiny", "cpu", torch.float32)
    save_checkpoint(model, tmp_path, PRESETS["llada-tiny"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in (f"{P}wte.weight", f"{P}ln_f.weight", f"{P}ff_out.weight", f"{P}blocks.0.q_proj.weight"):
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: .*wte\.weight.* and 1 more"):
        flash_dllm.load_model(tmp_path)


# ----------------------------------------------------------------------------- LLaDA-8B (meta device only)

def test_llada_8b_config():
    cfg = parse_config(PRESETS["llada-8b"])
    assert cfg.head_dim == 128
    assert cfg.vocab_size == 126464
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.intermediate_size) == (32, 32, 32, 12288)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (500000.0, 1e-5)
    assert (cfg.mask_token_id, cfg.eos_token_id) == (126336, 126081)
    assert not (cfg.qkv_bias or cfg.linear_bias or cfg.tie_word_embeddings)
    assert cfg.kv_bytes_per_token == 512 * 1024


def test_llada_8b_parameters_on_meta():
    hf = PRESETS["llada-8b"]
    model = build_model(parse_config(hf), "meta", torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params.values())
    total = sum(p.numel() for p in params.values())
    assert abs(total - 16.03e9 / 2) < 0.01 * 16.03e9 / 2
    shapes = expected_shapes(hf)
    assert total == sum(torch.Size(s).numel() for s in shapes.values())
    # Each checkpoint tensor fills a region of the right shape.
    layout = model.checkpoint_layout()
    assert layout.keys() == shapes.keys()
    for name, (param, rows, _) in layout.items():
        target = params[param] if rows is None else params[param][rows]
        assert tuple(target.shape) == shapes[name], name


# ----------------------------------------------------------------------------- models too large for the device

@pytest.fixture
def small_memory(monkeypatch):
    """Every device has 1 GB available, and allocating a model fails the test (the check comes first)."""
    monkeypatch.setattr(loader, "available_memory", lambda device: 10**9)

    def allocate(*args, **kwargs):
        raise AssertionError("a model was allocated before the memory check")
    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)


def test_model_larger_than_available_memory_is_refused(small_memory, mha_checkpoint, monkeypatch):
    with pytest.raises(ValueError) as info:
        random_model("llada-8b", "cpu", torch.float32)
    assert str(info.value) == ("random:llada-8b needs 32.1 GB for its weights in float32, the CPU has 1.0 GB "
                               "available; use a GPU (--device cuda) or a smaller model")
    with pytest.raises(ValueError, match=re.escape("random:dream-7b needs 15.2 GB for its weights in bfloat16, "
                                                   "cuda:1 has 1.0 GB available")):
        random_model("dream-7b", "cuda:1", torch.bfloat16)  # refused before CUDA is touched
    monkeypatch.setattr(loader, "available_memory", lambda device: 1000)  # the tiny checkpoint does not fit either
    with pytest.raises(ValueError, match=re.escape(f"{mha_checkpoint} needs ")):
        flash_dllm.load_model(mha_checkpoint)


def test_bench_on_a_cpu_without_the_memory_reports_one_line(small_memory, capsys):
    code = main(["bench", "generate", "--model", "random:llada-8b", "--device", "cpu", "--batch-sizes", "1"])
    assert code == 2
    assert capsys.readouterr().err == ("flash-dllm: error: random:llada-8b needs 32.1 GB for its weights in float32, "
                                       "the CPU has 1.0 GB available; use a GPU (--device cuda) or a smaller model\n")


def test_available_cpu_memory(monkeypatch):
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        available = lambda: next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                                 if line.startswith("MemAvailable:"))
        # it moves meanwhile: another process (a test worker beside this one) may free a GiB between the reads
        assert any(abs(loader.available_memory(torch.device("cpu")) - available()) < 2**30 for _ in range(3))

    def unreadable(*args, **kwargs):
        raise OSError("no /proc")
    monkeypatch.setattr(loader, "open", unreadable, raising=False)
    monkeypatch.setattr(loader.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 5, "SC_PAGE_SIZE": 4096}[name])
    assert loader.available_memory(torch.device("cpu")) == 5 * 4096
    monkeypatch.delattr(loader.os, "sysconf")
    assert loader.available_memory(torch.device("cpu")) is None
    assert random_model("llada-tiny", "cpu", torch.float32) is not None  # unknown memory: not checked
