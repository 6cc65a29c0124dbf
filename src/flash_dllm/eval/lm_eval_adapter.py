"""lm-eval integration: the model `flash_dllm` runs lm-eval's generation tasks through the engine.

lm-eval 0.4 looks models up in its own registry, which importing this module fills; run lm-eval through it:

    python -m flash_dllm.eval.lm_eval_adapter --model flash_dllm \\
        --model_args pretrained=DIR,method=flash-verify,max_tokens=256,block_length=32 --tasks gsm8k

or, from Python, `import flash_dllm.eval.lm_eval_adapter` before `lm_eval.simple_evaluate(model="flash_dllm")`.
model_args: `pretrained` (a checkpoint directory), `dtype`, and any SamplingParams
field (`method`, `max_tokens` (default 256), `block_length`, `threshold`, ...). A diffusion model decodes a
fixed-length canvas, so the generation length comes from `max_tokens`, not from a task's max_gen_toks.
Prompts arrive as finished strings (lm-eval applies the chat template itself with --apply_chat_template).
The device and batch size come from lm-eval's --device and --batch_size (its default batch size is 1).
"""
from __future__ import annotations

import logging
import sys

from ..extras import MissingExtra, require_extra

try:  # before lm_eval's imports below
    require_extra("lm-eval", "flash_dllm.eval.lm_eval_adapter", "lm_eval")
except MissingExtra as missing:
    if __name__ != "__main__":
        raise
    print(f"error: {missing}", file=sys.stderr)  # the command line: one line, not a traceback
    sys.exit(2)

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..llm import LLM
from ..sampling_params import SamplingParams, knobs
from .scoring import truncate

DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_TOKENS = 256


@register_model("flash_dllm", "flash-dllm")
class FlashDLLM(LM):
    def __init__(self, pretrained: str | None = None, device: str | None = None, dtype: str | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 quantization: str | None = None, tensor_parallel_size: int = 1, **sampling):
        super().__init__()  # max_batch_size: lm-eval's cap for its automatic batch search, unused here
        fields = {"method", "max_tokens", "block_length", "temperature", "seed", *knobs()}
        unknown = sorted(set(sampling) - fields)
        if unknown:
            raise ValueError(f"unknown model_args {', '.join(unknown)}; flash_dllm takes pretrained, device, dtype, "
                             f"batch_size, quantization, the SamplingParams fields and the methods' knobs: "
                             f"{', '.join(sorted(fields))}")
        self.params = SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS, **sampling})
        # lm-eval's "auto" batch size means "as large as fits": the engine's batch is fixed, use the default
        batch = int(batch_size) if str(batch_size).isdigit() else DEFAULT_BATCH_SIZE
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's default is cuda:0
            logging.getLogger(__name__).warning("no GPU: flash_dllm runs on the CPU instead of %s", device)
            device = "cpu"
        self.llm = LLM(pretrained, device=device, dtype=dtype, max_batch_size=batch, chat_template=False,
                       quantization=quantization, tensor_parallel_size=int(tensor_parallel_size))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """All requests in one batched generate; each output cut at its first stop string."""
        if not requests:
            return []
        contexts = [request.args[0] for request in requests]
        outputs = self.llm.generate(contexts, self.params, use_tqdm=not disable_tqdm)
        texts = []
        for request, out in zip(requests, outputs):
            until = request.args[1].get("until") or ()
            text = truncate(out.text, (until,) if isinstance(until, str) else tuple(until))
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def loglikelihood(self, requests):
        raise NotImplementedError(
            "flash_dllm generates text only: loglikelihood (multiple-choice and perplexity tasks) is not supported. "
            "Use lm-eval tasks scored from generations (output_type generate_until), e.g. gsm8k, minerva_math, "
            "humaneval, mbpp.")

    def loglikelihood_rolling(self, requests):
        return self.loglikelihood(requests)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.llm.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.llm.tokenizer.chat_template if chat_template else None


def main():
    """lm-eval's own command line, with `flash_dllm` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())


if __name__ == "__main__":
    main()
