"""The user-facing API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence as SequenceType, Union

import torch

from .engine.llm_engine import LLMEngine
from .engine.model_runner import ModelRunner
from .models import load_model, random_model
from .sampling_params import SamplingParams
from .tokenizer import load_tokenizer, special_tokens

Messages = list[dict]
Prompt = Union[str, list[int], Messages]
RANDOM_PREFIX = "random:"


def default_model_path() -> Path:
    """The small model shipped inside the package."""
    return Path(str(resources.files("flash_dllm") / "assets" / "default"))


@dataclass
class RequestOutput:
    request_id: int
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str | None           # None when the model directory has no tokenizer
    token_ids: list[int]       # generated tokens, up to and excluding the first eos/eot
    finish_reason: str         # "stop" (an eos/eot was generated), "length" or "abort"
    nfe: int                   # forward passes
    steps: int                 # denoising steps
    query_rows: int            # query rows computed over all forward passes (the whole sequence without cache)
    time_s: float              # wall time from admission to finish

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)

    @property
    def query_rows_per_step(self) -> float:
        return self.query_rows / max(self.steps, 1)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[dtype]


class LLM:
    """A diffusion language model ready to generate.

    model: a checkpoint directory, "random:PRESET" (random weights of a named config, built directly on
        the device), or None for the embedded default model.
    chat_template: apply the tokenizer's chat template to string prompts (default: when it has one).
    kv_cache_bytes: memory for the KV cache of the cached methods (default: 40% of free GPU memory, or
        1 GiB on the CPU); a request longer than the cache holds is refused with an error.
    kernels: run the cached methods' attention through the Triton kernels (fused QKV + RoPE + cache write,
        scheduled flash attention); default: on CUDA. False uses their PyTorch references (same tokens).
    cuda_graphs: replay the cached passes whose shapes repeat from CUDA graphs; default: with the kernels on
        CUDA (the references cannot be captured).
    """

    def __init__(self, model: str | Path | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, max_batch_size: int = 32,
                 chat_template: bool | None = None, seed: int = 0, kv_cache_bytes: int | None = None,
                 kernels: bool | None = None, cuda_graphs: bool | None = None):
        try:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}; e.g. cpu, cuda, cuda:1") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(self.device)!r}: this torch build sees no CUDA device")
        self.dtype = resolve_dtype(dtype, self.device)
        spec = str(model) if model is not None else str(default_model_path())
        if spec.startswith(RANDOM_PREFIX):
            self.path = None
            self.model = random_model(spec[len(RANDOM_PREFIX):], self.device, self.dtype, seed=seed)
        else:
            self.path = Path(spec)
            self.model = load_model(self.path, self.device, self.dtype)
        self.config = self.model.config
        self.runner = ModelRunner(self.model, kernels=kernels, cuda_graphs=cuda_graphs, kv_cache_bytes=kv_cache_bytes)
        self.tokenizer = load_tokenizer(self.path)
        self.special = special_tokens(self.config, self.path, self.tokenizer)
        has_template = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))
        self.use_chat_template = has_template if chat_template is None else chat_template
        if self.use_chat_template and not has_template:
            raise ValueError("chat_template=True, but the model's tokenizer has no chat template")
        self.engine = LLMEngine(self.runner, self.special, max_batch_size)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: ids as given, messages or (with the chat template on) a string through the
        chat template, or a plain string through the tokenizer."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary of {self.config.vocab_size}")
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json); give prompts as token-id lists")
        if isinstance(prompt, str) and not self.use_chat_template:
            return self.tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(messages, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                   for m in messages)):
            raise ValueError(f"a prompt is a string, a list of token ids or a list of "
                             f"{{'role', 'content'}} messages, got {type(prompt).__name__}")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _checked_request(self, index: int, prompt: Prompt, params: SamplingParams) -> list[int]:
        """A prompt's token ids, checked before any request of the call starts; an error names the prompt."""
        try:
            if isinstance(prompt, (str, list)) and not prompt:
                raise ValueError("the prompt is empty")
            ids = self.encode(prompt)
            if len(ids) + params.max_tokens > self.config.max_position:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                                 f"model's maximum sequence length of {self.config.max_position}")
            self.engine.check_fits(len(ids), params)
        except ValueError as error:
            raise ValueError(f"prompt {index}: {error}") from None
        return ids

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def generate(self, prompts: Prompt | SequenceType[Prompt],
                 sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts; one output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._checked_request(index, prompt, p) for index, (prompt, p) in enumerate(zip(prompts, params))]
        seqs = [self.engine.add_request(ids, p) for ids, p in zip(encoded, params)]
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm
            progress = tqdm(total=len(seqs), desc="requests", unit="req", dynamic_ncols=True)
        start, num_steps, num_tokens = time.perf_counter(), 0, 0
        try:
            while self.engine.has_unfinished():
                finished = self.engine.step()
                num_steps += 1
                if progress is not None:
                    num_tokens += sum(len(seq.output_ids) for seq in finished)
                    rate = num_tokens / (time.perf_counter() - start)
                    progress.set_postfix(steps=num_steps, tok_s=f"{rate:.1f}", refresh=False)
                    progress.update(len(finished))
        except BaseException:  # an interrupt or a failure leaves no half-done request behind
            self.engine.abort(seqs)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [RequestOutput(
            request_id=seq.request_id, prompt=prompt, prompt_token_ids=seq.prompt_ids,
            text=self.decode(seq.output_ids), token_ids=seq.output_ids, finish_reason=seq.finish_reason,
            nfe=seq.nfe, steps=seq.steps, query_rows=seq.query_rows, time_s=seq.finish_time - seq.start_time,
        ) for prompt, seq in zip(prompts, seqs)]
