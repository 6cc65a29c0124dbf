"""Checkpoint I/O: the architecture registry (config.json's model_type and architectures -> its DiffusionLM class),
stream Hugging Face safetensors (sharded or single) into a model, save in the same format, or fill a model of a
named configuration with random weights directly on its device. A model whose weights cannot fit the device's
memory is refused before anything is allocated."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import PRESETS, ModelConfig, read_config_json
from .base import ELSEWHERE, DiffusionLM, Pieces, Placement, Shard
from .dream import DreamModel
from .layers import RMSNorm
from .llada import LLaDAModel
from .llada2 import LLaDA2Model
from .llada_moe import LLaDAMoEModel
from .parallel import TensorParallel
from .quantization import Fp8Linear, check_quantization, quantize_linears

# One entry per architecture: its name (the first of its `architectures`) -> its class (which parses its config.json).
ARCHITECTURES: dict[str, type[DiffusionLM]] = {}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def register(cls: type[DiffusionLM]) -> type[DiffusionLM]:
    """Add an architecture (its class, with its model_type and at least one architecture name) to the table."""
    if not cls.architectures:
        raise ValueError(f"{cls.__name__} declares no architectures (config.json's names of it)")
    for name in cls.architectures:
        if any(name in other.architectures for other in ARCHITECTURES.values()):
            raise ValueError(f"an architecture named {name!r} is already registered")
    ARCHITECTURES[cls.architectures[0]] = cls
    return cls


for _architecture in (LLaDAModel, DreamModel, LLaDA2Model, LLaDAMoEModel):
    register(_architecture)


def architecture_of(hf_config: dict) -> type[DiffusionLM]:
    """The class of a config.json: of its model_type, the one that implements one of its `architectures`; where
    config.json lists none, the model_type's first entry."""
    model_type, names = hf_config.get("model_type"), hf_config.get("architectures") or []
    of_type = [cls for cls in ARCHITECTURES.values() if cls.model_type == model_type]
    named = [cls for cls in of_type if set(names) & set(cls.architectures)]
    if named or (of_type and not names):
        return (named or of_type)[0]
    supported = ", ".join(f"{cls.model_type!r} ({', '.join(cls.architectures)})" for cls in ARCHITECTURES.values())
    what = f"model_type {model_type!r}" + (f" with architectures {names}" if of_type else "")
    raise ValueError(f"config.json: {what} is not supported (supported: {supported})")


def parse_config(hf_config: dict) -> ModelConfig:
    """A config.json's contents, by the parser of its architecture."""
    return architecture_of(hf_config).parse_config(hf_config)


def config_from_dir(path: str | Path) -> ModelConfig:
    return parse_config(read_config_json(path))


@contextlib.contextmanager
def _without_default_init():
    """nn.Linear's and nn.Embedding's default initialisation skipped: the weights are loaded or drawn afterwards, and
    on the meta device torch runs it through its reference decompositions, whose first use imports torch._dynamo
    (1.6 s of every process's start)."""
    names = ("uniform_", "normal_", "kaiming_uniform_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(torch.nn.init, name, init)


def build_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                name: str = "the model", quantization: str | None = None,
                tp: TensorParallel | None = None) -> DiffusionLM:
    """An uninitialised model, allocated once, directly on `device` in `dtype` (its decoder layers' projections in
    FP8 with quantization="fp8"; under tensor parallelism `tp`, this rank's shard); refused (ValueError, naming the
    model as `name`) when its weights need more memory than the device has available."""
    with torch.device("meta"), _without_default_init():
        model = ARCHITECTURES[cfg.architecture](cfg, tp).to(dtype=dtype)
        if check_quantization(quantization) == "fp8":
            quantize_linears(model)
    check_fits(model, torch.device(device), name)
    model = model.to_empty(device=device)
    return model.eval().requires_grad_(False)


def available_memory(device: torch.device) -> int | None:
    """Bytes that `device` can still allocate: CUDA's free memory; on the CPU, MemAvailable (free memory plus the
    page cache the kernel can reclaim); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name (macOS)
        return None


def check_fits(model: DiffusionLM, device: torch.device, name: str):
    """Refuse a model (still on the meta device) whose weights exceed `device`'s available memory: on the CPU the
    kernel's OOM killer would otherwise end the process without a word, part way through the allocation."""
    if device.type == "meta":
        return
    needed = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    available = available_memory(device)
    if available is None or needed <= available:
        return
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    where, hint = (("the CPU", "use a GPU (--device cuda) or a smaller model") if device.type == "cpu" else
                   (str(device), "use a GPU with more free memory or a smaller model"))
    raise ValueError(f"{name} needs {needed / 1e9:.1f} GB for its weights in {dtype}, {where} has "
                     f"{available / 1e9:.1f} GB available; {hint}")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               quantization: str | None = None, tp: TensorParallel | None = None) -> DiffusionLM:
    """Load a checkpoint directory (config.json + safetensors) without remote code or downloads.

    Tensors are read one at a time from each shard straight to `device` and cast (or with quantization="fp8",
    quantised) into the pre-allocated parameters, so neither host nor device memory ever holds a second copy of
    the model. Under tensor parallelism `tp`, a rank reads only its part of each tensor (an FP8 row-parallel weight
    whole: its scales are its whole rows'). Weights that are NaN or inf once cast to `dtype` are refused, naming the
    tensor.
    """
    path = Path(path)
    cfg = config_from_dir(path)
    files = weight_files(path)
    model = build_model(cfg, device, dtype, name=str(path), quantization=quantization, tp=tp)
    load_weights(model, files, device)
    return model


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard listed in {INDEX_FILE} is missing")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")


