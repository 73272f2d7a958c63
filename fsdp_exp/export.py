"""A consolidated copy of the model, for use outside fsdp_exp: ``checkpoint.export=safetensors`` (fsdp_exp's
parameter names, plus ``fsdp_exp_model.json``, the model config) or ``checkpoint.export=hf`` (a Hugging Face
folder that ``AutoModelForCausalLM.from_pretrained`` loads offline).

Consolidation gathers one parameter at a time and only rank 0 keeps it, on the CPU, so no rank holds more
than one unsharded parameter on its device. Under pipeline parallel each stage is gathered onto its first
rank (an ``ExportPart``), which writes its own file of Hugging Face's sharded layout; rank 0 writes the index.
The Hugging Face names, config.json and any rewriting of tensors are the model family's (``ModelSpec.to_hf``,
``hf_config``). A checkpoint exports after the fact, without ranks:
``python -m fsdp_exp.export <checkpoint step_N folder> <out dir> [--format hf|safetensors]``.
More: the docs pages checkpoints.md (Export) and pipeline.md (From the command line).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from fsdp_exp.config.schema import ModelConfig

MODEL_FILE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"  # Hugging Face's sharded layout: tensor name -> its file
MODEL_CONFIG = "fsdp_exp_model.json"


@dataclass
class ExportPart:
    """This rank's part of a model consolidated in parts (pipeline stages): ``state`` (full tensors on the
    CPU, the full model's names) on the part's writer, ``{}`` on the other ranks; part ``index`` of ``count``."""

    state: dict
    index: int
    count: int

    @property
    def file(self) -> str:
        return f"model-{self.index + 1:05d}-of-{self.count:05d}.safetensors"


# ------------------------------------------------------------------------------ consolidation
def full_state_dict(model, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the full model on the CPU under canonical names, others ``{}``.
    ``cpu_offload=False`` gathers on the model's device on every rank (each holds it for a moment), for a
    backend that cannot offload there."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    return state if cpu_offload or dist.get_rank() == 0 else {}


def gathered(state: dict, keep: bool) -> dict[str, torch.Tensor]:
    """Each DTensor of ``state`` all-gathered over its mesh, one at a time (every rank of the mesh calls it);
    the full tensors on the CPU where ``keep``, else ``{}``."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, tensor in state.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            out[name] = full.detach().cpu()
        del full
    return out


def export_dir(setting: Optional[str], run_dir: Path) -> Path:
    """``checkpoint.export_dir``, or ``<run dir>/export`` when it is unset."""
    return Path(setting).expanduser() if setting else Path(run_dir) / "export"


def export_model(model, model_cfg, fmt: str, out: Path, is_main: bool, consolidate=full_state_dict) -> Optional[dict]:
    """At the end of a run (every rank): consolidate ``model`` and write it to ``out``.

    Args:
        model: the run's parallelized model (every rank calls this with its own shard or stages).
        model_cfg: the model config (``cfg.model``), written beside the tensors.
        fmt: ``checkpoint.export``: ``"safetensors"`` or ``"hf"``.
        out: the export folder (``export_dir``).
        is_main: whether this is rank 0, which writes a whole model or the pipeline index.
        consolidate: the backend's ``full_state_dict`` (a dict on rank 0, or an ``ExportPart`` per rank).

    Returns:
        On rank 0 what it wrote (format, folder, files, bytes, tensors, ``export_s``); None on the others.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    state = consolidate(model)
    written = None
    if isinstance(state, ExportPart):  # pipeline stages: one file per part, then rank 0's index
        if state.state:
            write_export(state.state, model_cfg, out, fmt, part=state)
        dist.barrier()
        if is_main:
            written = write_index(model_cfg, out, fmt, state.count)
    elif is_main:
        written = write_export(state, model_cfg, out, fmt)
    if written:
        written["export_s"] = round(time.perf_counter() - t0, 4)
    del state
    dist.barrier()
    return written


def write_export(
    state: dict[str, torch.Tensor], model_cfg, out: Path, fmt: str, part: Optional[ExportPart] = None
) -> dict:
    """Write the model (``state``: every tensor) as ``fmt`` into ``out``, or with ``part`` that part's file
    only (``write_index`` then writes the config and the index)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":  # the family's names (fsdp_exp.models.spec)
        from fsdp_exp.models import spec_for

        cfg = model_config(_plain(model_cfg))
        tensors = spec_for(cfg).to_hf(state, cfg)
    else:
        tensors = dict(state)
    if part is None:
        _write_model_config(model_cfg, out, fmt)
        (out / MODEL_INDEX).unlink(missing_ok=True)  # an earlier export's parts would shadow this file
    path = out / (part.file if part else MODEL_FILE)
    _save_safetensors(tensors, path, {"format": "pt", "producer": "fsdp_exp"})
    return {"format": fmt, "dir": str(out), "file": str(path), "bytes": path.stat().st_size, "tensors": len(tensors)}


def write_index(model_cfg, out: Path, fmt: str, count: int) -> dict:
    """After every part's file is written: the config and Hugging Face's index of the parts (each tensor's
    file, the total bytes), read from the files' headers."""
    from safetensors import safe_open

    out = Path(out)
    _write_model_config(model_cfg, out, fmt)
    files = [ExportPart({}, i, count).file for i in range(count)]
    weight_map, total = {}, 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                sliced = f.get_slice(key)
                total += math.prod(sliced.get_shape()) * _DTYPE_BYTES[sliced.get_dtype()]
    index = out / MODEL_INDEX
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / MODEL_FILE).unlink(missing_ok=True)  # an earlier single-file export would be read instead
    return {
        "format": fmt,
        "dir": str(out),
        "file": str(index),
        "files": [str(out / name) for name in files],
        "bytes": sum((out / name).stat().st_size for name in files),
        "tensors": len(weight_map),
    }


# safetensors' dtype names -> bytes per element (what the index's total_size counts)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _plain(model_cfg) -> dict:
    from dataclasses import asdict, is_dataclass

    return asdict(model_cfg) if is_dataclass(model_cfg) else dict(model_cfg)


def _write_model_config(model_cfg, out: Path, fmt: str) -> None:
    """config.json (``hf``: the family's, fsdp_exp.models.spec) or fsdp_exp's model config (``safetensors``)."""
    model = _plain(model_cfg)
    if fmt == "hf":
        from fsdp_exp.models import spec_for

        cfg = model_config(model)
        (out / "config.json").write_text(json.dumps(spec_for(cfg).hf_config(cfg), indent=2) + "\n")
    else:
        (out / MODEL_CONFIG).write_text(json.dumps(model, indent=2) + "\n")


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
    if meta["config"].get("parallel", {}).get("pp", 1) > 1:  # saved per rank's stages: "<local stage>.<name>"
        state = full_model_names(state)
    return state, meta["config"]["model"]


def full_model_names(state: dict) -> dict:
    """A rank's stages' state (a pipeline run's ``nn.ModuleList``: ``<local stage>.<name>``, as its checkpoints
    hold it) under the full model's names (each stage keeps its parameters' names in the full model)."""
    return {key.partition(".")[2]: value for key, value in state.items()}


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
