from .base import DiffusionLM
from .hub import resolve_checkpoint
from .llada import LLaDAModel
from .loader import (ARCHITECTURES, build_model, config_from_dir, load_model, parse_config, random_model, register,
                     save_checkpoint)

__all__ = ["ARCHITECTURES", "DiffusionLM", "LLaDAModel", "build_model", "config_from_dir", "load_model",
           "parse_config", "random_model", "register", "resolve_checkpoint", "save_checkpoint"]