def load_weights(model: DiffusionLM, files: list[Path], device: str | torch.device):
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    loaded: dict[str, Path] = {}
    nonfinite: dict[str, torch.Tensor] = {}  # per tensor, on the device: read once at the end
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                if name not in layout:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for this model's config.json")
                if name in loaded:
                    raise ValueError(f"{file.name}: tensor {name!r} also appears in {loaded[name].name}")
                placement = layout[name]
                expected = _checkpoint_shape(params[placement.param], placement)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {list(shape)}, "
                                     f"but config.json implies {list(expected)}")
                if placement.shard == ELSEWHERE:
                    loaded[name] = file
                    continue

                def read(shard: Shard | Pieces | None, f=f, name=name, file=file) -> torch.Tensor:
                    if shard is None:
                        tensor = f.get_tensor(name)
                    else:
                        parts = shard.parts if isinstance(shard, Pieces) else (shard,)
                        tensor = torch.cat([f.get_slice(name)[(slice(None),) * part.dim + (slice(part.start,
                                                                                                  part.stop),)]
                                            for part in parts], dim=shard.dim)
                    if not tensor.is_floating_point():
                        raise ValueError(f"{file.name}: tensor {name!r} has dtype {tensor.dtype}, expected floating "
                                         f"point")
                    return tensor
                nonfinite[name] = _place(model, params, placement, read)
                loaded[name] = file
    missing = [name for name in layout if name not in loaded]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:3])}{more}")
    counts = torch.stack(list(nonfinite.values())).tolist()
    bad = [(name, count) for name, count in zip(nonfinite, counts) if count]
    if bad:  # NaN or inf weights give garbage or NaN logits at every step: refuse them now, by name
        (name, count), weights = bad[0], params[layout[name].param]
        more = f"; {len(bad) - 1} more tensors too" if len(bad) > 1 else ""
        raise ValueError(f"{loaded[name].name}: tensor {name!r} has NaN or inf values ({count:,} as "
                         f"{str(weights.dtype).removeprefix('torch.')}{more})")


def _checkpoint_shape(param: torch.Tensor, placement: Placement) -> tuple[int, ...]:
    """The whole checkpoint tensor's shape that the model's config implies."""
    shape = list(param.shape if placement.rows is None else param[placement.rows].shape)
    if placement.shard not in (None, ELSEWHERE):
        shape[placement.shard.dim] = placement.shard.size
    return tuple(shape)


@torch.no_grad()
def _place(model: DiffusionLM, params: dict[str, torch.Tensor], placement: Placement, read) -> torch.Tensor:
    """Fill the placement's parameter rows from read(shard) (the checkpoint tensor's part; read(None): all of it),
    cast or quantised. Returns its count of NaN or inf values after the cast, on the device."""
    module_name, _, kind = placement.param.rpartition(".")
    module, shard = model.get_submodule(module_name), placement.shard
    linear = isinstance(module, Fp8Linear) and kind == "weight"
    if linear or kind in getattr(module, "fp8_params", ()):
        row_parallel = shard is not None and shard.dim == 1  # each output channel's scale from its whole row
        tensor = read(None if row_parallel else shard)
        columns = slice(shard.start, shard.stop) if row_parallel else None
        if linear:
            module.set_weight(tensor, placement.rows, columns)
        else:
            module.set_fp8(kind, tensor, placement.rows, columns)
        return torch.isfinite(tensor).logical_not().sum()
    param = params[placement.param]
    target = param if placement.rows is None else param[placement.rows]
    target.copy_(read(shard))
    return torch.isfinite(target).logical_not().sum()  # after the cast: overflow too


def random_config(spec: str) -> ModelConfig:
    """The configuration named by `random:SPEC`: a preset (see config.PRESETS) or a directory with a config.json."""
    if spec in PRESETS:
        return parse_config(PRESETS[spec])
    if Path(spec).is_dir():
        return config_from_dir(spec)
    raise ValueError(f"random:{spec}: not a preset ({', '.join(PRESETS)}) or a directory with config.json")


