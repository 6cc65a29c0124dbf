"""The Dream forward of flash_dllm against an independent float64 re-implementation (Qwen2 blocks without the
causal mask, then the shift) that reads the raw checkpoint tensors under their Hugging Face names; the
Dream-7B configuration; one-line errors for bad Dream checkpoints; every decoding method runs on Dream."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import flash_dllm
from conftest import write_checkpoint
from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import main
from flash_dllm.config import PRESETS
from flash_dllm.decoding.registry import METHODS, methods_for
from flash_dllm.models import build_model, parse_config, random_model, save_checkpoint
from test_llada import attention64, randomise_biases, read_tensors, rel_err, rope64

INDEX = "model.safetensors.index.json"
SEQ_LEN = 13
DREAM_7B_PARAMETERS = 7_615_616_512


def dream_config(**overrides) -> dict:
    return {**PRESETS["dream-tiny"], **overrides}


# ----------------------------------------------------------------------------- float64 reference

class Reference:
    """Dream forward for one unpadded sequence, float64, straight from the config and tensors."""

    def __init__(self, path: Path):
        cfg = json.loads((path / "config.json").read_text())
        self.w = read_tensors(path)
        self.d, self.n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.n_kv = cfg["num_key_value_heads"]
        self.hd = self.d // self.n_heads
        self.n_layers = cfg["num_hidden_layers"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        self.tied = cfg["tie_word_embeddings"]

    def linear(self, x, name, bias=False):
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if bias else y

    def rmsnorm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [L] -> logits [L, V], row i from hidden state i - 1 (row 0 from hidden state 0)."""
        L = ids.shape[0]
        positions = torch.arange(L)
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.n_layers):
            b = f"model.layers.{i}."
            h = self.rmsnorm(x, b + "input_layernorm")
            a = b + "self_attn."
            q = rope64(self.linear(h, a + "q_proj", bias=True).view(L, self.n_heads, self.hd), positions, self.theta)
            k = rope64(self.linear(h, a + "k_proj", bias=True).view(L, self.n_kv, self.hd), positions, self.theta)
            v = self.linear(h, a + "v_proj", bias=True).view(L, self.n_kv, self.hd)
            x = x + self.linear(attention64(q, k, v, torch.ones(L, dtype=torch.bool)).reshape(L, -1), a + "o_proj")
            h = self.rmsnorm(x, b + "post_attention_layernorm")
            gate, up = self.linear(h, b + "mlp.gate_proj"), self.linear(h, b + "mlp.up_proj")
            x = x + self.linear(gate * torch.sigmoid(gate) * up, b + "mlp.down_proj")
        x = self.rmsnorm(x, "model.norm")
        logits = x @ self.w["model.embed_tokens.weight" if self.tied else "lm_head.weight"].T
        return torch.cat([logits[:1], logits[:-1]])

    def batch(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self(row) for row in ids])


# ----------------------------------------------------------------------------- checkpoints

def dream_checkpoint(path: Path, num_shards: int = 2, seed: int = 0, **overrides) -> Path:
    path = write_checkpoint(path, dream_config(**overrides), num_shards=num_shards, with_tokenizer=False, seed=seed)
    return randomise_biases(path, seed=seed + 1)


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory) -> Path:
    return dream_checkpoint(tmp_path_factory.mktemp("dream_gqa"))


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory) -> Path:
    return dream_checkpoint(tmp_path_factory.mktemp("dream_mha"), num_shards=1, seed=2, num_key_value_heads=4)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    return dream_checkpoint(tmp_path_factory.mktemp("dream_tied"), seed=4, tie_word_embeddings=True)


@pytest.fixture(params=["gqa_checkpoint", "mha_checkpoint", "tied_checkpoint"],
                ids=lambda name: name.removesuffix("_checkpoint"))
def any_checkpoint(request) -> Path:
    return request.getfixturevalue(request.param)


