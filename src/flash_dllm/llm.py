"""The user-facing API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import functools
import logging
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence as SequenceType, Union

import torch

from .engine.llm_engine import LLMEngine
from .engine.model_runner import ModelRunner
from .engine.rank import RANDOM_PREFIX, RankSpec, build_rank
from .engine.sequence import Sequence
from .engine.tensor_parallel import MirroredEngine, MirroredRunner, Workers
from .engine.warmup import compiles_on_first_use, warm_up_requests, warm_up_routing
from .models import config_from_dir, resolve_checkpoint
from .models.hub import embedded_model_path
from .models.loader import random_config
from .models.parallel import TensorParallel, check_size
from .models.quantization import check_options
from .sampling_params import SamplingParams
from .tokenizer import load_tokenizer, special_tokens

Messages = list[dict]
Prompt = Union[str, list[int], Messages]
PROGRESS_MIN_PROMPTS = 16  # a call with more prompts shows a progress bar by default, even off a terminal
logger = logging.getLogger("flash_dllm")


def default_model_path() -> Path:
    """The small model shipped inside the package (`embedded:default`)."""
    return embedded_model_path("default")


@dataclass
class RequestOutput:
    request_id: int | None     # the engine's id; None for a prompt that never reached the engine
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str                  # "" when the request failed or the model directory has no tokenizer
    token_ids: list[int]       # generated tokens, up to and excluding the first eos/eot
    finish_reason: str         # "stop" (an eos/eot was generated), "length", "abort" or "error"
    nfe: int                   # forward passes
    steps: int                 # denoising steps
    query_rows: int            # query rows computed over all forward passes (the whole sequence without cache)
    time_s: float              # wall time from admission to finish
    index: int = 0             # the prompt's position in its generate call
    error: str | None = None   # why the request failed (finish_reason "error"): "prompt N: ..."
    prompt_kv_read: float | None = None  # with kv_routing: the fraction of the prompt's KV bytes read

    @classmethod
    def failed(cls, index: int, prompt: Prompt, error: str) -> RequestOutput:
        """The output of a prompt that could not run."""
        return cls(request_id=None, prompt=prompt, prompt_token_ids=[], text="", token_ids=[],
                   finish_reason="error", nfe=0, steps=0, query_rows=0, time_s=0.0, index=index, error=error)

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)

    @property
    def query_rows_per_step(self) -> float:
        return self.query_rows / max(self.steps, 1)


def resolve_device(device: str | None) -> torch.device:
    """The device a model runs on: as given, else cuda if this torch sees one."""
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; e.g. cpu, cuda, cuda:1") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(resolved)!r}: this torch build sees no CUDA device")
    return resolved


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

    model: a checkpoint directory, a Hugging Face hub repo id ("owner/name", through its local cache; with the
        `hub` extra), "random:PRESET" (random weights of a named config, built directly on the device), or None
        for the embedded default model.
    chat_template: apply the tokenizer's chat template to string prompts (default: when it has one).
    kv_cache_bytes: memory for the KV cache of the cached methods, at least one token's row (default: 40% of
        free GPU memory; on the CPU 40% of available memory, at most 1 GiB); a request longer than the cache holds
        fails (alone).
    kernels: run the cached methods' attention through the Triton kernels (fused QKV + RoPE + cache write,
        scheduled flash attention); default: on CUDA. False uses their PyTorch references (same tokens).
    cuda_graphs: replay the cached passes whose shapes repeat from CUDA graphs; default: with the kernels on
        CUDA (the references cannot be captured).
    batch_invariant: a request decodes to the same tokens alone or in any batch, in any dtype (every reduction's
        order independent of the batch). On a GPU it needs the kernels (every GEMM through one that never splits
        K). Not with quantization.
    quantization: "fp8": the decoder layers' projections with E4M3 weights (one scale per output channel,
        quantised as the checkpoint loads) and E4M3 inputs (one scale per token, quantised by the kernels that
        produce them); embeddings, norms and the LM head stay in `dtype`. None (default): `dtype` throughout.
    kv_cache_dtype: "fp8": the cached methods' K and V stored in E4M3 with one scale per token and KV head (about
        half the bytes: twice the tokens in the same kv_cache_bytes); None (default): in `dtype`.
    tensor_parallel_size: the model split over this many GPUs (NCCL; on the CPU, processes over gloo), Megatron-style
        (models/parallel.py): this process is rank 0 and starts the others itself (one per GPU from `device` on;
        fresh `python -m flash_dllm.engine.worker` processes, which never import the calling script), or under
        `torchrun` the other ranks' LLM(...) serve rank 0 and end their process. Outputs come back on rank 0 only;
        kv_cache_bytes is per rank. A rank that fails or ends fails the call that needs it, naming it. `shutdown()`
        stops the other ranks (else at exit, or with this process on SIGTERM).
    expert_parallel: with tensor_parallel_size > 1 on a mixture-of-experts model, each rank holds a share of whole
        experts instead of a share of every expert's features (models/moe.py); attention stays tensor-parallel.
    """

    def __init__(self, model: str | Path | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, max_batch_size: int = 32,
                 chat_template: bool | None = None, seed: int = 0, kv_cache_bytes: int | None = None,
                 kernels: bool | None = None, cuda_graphs: bool | None = None, batch_invariant: bool = False,
                 quantization: str | None = None, kv_cache_dtype: str | None = None, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        check_options(quantization, kv_cache_dtype, batch_invariant)  # before the model loads
        self.quantization = quantization
        spec = str(model) if model is not None else str(default_model_path())
        self.path = None if spec.startswith(RANDOM_PREFIX) else resolve_checkpoint(spec)
        rank_spec = RankSpec(spec if self.path is None else str(self.path), self.device, self.dtype, seed, quantization,
                             kv_cache_bytes, kernels, cuda_graphs, batch_invariant, kv_cache_dtype, max_batch_size,
                             expert_parallel)
        self.workers, tp = None, None
        if tensor_parallel_size != 1 or expert_parallel:
            check_size(random_config(spec[len(RANDOM_PREFIX):]) if self.path is None else config_from_dir(self.path),
                       tensor_parallel_size, expert_parallel)  # before any process starts
            self.workers = Workers.start(rank_spec, tensor_parallel_size)  # torchrun's other ranks end in there
            tp, self.device = self.workers.tp, self.workers.device
        try:
            runner = ModelRunner if self.workers is None else functools.partial(MirroredRunner, workers=self.workers)
            self.model, self.runner = build_rank(rank_spec, self.device, tp, runner)
            self.config = self.model.config
            self.tokenizer = load_tokenizer(self.path, self.model.vocab_merges_tokenizer)
            self.special = special_tokens(self.config, self.path, self.tokenizer)
            has_template = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))
            self.use_chat_template = has_template if chat_template is None else chat_template
            if self.use_chat_template and not has_template:
                raise ValueError("chat_template=True, but the model's tokenizer has no chat template")
        except BaseException as error:
            if self.workers is not None:
                self.workers.fail(error)
            raise
        # (method, warm-up routing) -> seconds its warm-up took, at its first use (`_warm_up`)
        self.warm_up_seconds: dict[tuple[str, str | None], float] = {}
        if self.workers is None:
            self.engine = LLMEngine(self.runner, self.special, max_batch_size)
        else:
            self.workers.ready(self.special)
            self.engine = MirroredEngine(self.runner, self.special, max_batch_size, self.workers)

    @property
    def tp(self) -> TensorParallel:
        """This rank's place in the tensor-parallel group (size 1 without one)."""
        return self.model.tp

    def shutdown(self):
        """Stop the other tensor-parallel ranks (a no-op without them); the LLM cannot generate afterwards."""
        if self.workers is not None:
            self.workers.shutdown()

    def encode(self, prompt: Prompt, chat_template: bool | None = None) -> list[int]:
        """Token ids of a prompt: ids as given, messages or (with the chat template on) a string through the
        chat template, or a plain string through the tokenizer. chat_template: for string prompts, instead of
        the LLM's setting (the server's raw-text completions turn it off)."""
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary of {self.config.vocab_size}")
            return list(prompt)
        if isinstance(prompt, str) and not prompt.strip():  # the one rule of the CLI, the API and the server
            raise ValueError("the prompt is empty" if not prompt else "the prompt is only whitespace")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json); give prompts as token-id lists")
        if isinstance(prompt, str) and not (self.use_chat_template if chat_template is None else chat_template):
            text, add_special_tokens = prompt, True
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                       and isinstance(m.get("content"), str) for m in messages)):
                raise ValueError(f"a prompt is a string, a list of token ids or a list of {{'role': str, "
                                 f"'content': str}} messages, got {type(prompt).__name__}")
            for number, message in enumerate(messages):  # a blank message is a blank prompt: the same rule
                if not message["content"].strip():
                    raise ValueError(f"message {number}: its content is "
                                     + ("empty" if not message["content"] else "only whitespace"))
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            add_special_tokens = False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from undecodable bytes): the tokenizer raises TypeError
            raise ValueError("the prompt is not valid UTF-8 text") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """A prompt's token ids (the engine checks them against the model's context and the KV cache)."""
        if isinstance(prompt, (str, list)) and not prompt:
            raise ValueError("the prompt is empty")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids; "" without a tokenizer (the ids are the output then)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def generate(self, prompts: Prompt | SequenceType[Prompt],
                 sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts; one output per prompt, in order.

        Requests fail alone: a prompt that cannot run (empty, of the wrong type, with a token id outside the
        vocabulary, longer than the model's context, or too long for the KV cache ever to hold) gets an output
        with finish_reason "error" and `error` ("prompt N: ..."), logged as a warning, and the other prompts
        run. Mistakes in the call itself (sampling params of the wrong number or type) raise ValueError.
        on_output: called with each output as soon as it is final: the failed prompts first, then in finish
            order. On an exception or interrupt (from the engine or from on_output) the finished outputs have
            been delivered; the unfinished requests are aborted and the exception propagates.
        use_tqdm: a progress bar on stderr while the call runs; default: when stderr is a terminal or the call
            has more than PROGRESS_MIN_PROMPTS prompts.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        seqs, index_of = [], {}  # this call's requests in the engine; request id -> prompt index
        progress = None

        def deliver(out: RequestOutput):
            if on_output is not None:
                with progress.external_write_mode() if progress is not None else nullcontext():
                    on_output(out)  # the bar steps aside for what it prints

        self._warm_up(params)
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    seq = self.engine.add_request(self._prompt_ids(prompt, p), p)
                except ValueError as error:
                    outputs[index] = RequestOutput.failed(index, prompt, f"prompt {index}: {error}")
                    logger.warning(outputs[index].error)
                    deliver(outputs[index])
                    continue
                seqs.append(seq)
                index_of[seq.request_id] = index
            if use_tqdm is None:  # vLLM always shows one; here where someone watches, or for a long call
                use_tqdm = sys.stderr.isatty() or len(prompts) > PROGRESS_MIN_PROMPTS
            if use_tqdm:
                from tqdm.auto import tqdm
                progress = tqdm(total=len(prompts), initial=len(prompts) - len(seqs), desc="requests", unit="req",
                                dynamic_ncols=True, leave=False)  # callers print their own results and summary
            start, num_steps, num_tokens = time.perf_counter(), 0, 0
            while self.engine.has_unfinished():
                finished = [seq for seq in self.engine.step() if seq.request_id in index_of]
                num_steps += 1
                for seq in finished:
                    index = index_of[seq.request_id]
                    outputs[index] = self._output(index, prompts[index], seq)
                    deliver(outputs[index])
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
        return outputs

    def _warm_up(self, params: list[SamplingParams]):
        """At the first use of each method and kind of routing, run `serve`'s warm-up requests of them (through the
        first layer: engine/warmup.py), so that their kernel variants compile here, once, not in the middle of
        decoding. Its time goes to `warm_up_seconds` and the log. CUDA graphs are still captured lazily, at a shape's
        second sighting: unlike a server's batches, an offline call's repeat their shapes, and the captures pay for
        themselves within the call (H100, random LLaDA-8B, one request of 256 + 256 tokens: Flash-Verify 4.4-4.9 s
        with them against 7.6 s without, Elastic-Cache 4.4-5.3 s against 11.4 s; benchmarks/RESULTS.md)."""
        if not compiles_on_first_use(self.runner) or self.workers is not None:  # the warm-up is one rank's
            return
        for key in dict.fromkeys((p.method, warm_up_routing(p.kv_routing)) for p in params):
            if key in self.warm_up_seconds:
                continue
            self.warm_up_seconds[key] = 0.0  # its own requests find it warm
            start = time.perf_counter()
            requests = warm_up_requests(self, (key[0],), (key[1],))
            self.warm_up_seconds[key] = time.perf_counter() - start
            logger.info("warm-up of %s%s: %d requests in %.2f s", key[0], f" ({key[1]} routing)" if key[1] else "",
                        requests, self.warm_up_seconds[key])

    def _output(self, index: int, prompt: Prompt, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt=prompt, prompt_token_ids=seq.prompt_ids,
            text=self.decode(seq.output_ids), token_ids=seq.output_ids, finish_reason=seq.finish_reason,
            nfe=seq.nfe, steps=seq.steps, query_rows=seq.query_rows, time_s=seq.finish_time - seq.start_time,
            index=index, prompt_kv_read=seq.prompt_kv_read)
