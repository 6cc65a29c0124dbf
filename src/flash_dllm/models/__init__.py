from .llada import LLaDAModel
from .loader import build_model, load_model, random_model, save_checkpoint

__all__ = ["LLaDAModel", "build_model", "load_model", "random_model", "save_checkpoint"]
