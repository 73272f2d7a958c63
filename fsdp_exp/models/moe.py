"""A mixture-of-experts feed-forward as large MoE models are trained: a token-choice top-k router, routed
SwiGLU experts stored as stacked weights and run through one grouped matmul (``torch._grouped_mm``) on the
tokens sorted by expert, optional always-on shared experts, and two ways to balance the load: an auxiliary
loss (``model.aux_loss_coef``) and DeepSeek-V3's loss-free expert bias (``model.expert_bias_rate``).

Dropless by default: every routed copy of every token is computed. ``model.capacity_factor`` caps each
expert at ``capacity_factor x tokens x top_k / n_experts`` copies per forward (the tokens of this rank's
micro-batch); the copies past it are dropped (their share of the token is zero, and they are neither computed
nor sent to another rank) and counted (``MoE.dropped``). The balancing (aux loss, loss-free bias) reads the
assignment before dropping, as Switch and GShard balance it: a dropped copy still says its expert was wanted.

The layer never asks where its experts live: ``MoE.experts`` is called with the routed tokens sorted by
expert and the count per expert, and returns their outputs in the same order. Expert parallel
(``fsdp_exp.parallel.expert``) replaces that one call by a dispatch to the ranks holding the experts and
the combine back. ``dense_reference`` is the same layer computed densely (every expert on every token, mixed
by the routing weights): the yardstick the tests compare the grouped path with.

    python -m fsdp_exp model=moe_tiny                  # 4 experts, top-2, on 2 CPU ranks
    python -m fsdp_exp.plan model=qwen3_moe_30b_a3b    # 128 experts, top-8: total and active parameters
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_exp.models.router import GroupLimitedRouter

ROUTER_SCORES = ("softmax", "sigmoid")


def moe_hidden_dim(cfg, ffn_hidden: int) -> int:
    """One routed expert's SwiGLU width: ``model.moe_hidden_dim``, else the dense feed-forward's."""
    return cfg.moe_hidden_dim or ffn_hidden


class Router(nn.Module):
    """Scores every expert for every token and picks each token's top k.

    ``softmax`` (Mixtral, Qwen3-MoE): probabilities over the experts, the picked ones renormalized to sum
    to 1 when ``renormalize``. ``sigmoid`` (DeepSeek-V3): an independent score per expert, the picked ones
    always normalized. The expert bias (loss-free balancing) shifts which experts are picked, never the
    weights the picked experts' outputs are mixed with, as DeepSeek-V3 describes it.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str, renormalize: bool):
        super().__init__()
        self.top_k, self.score, self.renormalize = top_k, score, renormalize
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Persistent: a resumed run picks experts as the interrupted one would have.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (weights (tokens, k) fp32, experts (tokens, k), scores (tokens, n_experts) fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.score == "sigmoid" or self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, scores


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts as three stacked weights, (experts, out, in) like nn.Linear's, so that
    each expert's slice is what its own nn.Linear would hold (and what sharding over dim 0 splits by expert).

    ``forward(x, counts)``: x holds the routed tokens sorted by expert, ``counts[e]`` of them for expert e
    (the rows past their sum are padding and come back as zeros).
    """

    def __init__(self, n_experts: int, dim: int, hidden: int, recompute_activation: bool = False):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        self.recompute_activation = recompute_activation  # model.recompute_expert_activation

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x, counts, self.w1, self.w3, self.w2, self.recompute_activation)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, recompute_activation: bool = False):
    """SwiGLU of each expert on its rows of ``x`` (sorted by expert, ``counts`` per expert), in one grouped
    matmul per projection. torch's grouped matmul leaves the rows past the last group unwritten (uninitialized
    on CPU), so they are zeroed here; its operands' strides must be multiples of 16 bytes (the model's width
    and the experts' width multiples of 8: ``LlamaSpec.check``).

    ``recompute_activation``: silu, the product and w2's grouped matmul run under activation checkpointing, so
    that backward keeps w1's and w3's outputs and recomputes silu and the product (no matmul) from them: 2 x
    the experts' width per row kept instead of 4 (silu's input and output, w3's output, the product)."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return _grouped_swiglu_eager(x, counts, w1, w3, w2, recompute_activation)
    return _grouped_swiglu(x, counts, w1, w3, w2, recompute_activation)


