"""DeepSeek-V3's router (``fsdp_exp.models.moe`` picks it when ``model.expert_groups`` > 1 or
``model.routed_scaling`` is not 1): group-limited top-k with a routed scaling factor.

The experts are cut into ``expert_groups`` equal groups of consecutive experts. A token first keeps its
``expert_groups_top_k`` best groups, each group scored by the sum of its two best experts, then picks its top k
experts among those groups only (DeepSeek-V3 spreads the groups over nodes, so a token's experts sit on few of
them). Scores are sigmoid (DeepSeek-V3, Kimi K2) or softmax; the loss-free balancing bias (``expert_bias``, the
same buffer and update as the plain router's) shifts which groups and experts are picked, never the weights.
The picked scores are renormalized to sum to 1 (``model.router_renormalize``) and then scaled by
``model.routed_scaling``, which makes up for the small sigmoid weights against the shared expert's output.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupLimitedRouter(nn.Module):
    """The same interface as ``fsdp_exp.models.moe.Router``: ``forward(x)`` of x (tokens, dim) gives (weights
    (tokens, k) fp32, experts (tokens, k), scores (tokens, n_experts) fp32)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score: str,
        renormalize: bool,
        groups: int,
        top_groups: int,
        scaling: float,
    ):
        super().__init__()
        self.top_k, self.score, self.renormalize = top_k, score, renormalize
        self.groups, self.top_groups, self.scaling = groups, top_groups, scaling
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Persistent: a resumed run picks experts as the interrupted one would have.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    @classmethod
    def of(cls, cfg) -> "GroupLimitedRouter":
        """The router of a model config (``model.n_experts``, ``experts_top_k``, ``router_score``,
        ``router_renormalize``, ``expert_groups``, ``expert_groups_top_k``, ``routed_scaling``)."""
        return cls(
            cfg.dim,
            cfg.n_experts,
            cfg.experts_top_k,
            cfg.router_score,
            cfg.router_renormalize,
            cfg.expert_groups,
            cfg.expert_groups_top_k,
            cfg.routed_scaling,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias
        if self.groups > 1:
            grouped = choice.view(choice.shape[0], self.groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(self.top_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts, scores