def random_model(spec: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02, quantization: str | None = None, tp: TensorParallel | None = None) -> DiffusionLM:
    """A model with random weights of `random_config(spec)`, drawn directly on `device` (FP8 weights are drawn in
    `dtype` and quantised: the same model as without quantization, quantised). Under tensor parallelism `tp`, this
    rank's shard of the same model: each parameter is drawn whole, one at a time, and this rank's part kept. Stacked
    experts are drawn an expert at a time (LLaDA2-flash's FP8 model is built on one GPU without a stack in `dtype`:
    4.3 GB a stack in bf16, more in the quantiser's fp32)."""
    cfg = random_config(spec)
    model = build_model(cfg, device, dtype, name=f"random:{spec}", quantization=quantization, tp=tp)
    generator = torch.Generator(device=device).manual_seed(seed)
    if model.tp.size > 1:
        _draw_shards(model, build_model(cfg, "meta", dtype), generator, std, device)
        return model
    draw = lambda shape: torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "bias":
                param.zero_()
            elif isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif name in getattr(module, "stacks", ()):
                for expert in range(param.shape[0]):
                    if name in module.fp8_params:
                        module.set_fp8(name, draw(param.shape[1:]), (expert,))
                    else:
                        param[expert] = draw(param.shape[1:])
            elif isinstance(module, Fp8Linear) or name in getattr(module, "fp8_params", ()):
                drawn = draw(param.shape)
                if isinstance(module, Fp8Linear):
                    module.set_weight(drawn)
                else:
                    module.set_fp8(name, drawn, None)
            else:
                param.normal_(0.0, std, generator=generator)
    return model


def _draw_shards(model: DiffusionLM, whole: DiffusionLM, generator: torch.Generator, std: float,
                 device: str | torch.device):
    """random_model's draws, parameter by parameter of the whole model (on the meta device: its shapes), in its
    order, each placed as the loader places a checkpoint tensor."""
    local, params = model.checkpoint_layout(), dict(model.named_parameters())
    fills: dict[str, list[tuple[str, slice | None]]] = {}  # whole parameter -> its checkpoint tensors
    for name, placement in whole.checkpoint_layout().items():
        fills.setdefault(placement.param, []).append((name, placement.rows))

    def place(drawn: torch.Tensor, fills_of_drawn):
        for name, rows in fills_of_drawn:
            tensor = drawn if rows is None else drawn[rows]
            if local[name].shard != ELSEWHERE:
                _place(model, params, local[name], lambda shard: tensor if shard is None else shard.of(tensor))

    for module_name, module in whole.named_modules():
        for kind, param in module.named_parameters(recurse=False):
            param_fills = fills[f"{module_name}.{kind}" if module_name else kind]
            if kind in getattr(module, "stacks", ()):  # an expert at a time, as random_model draws them
                by_expert = [[] for _ in range(param.shape[0])]
                for name, rows in param_fills:
                    by_expert[rows[0]].append((name, rows[1:]))
                for expert_fills in by_expert:
                    drawn = torch.empty(param.shape[1:], dtype=param.dtype, device=device)
                    place(drawn.normal_(0.0, std, generator=generator), expert_fills)
                continue
            drawn = torch.empty(param.shape, dtype=param.dtype, device=device)
            if kind == "bias":
                drawn.zero_()
            elif isinstance(module, RMSNorm):
                drawn.fill_(1.0)
            else:
                drawn.normal_(0.0, std, generator=generator)
            place(drawn, param_fills)


def save_checkpoint(model: DiffusionLM, path: str | Path, hf_config: dict, num_shards: int = 1,
                    dtype: torch.dtype | None = None):
    """Write `model` as a Hugging Face checkpoint directory: config.json plus one model.safetensors or
    `num_shards` shards with an index, under the checkpoint's own tensor names."""
    if model.tp.size > 1:
        raise ValueError("save_checkpoint writes a whole model; a tensor-parallel rank holds a shard of it")
    if any(isinstance(module, Fp8Linear) for module in model.modules()):
        raise ValueError("save_checkpoint writes the model's dtype; a model with FP8 weights (quantization='fp8') "
                         "is quantised as it loads: save the original checkpoint instead")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for name, (param_name, rows, _) in model.checkpoint_layout().items():
        tensor = params[param_name].detach() if rows is None else params[param_name].detach()[rows]
        tensors[name] = tensor.to(dtype or tensor.dtype, copy=True).contiguous().cpu()
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    if num_shards == 1:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[shard * len(names) // num_shards:(shard + 1) * len(names) // num_shards]
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
