"""An independent single-process training loop: the yardstick sharded runs are compared against.

No process group, no FSDP, no fsdp_exp trainer: a plain model, the whole global batch in one
forward, AdamW, the same learning-rate schedule and clipping. It shares with fsdp_exp only what
defines "the same experiment": the model definition, the initialization, the synthetic data.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fsdp_exp.config import RunConfig
from fsdp_exp.preflight import validate
from fsdp_exp.data import build_data
from fsdp_exp.models import build_meta, init_weights
from fsdp_exp.models.attention_mask import packed_inputs
from fsdp_exp.optim import build_scheduler


def reference_losses(cfg: RunConfig, steps: int) -> list[float]:
    return reference_run(cfg, steps)[0]


def reference_run(cfg: RunConfig, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The losses of ``steps`` steps and the trained model (to compare parameters with)."""
    losses, _, model = _train(cfg, steps)
    return losses, model


def reference_steps(cfg: RunConfig, steps: int, forward_samples: Optional[int] = None) -> tuple[list, list]:
    """(losses, gradient norms before clipping) of ``steps`` steps. ``forward_samples``: the sequences one
    forward takes (a run's micro-batch on one data-parallel rank), the global batch cut into forwards of that
    many in order, as the ranks' shares and micro-batches are: a mixture of experts routes each forward on its
    own (its capacity and its load-balancing loss are a forward's), so its losses are those of these forwards."""
    losses, norms, _ = _train(cfg, steps, forward_samples)
    return losses, norms


def _train(cfg: RunConfig, steps: int, forward_samples: Optional[int] = None):
    # The same model, optimizer, data and steps; everything about parallelism and precision at its
    # default: one unsharded fp32 process, the whole global batch at once (or in forwards of forward_samples).
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
    forwards = cfg.trainer.global_batch_size // (forward_samples or cfg.trainer.global_batch_size)
    loads = _ExpertLoads(model)
    for moe in loads.layers:
        moe.aux_loss_weight = 1.0 / forwards  # each forward's balance loss weighs as its share of the loss
    losses, norms = [], []
    for step in range(steps):
        (batch,) = list(data.micro_batches(step))
        optimizer.zero_grad(set_to_none=True)
        loads.reset()
        loss = 0.0
        documents = batch.documents.chunk(forwards) if batch.documents is not None else [None] * forwards
        for inputs, targets, docs in zip(batch.inputs.chunk(forwards), batch.targets.chunk(forwards), documents):
            packed = packed_inputs(docs, cfg.model.attention_mask, cfg.data.positions)  # block_causal's documents
            part = F.cross_entropy(model(inputs, **packed).float().flatten(0, 1), targets.flatten()) / forwards
            part.backward()
            loss += part.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip or float("inf")).item())
        optimizer.step()
        scheduler.step()
        if loads.layers:  # fsdp_exp's MoE (a transformers model's config has no expert_bias_rate)
            loads.balance(cfg.model.expert_bias_rate)
        losses.append(loss)
    return losses, norms, model


class _ExpertLoads:
    """Each MoE layer's routed copies per expert over a step, read from its router's picks (before any capacity
    drops them), and DeepSeek-V3's loss-free balancing from them: each expert's bias moves by the rate toward the
    mean load."""

    def __init__(self, model: torch.nn.Module):
        from fsdp_exp.models.moe import moe_layers

        self.layers = moe_layers(model)
        self.counts = [torch.zeros(m.n_experts) for m in self.layers]
        for m, counts in zip(self.layers, self.counts):
            m.router.register_forward_hook(self._counter(counts))

    @staticmethod
    def _counter(counts: torch.Tensor):
        def count(module, inputs, outputs) -> None:  # outputs: (weights, experts, scores)
            counts.add_(torch.bincount(outputs[1].flatten(), minlength=len(counts)))

        return count

    def reset(self) -> None:
        for counts in self.counts:
            counts.zero_()

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        for m, load in zip(self.layers, self.counts):
            m.router.expert_bias += rate * torch.sign(load.mean() - load)


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
