from .base import DiffusionLM
from .llada import LLaDAModel
from .loader import (ARCHITECTURES, build_model, config_from_dir, load_model, parse_config, random_model,
                     save_checkpoint)

__all__ = ["ARCHITECTURES", "DiffusionLM", "LLaDAModel", "build_model", "config_from_dir", "load_model",
           "parse_config", "random_model", "save_checkpoint"]
