"""AdamW with linear warm-up then cosine (or constant) learning rate."""

from __future__ import annotations

import math

import torch
from torch import nn

from torch.nn.parallel import DistributedDataParallel

from fsdp_exp.config import OptimConfig
from fsdp_exp.config.schema import LR_SCHEDULES, OPTIMIZERS
from fsdp_exp.errors import fail
from fsdp_exp.models import canonical_name


def build_optimizer(model: nn.Module, cfg: OptimConfig, decay_names: set[str]) -> torch.optim.Optimizer:
    """AdamW; weight decay on the parameters named in ``decay_names`` (the matrices), not on norm
    weights. Names, not shapes, decide: FSDP1 presents parameters as flat 1-D shards."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    named = list(model.named_parameters())
    decay = [p for n, p in named if canonical_name(n) in decay_names]
    no_decay = [p for n, p in named if canonical_name(n) not in decay_names]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at ``step`` (0-based; the factor used for the update of that step)."""
    if step < cfg.lr_warmup_steps:
        return (step + 1) / cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


def check(o: OptimConfig, steps: int) -> None:
    """Preflight's checks of the optim group."""
    if o.name not in OPTIMIZERS:
        fail(f"optim.name={o.name!r} is not available.", f"pass optim={OPTIMIZERS[0]}")
    if not o.lr > 0:
        fail(f"optim.lr={o.lr} must be positive.", "pass a positive learning rate, e.g. optim.lr=3e-4")
    if o.weight_decay < 0:
        fail(f"optim.weight_decay={o.weight_decay} is negative.", "pass optim.weight_decay=0.1 (or 0)")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail(f"optim.betas={list(o.betas)} must be two numbers in [0, 1).", "pass optim.betas=[0.9,0.95]")
    if o.lr_warmup_steps < 0:
        fail(f"optim.lr_warmup_steps={o.lr_warmup_steps} is negative.", "pass optim.lr_warmup_steps=0 or more")
    if o.schedule not in LR_SCHEDULES:
        fail(f"optim.schedule={o.schedule!r} is not one of {', '.join(LR_SCHEDULES)}.", "pass optim.schedule=cosine")
    if not 0 <= o.min_lr_ratio <= 1:
        fail(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].", "pass optim.min_lr_ratio=0.1")
