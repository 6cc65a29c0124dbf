"""flash-dllm: a fast inference engine for diffusion language models."""
from .config import ModelConfig
from .llm import LLM, RequestOutput
from .models import load_model
from .sampling_params import SamplingParams

__all__ = ["LLM", "ModelConfig", "RequestOutput", "SamplingParams", "load_model"]
__version__ = "0.1.0"