def _grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, recompute_activation: bool):
    offsets = counts.cumsum(0).to(torch.int32)
    w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
    # The same holds for the gradient of x in backward: the mask on the way in zeroes it there.
    valid = (torch.arange(x.shape[0], device=x.device) < offsets[-1])[:, None]
    x = torch.where(valid, x, x.new_zeros(()))
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    if recompute_activation and torch.is_grad_enabled():
        out = checkpoint(_activation_and_down, gate, up, w2, offsets, use_reentrant=False, preserve_rng_state=False)
    else:
        out = _activation_and_down(gate, up, w2, offsets)
    return torch.where(valid, out, out.new_zeros(()))


def _activation_and_down(gate: torch.Tensor, up: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor):
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


# compile=true: dynamo runs torch's grouped matmul on fake tensors through its meta kernel, which takes bf16 only
# (the fast kernel's check), so fp32 and fp16 experts (and fp32 inputs under bf16 autocast, which leaves the op
# alone) run eagerly, a graph break; bf16 compiles.
# torch.compiler.disable imports dynamo and sympy (about a second of every launch, the planner's included): the
# eager twin is made on its first call, which only a compiled run makes, dynamo already loaded.
def _grouped_swiglu_eager(*args):
    eager = getattr(_grouped_swiglu, "eager", None)
    if eager is None:
        eager = _grouped_swiglu.eager = torch.compiler.disable(_grouped_swiglu)
    return eager(*args)


