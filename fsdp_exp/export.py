"""A consolidated copy of the model, for use outside fsdp_exp.

- ``checkpoint.export=safetensors``: ``<export dir>/model.safetensors`` with fsdp_exp's parameter
  names (``layers.0.attention.wq.weight``, ...) plus ``fsdp_exp_model.json`` (the model config).
- ``checkpoint.export=hf``: a Hugging Face folder (``config.json`` + ``model.safetensors`` with HF
  names) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads offline: a LlamaForCausalLM
  for Llama, the model's own architecture for ``model=hf`` (whose names are transformers' already).

Consolidation: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` all-gathers one
parameter at a time; only rank 0 keeps each full tensor, on the CPU; the other ranks get nothing.
So no rank holds more than one unsharded parameter on its device, and only rank 0 the full model on
the host.

The Hugging Face names, the config.json and any rewriting of tensors (Llama's rotary layout) are
the model family's (``ModelSpec.to_hf`` / ``hf_config``, for Llama in fsdp_exp.models.llama_spec).

A checkpoint can be exported after the fact, without ranks:
``python -m fsdp_exp.export <checkpoint step_N folder> <out dir> [--format hf|safetensors]``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from fsdp_exp.config.schema import ModelConfig

MODEL_FILE = "model.safetensors"
MODEL_CONFIG = "fsdp_exp_model.json"


# ------------------------------------------------------------------------------ consolidation
def full_state_dict(model, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the full model on the CPU under canonical names, others ``{}``.
    ``cpu_offload=False`` gathers on the model's device on every rank (each holds it for a moment), for a
    backend that cannot offload there."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    return state if cpu_offload or dist.get_rank() == 0 else {}


def export_dir(setting: Optional[str], run_dir: Path) -> Path:
    """``checkpoint.export_dir``, or ``<run dir>/export`` when it is unset."""
    return Path(setting).expanduser() if setting else Path(run_dir) / "export"


def export_model(model, model_cfg, fmt: str, out: Path, is_main: bool, consolidate=full_state_dict) -> Optional[dict]:
    """At the end of a run (every rank): consolidate ``model`` (with ``consolidate``: the backend's
    ``full_state_dict``) and write it as ``fmt`` (``checkpoint.export``) to ``out``. Rank 0 (``is_main``)
    returns what it wrote, the others None."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    state = consolidate(model)
    written = None
    if is_main:
        written = write_export(state, model_cfg, out, fmt)
        written["export_s"] = round(time.perf_counter() - t0, 4)
    del state
    dist.barrier()
    return written


def write_export(state: dict[str, torch.Tensor], model_cfg, out: Path, fmt: str) -> dict:
    from dataclasses import asdict, is_dataclass

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = asdict(model_cfg) if is_dataclass(model_cfg) else dict(model_cfg)
    if fmt == "hf":  # the family's names and config.json (fsdp_exp.models.spec)
        from fsdp_exp.models import spec_for

        cfg = model_config(model)
        spec = spec_for(cfg)
        tensors = spec.to_hf(state, cfg)
        (out / "config.json").write_text(json.dumps(spec.hf_config(cfg), indent=2) + "\n")
    else:
        tensors = dict(state)
        (out / MODEL_CONFIG).write_text(json.dumps(model, indent=2) + "\n")
    path = out / MODEL_FILE
    _save_safetensors(tensors, path, {"format": "pt", "producer": "fsdp_exp"})
    return {"format": fmt, "dir": str(out), "file": str(path), "bytes": path.stat().st_size, "tensors": len(tensors)}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    seen: set = set()
    unique = {}
    for name, tensor in tensors.items():  # safetensors refuses tensors that share storage (tied weights)
        tensor = tensor.detach().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        unique[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    tmp = path.with_suffix(".safetensors.tmp")
    save_file(unique, str(tmp), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as any file this process writes (safetensors creates it private)
    tmp.replace(path)


def model_config(model: dict) -> "ModelConfig":
    """The model config of a run's or a checkpoint's record, typed by its family's schema (keys it lacks
    take the schema's defaults)."""
    from fsdp_exp.config.schema import model_schema

    schema = model_schema(model)
    return schema(**{k: v for k, v in model.items() if k in schema.__dataclass_fields__})


# ------------------------------------------------------------------------- from a checkpoint
def load_checkpoint_model(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(full model state under canonical names, model config) of a DCP checkpoint folder, read in this
    process without a process group (the optimizer state is not read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from fsdp_exp.checkpoint import read_meta

    path = Path(path)
    meta = read_meta(path)
    keys = [k for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")]
    with warnings.catch_warnings():  # "no process group: loading in this process", which is the point
        warnings.simplefilter("ignore")
        loaded = _load_state_dict_from_keys(set(keys), checkpoint_id=str(path))
    state = {k.removeprefix("model."): v for k, v in _flatten(loaded).items()}
    return state, meta["config"]["model"]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fsdp_exp.export", description="Export a fsdp_exp checkpoint (a step_<N> folder) as safetensors."
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=("hf", "safetensors"), default="hf")
    args = parser.parse_args(argv)
    state, model = load_checkpoint_model(args.checkpoint)
    print(json.dumps(write_export(state, model, args.out, args.format), indent=2))


if __name__ == "__main__":
    main()
