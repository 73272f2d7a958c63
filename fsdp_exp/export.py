"""A consolidated copy of the model, for use outside fsdp_exp.

- ``checkpoint.export=safetensors``: ``<export dir>/model.safetensors`` with fsdp_exp's parameter
  names (``layers.0.attention.wq.weight``, ...) plus ``fsdp_exp_model.json`` (the model config).
- ``checkpoint.export=hf``: a Hugging Face Llama folder (``config.json`` + ``model.safetensors`` with
  HF names) that ``transformers.LlamaForCausalLM.from_pretrained`` loads offline.

Consolidation: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` all-gathers one
parameter at a time; only rank 0 keeps each full tensor, on the CPU; the other ranks get nothing.
So no rank holds more than one unsharded parameter on its device, and only rank 0 the full model on
the host.

Rotary embeddings: fsdp_exp rotates interleaved pairs (x[2i], x[2i+1]) like Meta's original Llama;
HF's LlamaForCausalLM rotates halves (x[i], x[i + d/2]). The rows of wq and wk are permuted per head
on export (as in HF's convert_llama_weights_to_hf.py), which leaves q.k, and so the model, unchanged.

A checkpoint can be exported after the fact, without ranks:
``python -m fsdp_exp.export <checkpoint step_N folder> <out dir> [--format hf|safetensors]``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

MODEL_FILE = "model.safetensors"
MODEL_CONFIG = "fsdp_exp_model.json"


# ------------------------------------------------------------------------------ consolidation
def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the full model on the CPU under canonical names, others ``{}``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_model(trainer) -> Optional[dict]:
    """At the end of a run (every rank): write ``checkpoint.export`` to ``checkpoint.export_dir``. Rank 0
    returns what it wrote."""
    import torch.distributed as dist

    cfg = trainer.cfg
    out = Path(cfg.checkpoint.export_dir).expanduser() if cfg.checkpoint.export_dir else Path(trainer.run_dir) / "export"
    t0 = time.perf_counter()
    state = full_state_dict(trainer.model)
    written = None
    if trainer.info.is_main:
        written = write_export(state, cfg.model, out, cfg.checkpoint.export)
        written["export_s"] = round(time.perf_counter() - t0, 4)
    del state
    dist.barrier()
    return written


def write_export(state: dict[str, torch.Tensor], model_cfg, out: Path, fmt: str) -> dict:
    from dataclasses import asdict, is_dataclass

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = asdict(model_cfg) if is_dataclass(model_cfg) else dict(model_cfg)
    if fmt == "hf":
        tensors, config = to_hf(state, model), hf_config(model)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        tensors = dict(state)
        (out / MODEL_CONFIG).write_text(json.dumps(model, indent=2) + "\n")
    path = out / MODEL_FILE
    _save_safetensors(tensors, path, {"format": "pt", "producer": "fsdp_exp"})
    return {"format": fmt, "dir": str(out), "file": str(path), "bytes": path.stat().st_size,
            "tensors": len(tensors)}


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


# ------------------------------------------------------------------------------ Hugging Face
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered per head from interleaved pairs to halves."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(state: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    if model.get("n_experts", 0) > 0:
        raise ValueError("HF export writes LlamaForCausalLM; a mixture-of-experts model has no such layout")
    n_heads = model["n_heads"]
    n_kv = model.get("n_kv_heads") or n_heads
    out = {}
    for name, tensor in state.items():
        if name in TOP_NAMES:
            if name == "output.weight" and model.get("tie_embeddings"):
                continue  # HF ties lm_head to embed_tokens itself
            out[TOP_NAMES[name]] = tensor
            continue
        parts = name.split(".", 2)
        if parts[0] != "layers" or parts[2] not in LAYER_NAMES:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        if parts[2] == "attention.wq.weight":
            tensor = interleaved_to_half(tensor, n_heads)
        elif parts[2] == "attention.wk.weight":
            tensor = interleaved_to_half(tensor, n_kv)
        out[f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"] = tensor
    return out


def hf_config(model: dict) -> dict:
    from fsdp_exp.config import ModelConfig
    from fsdp_exp.models.llama import ffn_hidden_dim

    fields = {k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["dim"],
        "intermediate_size": ffn_hidden_dim(ModelConfig(**fields)),
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model.get("n_kv_heads") or model["n_heads"],
        "head_dim": model["dim"] // model["n_heads"],
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "rope_scaling": None,
        "tie_word_embeddings": bool(model.get("tie_embeddings")),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": model.get("init_std", 0.02),
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


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

    parser = argparse.ArgumentParser(prog="python -m fsdp_exp.export",
                                     description="Export a fsdp_exp checkpoint (a step_<N> folder) as safetensors.")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=("hf", "safetensors"), default="hf")
    args = parser.parse_args(argv)
    state, model = load_checkpoint_model(args.checkpoint)
    print(json.dumps(write_export(state, model, args.out, args.format), indent=2))


if __name__ == "__main__":
    main()