class AuxLossGradient(torch.autograd.Function):
    """Adds the gradient of an auxiliary loss to the backward of the tensor it rides on, leaving the forward
    value as it is: the load-balancing loss trains the router without the model's output or the training
    loss changing shape (the run's reported loss is the cross-entropy alone; the aux loss is its own metric).

    ``weight`` is d(the loss backward starts from)/d(aux): the aux loss's share of the step (1/micro-batches,
    as each micro-batch's cross-entropy is divided) times the loss scale of fp16's scaler, which multiplies
    every other gradient of the step (``MoE.aux_loss_weight``, set by ``reset_routing_counts``). Without the
    scale the scaler's unscale would divide the aux part by it (2^16) and the router would not balance."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        # Compiled, a forward that returns its input unchanged loses this backward (the aux gradient was 0 under
        # compile=true: tests/integration/test_compose.py); a copy keeps it. Eager needs none.
        return out.clone() if torch.compiler.is_compiling() else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.weight, dtype=ctx.aux_dtype), None


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of a block (see the module docstring)."""

    def __init__(self, cfg, ffn_hidden: int, shared: Optional[nn.Module] = None):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_top_k
        self.aux_loss_coef, self.capacity_factor = cfg.aux_loss_coef, cfg.capacity_factor
        # d(the loss backward starts from)/d(this forward's aux loss): its share of the step times fp16's loss
        # scale (reset_routing_counts; AuxLossGradient)
        self.aux_loss_weight = 1.0
        if cfg.expert_groups > 1 or cfg.routed_scaling != 1.0:  # DeepSeek-V3's (fsdp_exp.models.router)
            self.router = GroupLimitedRouter.of(cfg)
        else:
            self.router = Router(cfg.dim, cfg.n_experts, cfg.experts_top_k, cfg.router_score, cfg.router_renormalize)
        self.experts = GroupedExperts(
            cfg.n_experts, cfg.dim, moe_hidden_dim(cfg, ffn_hidden), cfg.recompute_expert_activation
        )
        self.shared_experts = shared  # always-on experts, one SwiGLU of n_shared_experts x the experts' width
        # Since the last reset (the trainer's, once a step): routed copies per expert (before dropping: the
        # load the bias balances), copies dropped, and the aux loss's sum. Counted in forward only, never in activation checkpointing's recompute.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("aux_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.float32), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (tokens, dim) -> (order, weights, counts, kept, scores, routed): ``order`` lists the routed copies
        (token * k + slot) sorted by expert, the dropped ones (past an expert's capacity) after all the kept;
        ``weights`` their mixing weights in that order; ``counts`` the kept copies per expert; ``kept`` a mask
        over ``order``; ``scores`` the router's scores of every expert; ``routed`` the copies per expert
        before dropping (what the balancing reads)."""
        weights, experts, scores = self.router(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        kept, routed = torch.ones_like(order, dtype=torch.bool), counts
        if self.capacity_factor is not None:
            capacity = int(self.capacity_factor * x.shape[0] * self.top_k / self.n_experts)
            sorted_experts = flat[order]
            starts = counts.cumsum(0) - counts
            kept = torch.arange(order.numel(), device=x.device) - starts[sorted_experts] < capacity
            # Kept copies first, still sorted by expert: the grouped matmul sees only them.
            regroup = (sorted_experts + self.n_experts * (~kept).long()).argsort(stable=True)
            order, kept = order[regroup], kept[regroup]
            counts = counts.clamp(max=capacity)
        return order, weights.flatten()[order], counts, kept, scores, routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        order, weights, counts, kept, scores, routed = self.route(x)
        token = order // self.top_k
        out = self.experts(x[token], counts)
        out = out * torch.where(kept, weights, 0.0).to(out.dtype)[:, None]
        # scatter_add's backward needs only the indices (index_add_'s keeps its source, every routed copy's output)
        y = torch.zeros_like(x).scatter_add_(0, token[:, None].expand(-1, x.shape[-1]), out)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        aux = self.balance_loss(scores, routed)
        self._count(routed, kept, aux)
        if aux is not None and torch.is_grad_enabled():
            # weighted as the training loss is: each of a step's micro-batches carries 1/micro-batches of it
            y = AuxLossGradient.apply(y, aux, self.aux_loss_weight)
        return y.reshape(shape)

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> Optional[torch.Tensor]:
        """The auxiliary load-balancing loss of Switch / GShard as Mixtral and Qwen3-MoE train with it:
        coef x n_experts x sum over experts of (routed copies / tokens) x (mean router score); 1 x coef x k
        when balanced. None when ``model.aux_loss_coef`` is 0."""
        if not self.aux_loss_coef:
            return None
        tokens = scores.shape[0]
        share = counts.float() / tokens
        return self.aux_loss_coef * self.n_experts * (share * scores.mean(0)).sum()

    @torch.no_grad()
    def _count(self, routed: torch.Tensor, kept: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation checkpointing's recompute, inside backward: already counted
        self.tokens_per_expert += routed.float()
        self.dropped += (~kept).sum().float()
        self.forwards += 1
        if aux is not None:
            self.aux_loss += aux.detach().float()

    @torch.no_grad()
    def reset_counts(self) -> None:
        for counter in (self.tokens_per_expert, self.dropped, self.aux_loss, self.forwards):
            counter.zero_()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def number_moe_layers(model: nn.Module) -> None:
    """Give each MoE layer of a whole model its index among them (``layer``) and their count (``of_layers``):
    a pipeline stage, the model less the other stages' blocks, keeps them, so that the counts of every stage
    line up in one tensor summed over all ranks (``routing_counts``)."""
    layers = moe_layers(model)
    for index, m in enumerate(layers):
        m.layer, m.of_layers = index, len(layers)


def _loads(layers: list[MoE]) -> torch.Tensor:
    """(every MoE layer of the whole model, experts): this rank's layers' routed copies, zeros for the rest."""
    loads = layers[0].tokens_per_expert.new_zeros(layers[0].of_layers, layers[0].n_experts)
    for m in layers:
        loads[m.layer] = m.tokens_per_expert
    return loads


def reset_routing_counts(model: nn.Module, micro_batches: int = 1, loss_scale: float = 1.0) -> None:
    """Start a step's counts (the trainer, before each step): loads, drops and aux losses are per step. The
    step's ``micro_batches`` each carry 1/micro_batches of the aux loss's gradient, as the trainer divides the
    cross-entropy of each: the balance's weight against the loss does not grow with gradient accumulation.
    ``loss_scale``: fp16's loss scale this step (the scaler's), which the aux gradient is multiplied by as the
    scaled loss's are, so that the scaler's unscale leaves it as it is in fp32."""
    for m in moe_layers(model):
        m.reset_counts()
        m.aux_loss_weight = loss_scale / micro_batches


def routing_counts(model: nn.Module) -> Optional[torch.Tensor]:
    """This rank's counts since the reset, as one flat fp64 tensor that sums over ranks: every layer's routed
    copies per expert, then the dropped copies, the aux losses' sum and the forwards counted (both summed over
    layers). None for a model without experts. ``routing_row`` reads the summed tensor."""
    layers = moe_layers(model)
    if not layers:
        return None
    loads = _loads(layers).flatten()
    totals = [sum(getattr(m, name) for m in layers) for name in ("dropped", "aux_loss", "forwards")]
    return torch.cat([loads, torch.stack(totals)]).double()


def routing_row(model: nn.Module, summed: torch.Tensor, ranks: int) -> dict[str, float]:
    """The step's ``moe/*`` metrics from ``routing_counts`` summed over ``ranks`` ranks. The loads are the
    routed copies before dropping: the dropped ones are a part of them."""
    layers = moe_layers(model)
    n_layers = layers[0].of_layers  # the whole model's (a pipeline stage holds some of them)
    loads = summed[:-3].view(n_layers, -1)
    dropped, aux, forwards = summed[-3:].tolist()
    per_layer = loads.max(-1).values / loads.mean(-1).clamp(min=1e-9)
    routed = loads.sum().item()
    return {
        "moe/tokens_per_expert_max": loads.max().item(),
        "moe/tokens_per_expert_mean": loads.mean().item(),
        "moe/load_imbalance_max": per_layer.max().item(),
        "moe/load_imbalance_mean": per_layer.mean().item(),
        "moe/load_imbalance_worst_layer": int(per_layer.argmax().item()),
        "moe/load_imbalance_per_layer": [round(x, 4) for x in per_layer.tolist()],
        "moe/aux_loss": aux / forwards * n_layers if forwards else 0.0,
        "moe/dropped_tokens": dropped,
        "moe/dropped_fraction": dropped / routed if routed else 0.0,
    }


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """DeepSeek-V3's loss-free balancing, once a step after the optimizer's: each expert's bias moves by
    ``rate`` toward balance (up when the expert got fewer than the mean of the routed copies, down when it
    got more), from the load summed over the data-parallel ranks (``all_reduce`` sums a tensor in place over
    them: every rank then holds the same biases). The counts are left for the step's metrics to read."""
    layers = moe_layers(model)
    if not layers or not rate:
        return
    loads = _loads(layers)  # every layer of the whole model: under pipeline parallel the other stages' add theirs
    all_reduce(loads)
    for m in layers:
        load = loads[m.layer]
        m.router.expert_bias += rate * torch.sign(load.mean() - load)


