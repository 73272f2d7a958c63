"""An independent single-process training loop: the yardstick sharded runs are compared against.

No process group, no FSDP, no fsdp_exp trainer: a plain model, the whole global batch in one
forward, AdamW, the same learning-rate schedule and clipping. It shares with fsdp_exp only what
defines "the same experiment": the model definition, the initialization, the synthetic data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_exp.config import RunConfig
from fsdp_exp.preflight import validate
from fsdp_exp.data import build_data
from fsdp_exp.models import build_meta, init_weights
from fsdp_exp.optim import build_scheduler


def reference_losses(cfg: RunConfig, steps: int) -> list[float]:
    return reference_run(cfg, steps)[0]


def reference_run(cfg: RunConfig, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The losses of ``steps`` steps and the trained model (to compare parameters with)."""
    # The same model, optimizer, data and steps; everything about parallelism and precision at its
    # default: one unsharded fp32 process, the whole global batch at once.
    cfg = RunConfig(model=cfg.model, optim=cfg.optim, data=cfg.data, trainer=cfg.trainer)
    cfg.trainer.nproc_per_node = "1"
    cfg.trainer.micro_batch_size = None
    topology = validate(cfg, cuda_devices=0)
    torch.manual_seed(cfg.trainer.seed)
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, cfg.trainer.seed, torch.device("cpu"))
    # Weight decay on matrices only, decided here by shape (the framework decides by name).
    o = cfg.optim
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.steps)
    data = build_data(cfg, topology, dp_rank=0, device=torch.device("cpu"))
    losses = []
    for step in range(steps):
        (batch,) = list(data.micro_batches(step))
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch.inputs).float().flatten(0, 1), batch.targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip or float("inf"))
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, model


def hf_export_logits_gap(export_dir, checkpoint_dir) -> tuple[float, dict]:
    """(the largest |logit| difference between transformers' LlamaForCausalLM loaded from ``export_dir`` and
    fsdp_exp's model loaded from the checkpoint at ``checkpoint_dir``, that checkpoint's state). Set
    HF_HUB_OFFLINE before calling (monkeypatch: a variable left set changes later tests' hub refusals)."""
    from transformers import LlamaForCausalLM

    from fsdp_exp.config import ModelConfig
    from fsdp_exp.export import load_checkpoint_model

    state, model_cfg = load_checkpoint_model(checkpoint_dir)
    ours = build_meta(ModelConfig(**model_cfg))
    ours.to_empty(device="cpu")
    ours.init_buffers(torch.device("cpu"))
    ours.load_state_dict(state)
    hf = LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item(), state