def random_ids(shape=(2, SEQ_LEN), seed=0) -> torch.Tensor:
    return torch.randint(0, PRESETS["dream-tiny"]["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- forward

def test_checkpoint_has_dream_names_and_nonzero_biases(gqa_checkpoint):
    """Guards the fixture and the reference: real names, sharded with an index, q/k/v biases and no others."""
    index = json.loads((gqa_checkpoint / INDEX).read_text())["weight_map"]
    assert len(set(index.values())) == 2 and not (gqa_checkpoint / "model.safetensors").exists()
    assert json.loads((gqa_checkpoint / "config.json").read_text()) == PRESETS["dream-tiny"]
    w = Reference(gqa_checkpoint).w
    assert index.keys() == w.keys()
    biases = sorted(n for n in w if n.endswith(".bias"))
    assert biases == sorted(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv")
    assert all(w[n].abs().sum() > 0 for n in biases)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # GQA: 2 KV heads of 16
    assert {"lm_head.weight", "model.norm.weight", "model.layers.1.post_attention_layernorm.weight",
            "model.layers.1.mlp.down_proj.weight"} <= w.keys()


def test_forward_matches_float64_reference(any_checkpoint):
    model = flash_dllm.load_model(any_checkpoint, device="cpu", dtype=torch.float32)
    ids = random_ids()
    with torch.no_grad():
        logits = model(ids)
    expected = Reference(any_checkpoint).batch(ids)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape == (2, SEQ_LEN, 320)
    assert rel_err(logits, expected) < 1e-4


def test_logits_are_shifted(gqa_checkpoint):
    """Row 0 and row 1 both come from hidden state 0; row i from hidden state i - 1."""
    model = flash_dllm.load_model(gqa_checkpoint)
    ids = random_ids(seed=1)
    with torch.no_grad():
        unshifted = model.compute_logits(model.hidden_states(ids))
        logits = model(ids)
    assert torch.equal(logits[:, 0], unshifted[:, 0])
    assert torch.equal(logits[:, 1:], unshifted[:, :-1])


def test_left_padded_batch_matches_unpadded_rows(gqa_checkpoint):
    """Dream's padded batches: left padding, positions cumsum(mask) - 1 (pads at 1, as Dream's sampler
    sets them). Row p (the first real token) comes from a pad's hidden state and is never used; the rows
    after it must equal the row alone, and so must the hidden states of every real token."""
    model, ref = flash_dllm.load_model(gqa_checkpoint), Reference(gqa_checkpoint)
    pads = [0, 5, SEQ_LEN - 2]
    ids = random_ids(shape=(len(pads), SEQ_LEN), seed=2)  # padding slots hold random ids on purpose
    mask = torch.stack([torch.arange(SEQ_LEN) >= p for p in pads])
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    with torch.no_grad():
        logits = model(ids, positions, mask)
        hidden = model.hidden_states(ids, positions, mask)
        for row, p in enumerate(pads):
            alone = model.hidden_states(ids[row:row + 1, p:])[0]
            torch.testing.assert_close(hidden[row, p:], alone, rtol=1e-5, atol=1e-5)
            err = rel_err(logits[row, p + 1:], ref(ids[row, p:])[1:])
            assert err < 1e-4, f"row {row} (left padding {p}): relative error {err:.2e}"
    assert torch.isfinite(logits).all()


def test_round_trip_gives_identical_logits(tmp_path):
    model = random_model("dream-tiny", "cpu", torch.float32, seed=5, std=0.1)
    save_checkpoint(model, tmp_path, PRESETS["dream-tiny"], num_shards=3)
    loaded = flash_dllm.load_model(tmp_path)
    assert type(loaded) is type(model) and loaded.logit_shift == 1
    ids = random_ids(seed=3)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


# ----------------------------------------------------------------------------- Dream-7B (meta device only)

def test_dream_7b_config():
    cfg = parse_config(PRESETS["dream-7b"])
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == ("DreamModel", 3584, 128, 152064)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.intermediate_size) == (28, 4, 28, 18944)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (1e6, 1e-6)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (151666, 151643, 151643)
    assert cfg.qkv_bias and not (cfg.linear_bias or cfg.norm_bias or cfg.tie_word_embeddings)
    assert cfg.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_dream_7b_parameters_on_meta():
    model = build_model(parse_config(PRESETS["dream-7b"]), "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == DREAM_7B_PARAMETERS
    layout = model.checkpoint_layout()
    assert len(layout) == 3 + 28 * 12
    layer = {name.removeprefix("model.layers.27.") for name in layout if name.startswith("model.layers.27.")}
    assert layer == {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     *(f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias"))}


def test_info_prints_dream_7b_parameters(capsys):
    assert main(["info", "--model", "random:dream-7b", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {DREAM_7B_PARAMETERS:,}" in out and "KV cache per token: 57,344 bytes" in out
    assert "architecture: DreamModel" in out


# ----------------------------------------------------------------------------- bad checkpoints

def set_config(**changes):
    def mutate(path: Path):
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **changes}))
    return mutate


def remove_tensor(name):
    def mutate(path: Path):
        index = json.loads((path / INDEX).read_text())
        file = path / index["weight_map"].pop(name)
        tensors = load_file(str(file))
        del tensors[name]
        save_file(tensors, str(file), metadata={"format": "pt"})
        (path / INDEX).write_text(json.dumps(index))
    return mutate


K1 = "model.layers.1.self_attn.k_proj.bias"
BAD_CHECKPOINTS = {
    "unknown model_type": (set_config(model_type="qwen2"),
                           "config.json: model_type 'qwen2' is not supported (supported: 'llada' (LLaDAModelLM), "
                           "'Dream' (DreamModel), 'llada2_moe' (LLaDA2MoeModelLM), 'llada' (LLaDAMoEModelLM, "
                           "LLaDAMoEModel))"),
    "missing bias": (remove_tensor(K1), f"checkpoint is missing tensors: {K1}"),
    "vocab mismatch": (set_config(vocab_size=400), "tensor 'model.embed_tokens.weight' has shape [320, 64], "
                                                   "but config.json implies [400, 64]"),
    "hidden_size missing": (lambda path: (path / "config.json").write_text(json.dumps(
        {k: v for k, v in dream_config().items() if k != "hidden_size"})), "missing required key 'hidden_size'"),
    "activation": (set_config(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    "sliding window": (set_config(use_sliding_window=True), "use_sliding_window=True is not supported"),
    "rope scaling": (set_config(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling={'type': 'yarn'"),
    "heads": (set_config(num_attention_heads=5, num_key_value_heads=5),
              "hidden_size (64) is not divisible by num_attention_heads (5)"),
}


@pytest.mark.parametrize("mutate, message", BAD_CHECKPOINTS.values(),
                         ids=[k.replace(" ", "_") for k in BAD_CHECKPOINTS])
def test_bad_dream_checkpoint_is_a_one_line_error(gqa_checkpoint, tmp_path, mutate, message):
    path = tmp_path / "ckpt"
    shutil.copytree(gqa_checkpoint, path)
    mutate(path)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        flash_dllm.load_model(path)
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------- tokenizer (vocab.json + merges.txt)

DREAM_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_dream_tokenizer(path: Path) -> dict[str, int]:
    """A byte-level BPE in the layout of Dream's Hugging Face repo: vocab.json, merges.txt and a
    tokenizer_config.json whose tokenizer class is remote code (DreamTokenizer), its special tokens added after
    the BPE vocabulary. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from conftest import CORPUS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS + ["héllo wörld ✓"], trainers.BpeTrainer(
        vocab_size=360, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(path))
    ids = {token: tokenizer.get_vocab_size() + i for i, token in enumerate(DREAM_SPECIAL_TOKENS)}
    added = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for token, i in ids.items()}
    config = {"tokenizer_class": "DreamTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
              "added_tokens_decoder": added, "bos_token": None, "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "chat_template": QWEN_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("dream_chat")
    ids = write_dream_tokenizer(path)
    eos = ids["<|endoftext|>"]
    dream_checkpoint(path, vocab_size=400, mask_token_id=ids["<|mask|>"], eos_token_id=eos, pad_token_id=eos,
                     bos_token_id=eos)
    assert not (path / "tokenizer.json").exists()
    return path, ids


def test_tokenizer_from_vocab_and_merges_with_its_chat_template(chat_checkpoint):
    path, ids = chat_checkpoint
    llm = LLM(str(path), device="cpu")
    assert llm.use_chat_template and llm.special.mask_id == ids["<|mask|>"]
    assert llm.special.stop_ids == (ids["<|endoftext|>"], ids["<|im_end|>"])  # eos, and the end of a turn
    text = "héllo wörld ✓ 3 + 4 = 7"
    assert llm.tokenizer.decode(llm.encode(text, chat_template=False)) == text
    prompt = llm.encode("hi")
    expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert llm.tokenizer.decode(prompt) == expected + "<|im_start|>assistant\n"
    assert prompt.count(ids["<|im_end|>"]) == 2 and prompt.count(ids["<|im_start|>"]) == 3  # one id each


def test_chat_prompts_generate_text(chat_checkpoint):
    llm = LLM(str(chat_checkpoint[0]), device="cpu")
    outs = llm.generate(["hi", "What is 3 + 4?"], SamplingParams(method="flash-cache", max_tokens=16,
                                                                 block_length=8))
    assert all(out.error is None and isinstance(out.text, str) for out in outs)
    assert all(out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs)


# ----------------------------------------------------------------------------- decoding (smoke only)

@pytest.mark.parametrize("method", methods_for("bidirectional"))
def test_every_method_runs_on_dream(gqa_checkpoint, method):
    """Every method handles the shift and produces token ids (its exactness on a shifted architecture is
    tested in tests/decoding/test_shifted.py)."""
    assert METHODS[method].handles_logit_shift
    llm = LLM(str(gqa_checkpoint), device="cpu")
    prompt = random_ids(shape=(9,), seed=4).tolist()
    [out] = llm.generate([prompt], SamplingParams(method=method, max_tokens=16, block_length=8))
    assert out.error is None and out.finish_reason in ("stop", "length"), out.error
    assert out.prompt_token_ids == prompt and 0 < out.nfe and len(out.token_ids) <= 16
    assert all(0 <= t < 320 and t != llm.special.mask_id for t in out.token_ids)