def dense_reference(moe: MoE, x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same layer computed densely: every expert on every token, the outputs mixed by each token's routing
    weights (zero outside its top k, and where ``keep`` (tokens, k) is False: a dropped copy). The yardstick
    of the grouped path in the tests; it never runs in training (a 128-expert model would do 16x the work of
    its top 8)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts, _ = moe.router(x)
    if keep is not None:
        weights = torch.where(keep, weights, 0.0)
    mix = torch.zeros(x.shape[0], moe.n_experts, dtype=torch.float32, device=x.device).scatter(-1, experts, weights)
    e = moe.experts
    outputs = torch.stack(
        [F.linear(F.silu(F.linear(x, e.w1[i])) * F.linear(x, e.w3[i]), e.w2[i]) for i in range(moe.n_experts)], -1
    )
    y = (outputs * mix[:, None, :].to(outputs.dtype)).sum(-1)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y.reshape(shape)


def grouped_mm_in_any_dtype():
    """A dispatch mode giving meta and fake tensors torch's grouped matmul (``aten._grouped_mm``: our
    experts', and transformers' default experts path for MoE models) in every dtype.

    The op runs in fp32, bf16 and fp16: CUDA's fast kernel takes bf16, its composite fallback (the CPU's,
    and CUDA's for other dtypes) any dtype. Its meta kernel, which fake tensors use, checks the fast
    kernel's bf16 only, so an fp32 or fp16 measurement (the planner's, the FLOP count's) stopped there. Outside bf16 this mode returns the
    op's result as the fallback makes it: its documented shape (``torch.nn.functional.grouped_mm``), the
    operands' dtype, contiguous. Autograd saves the same operands whichever kernel runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                return _grouped_mm_result(*args, **kwargs)
            return func(*args, **kwargs)

    return Mode()


def _grouped_mm_result(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """An empty tensor shaped as ``grouped_mm(mat_a, mat_b, offs=offs)``: 2-D operands are cut into
    ``offs.size(0)`` groups along their shared (2-D x 2-D) or leading (2-D x 3-D) dimension."""
    import torch

    if mat_a.dim() == 2 and mat_b.dim() == 2:  # a weight gradient: one (M, N) product per group
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:  # tokens grouped by expert times one weight per expert
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        shape = (mat_a.size(1), mat_b.size(1))
    else:  # a batched matmul
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)
