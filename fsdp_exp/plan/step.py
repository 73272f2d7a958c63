"""The training step, phase by phase: each phase's live bytes on one rank, added up from the model
states, the gathered parameters, communication buffers and the activations.

The phases: each block's forward at its peak, the output projection, the loss's forward and
backward, each block's backward at its peak and its gradient reduction, the root's reduction, the
optimizer step. Each belongs to one of the stages the run's memory tracker reports (its phases:
``fsdp_exp.metrics.schema.PHASES``).
Activation sizes are the planner's model of the family (``ActivationProfile``); how parameters are sharded,
gathered and reduced is the backend's (``PlannerRules``). Under rules that gather no units (DDP)
parameters are used in place: full replicas, gradient buckets, autocast's weight copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsdp_exp.config.schema import LAST_MICRO_BATCH
from fsdp_exp.plan.activations import ActivationProfile
from fsdp_exp.parallel.backend import PlannerRules
from fsdp_exp.plan.states import DTYPE_BYTES, Gathered, ModelStates

PIECES = ("params", "grads", "optimizer", "unsharded", "comm", "module_buffers", "activations", "temporaries", "inputs")


@dataclass
class Phase:
    name: str
    stage: str  # forward | backward | optimizer
    params: int = 0  # sharded parameters (fp32) on the device
    grads: int = 0  # gradients on the device (sharded, or unsharded while they are reduced)
    optimizer: int = 0
    unsharded: int = 0  # all-gathered parameters in param_dtype (DDP: autocast's weight copies)
    comm: int = 0  # all-gather prefetch, reduce-scatter buffers, DDP's gradient buckets
    module_buffers: int = 0
    activations: int = 0  # saved for backward (and a recomputed block)
    temporaries: int = 0  # gradients of activations, the loss's, optimizer temporaries
    inputs: int = 0

    def __post_init__(self) -> None:
        # A phase is never changed once made, and a search asks each one's total several times.
        self._total = sum(getattr(self, piece) for piece in PIECES)

    @property
    def total(self) -> int:
        return self._total

    def by_piece(self) -> dict:
        return {"phase": self.name, **{k: getattr(self, k) for k in PIECES}, "total": self.total}


@dataclass(frozen=True)
class StepSetting:
    """What the walk reads of the run besides the model and the backend."""

    kind: str  # the device the prediction is for: cuda | cpu
    param_dtype: str
    reduce_dtype: str
    grad_accum_steps: int
    tp: int
    shard: int  # ranks a parameter is sharded over
    ac_mode: str
    ac_every: int
    ac_ops: str
    prefetch_forward: int
    prefetch_backward: Optional[int]
    reshard_last_block: Optional[bool]
    wrap_policy: str
    grad_sync: str = LAST_MICRO_BATCH  # trainer.grad_sync as the backend resolved it
    loss_chunks: int = 1  # trainer.loss_chunks: the output projection and loss per slice of the sequence
    loss_parallel: bool = False  # parallel.loss_parallel: the logits stay sharded over the TP group's vocabulary
    sequence_parallel: bool = False  # parallel.sequence_parallel: the chunked loss slices the batch instead
    # precision.float8_recipe: (in_features, out_features) of each linear converted to float8, per block (() = off),
    # and whether FSDP2 all-gathers their weights in float8 (``fsdp_exp.parallel.float8``)
    float8_matmuls: tuple = ()
    float8_all_gather: bool = False
    ep: int = 1  # parallel.ep: each block's routed experts are a nested unit gathered over the efsdp ranks


class StepWalk:
    """One training step of one rank; ``phases()`` lists its phases in order."""

    def __init__(
        self,
        s: StepSetting,
        rules: PlannerRules,
        x: ActivationProfile,
        g: Gathered,
        states: ModelStates,
        buffer_bytes: int,
    ):
        self.s, self.rules, self.x, self.g, self.states = s, rules, x, g, states
        self.L = len(g.own)
        self.e_p, self.e_r = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.reduce_dtype]
        e = self.e = self.e_p  # the compute dtype: param_dtype (FSDP casts its parameters, DDP autocasts)
        self.gathers = rules.gathers_units
        self.autocast = rules.autocast
        self.grads_here = int(states.resident["grads"] > 0)
        self.reshard = rules.reshard_after_forward is not False
        self.keep_last = self.reshard and not s.reshard_last_block and s.wrap_policy != "none"
        self.back_depth = s.prefetch_backward if s.prefetch_backward is not None else 1
        self.fwd_depth = max(0, s.prefetch_forward)
        # Elements of each block's units that are reduce-scattered: under expert parallel with ep = shard the
        # experts' unit has one rank and reduces nothing (its gradient is this rank's whole).
        self.reduced = g.block_reduced_numel if s.ep > 1 else g.block_numel
        # What a block keeps gathered past its forward when units do not reshard (grad_op): under expert
        # parallel with ep = shard the experts' unit of one rank reshards anyway (fsdp_exp.parallel.fsdp2: its
        # unsharded parameters are a cast of its own, made again for backward), so it is held only while its
        # block runs (``alone``).
        self.held = g.block_reduced_numel if s.ep > 1 else g.block_numel
        self.alone = [whole - held for whole, held in zip(g.block_numel, self.held)]
        # A shard group of one rank (one rank, or no_shard's (world, 1) mesh) all-gathers nothing: FSDP2
        # makes the unsharded parameters from the sharded ones directly, with no all-gather output.
        self.all_gathers = self.gathers and s.shard > 1
        # gloo's reduce-scatter over more than one rank holds a second copy of its input (measured with
        # torch's tracker on CPU); NCCL reduces in place.
        self.gloo_copy = s.kind == "cpu" and self.all_gathers

        # ---- activations
        every = {"none": 0, "full": 1, "selective": s.ac_every}[s.ac_mode]
        self.checkpointed = [every > 0 and j % every == 0 for j in range(self.L)]
        self.op_level = s.ac_ops != "none"
        self.math_attention = x.math_attention(s.kind, e)
        self.full_block = x.block_saved(e, self.autocast, self.math_attention)["total"]
        # The block's input: the residual stream, which stays fp32 under autocast.
        self.block_input = x.residual(4 if self.autocast else e)
        kept = self.block_input + x.op_level_saved(e, s.ac_ops) if self.op_level else self.block_input
        self.act_block = [kept if c else self.full_block for c in self.checkpointed]
        self.all_acts = sum(self.act_block)
        self.head = x.head_saved(e, self.autocast)
        # The logits this rank makes at once: all of them, or one slice of the sequence's (trainer.loss_chunks,
        # ``fsdp_exp.models.loss``); a vocabulary shard of them under loss parallel, else gathered whole.
        over_batch = s.tp > 1 and s.sequence_parallel  # the hidden states are sharded over the sequence then
        self.chunks = max(1, min(s.loss_chunks, x.b if over_batch else x.s))
        per_chunk = -(-x.b // self.chunks) * x.s if over_batch else x.b * -(-x.s // self.chunks)  # tokens
        self.vocab_share = s.tp if s.tp > 1 and s.loss_parallel else 1
        self.logit_elements = -(-x.logits * per_chunk // x.tokens // self.vocab_share)
        # In param_dtype, or all at once the root's output_dtype (the chunked loss is the root's output).
        out = rules.root_output_dtype if self.chunks == 1 else None
        self.logits = (DTYPE_BYTES[out] if out else e) * self.logit_elements
        self.log_softmax = 4 * self.logit_elements
        self.module_buffers = buffer_bytes
        # token ids and targets (int64); block_causal's documents and mask (a family without: none)
        self.inputs = 2 * 8 * x.tokens + (x.batch_inputs(s.kind, e) if hasattr(x, "batch_inputs") else 0)
        # Weight gradients: in param_dtype where the unsharded parameters are (FSDP); DDP's land in
        # the fp32 parameters' .grad.
        self.e_grad_w = e if self.gathers else 4
        self.resid_grad = x.residual(e)

        # ---- parameters used in place (DDP): gradient buckets, autocast's weight copies
        self.bucket = 4 * g.full_numel if rules.gradient_buckets else 0
        self.casts = [self.e_p * n if self.autocast else 0 for n in g.block_matrix_numel]
        self.output_cast = self.e_p * g.output_full_numel if self.autocast else 0
        # DDP accumulates micro-batches' gradients into the full-size .grad.
        self.replica_grads = 4 * g.full_numel if s.grad_accum_steps > 1 and not self.gathers else 0
        # FSDP accumulating micro-batches (trainer.grad_sync): last_micro_batch keeps every unit's unsharded
        # gradient until the last backward reduces it; every_micro_batch reduces each backward into the
        # sharded gradients, which then exist whole from the first micro-batch on (the walk's micro-batch is
        # a later one, the largest).
        accumulates = s.grad_accum_steps > 1 and self.gathers
        self.keeps_unsharded = accumulates and s.grad_sync == LAST_MICRO_BATCH
        self.sharded_before = int(states.resident["grads"]) if accumulates and not self.keeps_unsharded else 0

        # ---- float8 (torchao): a converted matmul casts its operands to float8 (1 byte an element) while it
        # runs: in forward its input and weight; in backward its output's gradient twice (once for the input's
        # gradient, once for the weight's), its weight and its input. Under float8 all-gather the gathered weight
        # is float8 already (no weight cast), and gathering it takes 1 byte an element instead of param_dtype's.
        f8 = s.float8_matmuls or ((),) * self.L
        t, w = x.tokens, 0 if s.float8_all_gather else 1
        self.f8_forward = [max((t * i + w * i * o for i, o in mm), default=0) for mm in f8]
        self.f8_backward = [max((2 * t * o + t * i + w * i * o for i, o in mm), default=0) for mm in f8]
        self.f8_saved = [
            (self.e_p - 1) * sum(i * o for i, o in mm) if s.float8_all_gather and self.gathers else 0 for mm in f8
        ]  # bytes fewer in block j's gathered unit

    # ------------------------------------------------------------------------------ helpers
    def phase(self, name: str, **pieces) -> Phase:
        stage = (
            "optimizer"
            if name.startswith("optimizer")
            else "forward"
            if name.startswith(("forward", "loss forward"))
            else "backward"
        )
        st = self.states.resident
        return Phase(
            name,
            stage,
            params=st["params"],
            optimizer=st["optimizer"],
            module_buffers=self.module_buffers,
            inputs=self.inputs,
            **pieces,
        )

    def accumulated(self, upto: Optional[int]) -> int:
        """Gradient accumulation: what earlier micro-batches left. Under last_micro_batch FSDP2 keeps each
        unit's unsharded gradient (in reduce_dtype) from the first micro-batch until the last one's
        backward reduces it (the root's and blocks up to ``upto``; all with None); under
        every_micro_batch the sharded gradients, which each backward adds to."""
        if not self.keeps_unsharded:
            return self.sharded_before
        blocks = self.g.block_numel if upto is None else self.g.block_numel[: upto + 1]
        return self.e_r * (self.g.root_numel + sum(blocks))

    def gathered_in_backward(self, i: int) -> int:
        """Unsharded parameter bytes while block i runs its backward."""
        g = self.g
        if not self.reshard:
            return self.e_p * (g.root_numel + sum(self.held[: i + 1]) + self.alone[i]) - sum(self.f8_saved[: i + 1])
        return self.e_p * (g.root_numel + g.own[i] + g.largest_nested[i]) - self.f8_saved[i]

    def prefetched(self, i: int) -> int:
        """All-gather buffers of units gathered ahead of block i's backward (none where a shard group of one
        rank gathers nothing)."""
        if not self.reshard or not self.all_gathers:
            return 0
        g = self.g
        ahead = sum(g.own[max(0, i - self.back_depth) : i])
        return self.e_p * (ahead + (g.largest_nested[i] if len(g.nested[i]) > 1 else 0)) - sum(
            self.f8_saved[max(0, i - self.back_depth) : i]
        )

    def last_gathered(self, i: int) -> int:
        """The all-gather output still held while block i runs forward: the latest unit's up to block i
        (the root's when no block is a unit, e.g. wrap=none). Under expert parallel the last unit a block
        gathers is its experts' (after the block's own), whose output is none where ep = shard."""
        if self.s.ep > 1 and any(self.g.nested[: i + 1]):
            return self.g.nested_all_gather[max(j for j in range(i + 1) if self.g.nested[j])]
        return next((self.g.own[j] for j in range(i, -1, -1) if self.g.own[j]), self.g.root_numel)

    # ------------------------------------------------------------------------------- phases
    def phases(self) -> list[Phase]:
        return [*self.forward(), *self.loss(), *self.backward(), *self.root_reduction(), self.optimizer_step()]

    def forward(self) -> list[Phase]:
        """1) Each block's forward at its SwiGLU product, its largest moment: the activations of the
        blocks before it and its own saved so far (a checkpointed block saves only its input, but then
        holds more while it runs); the root and the block gathered (every block so far under grad_op /
        no_shard), its all-gather output (FSDP2 frees it at the next unit's wait) and those prefetched
        ahead (prefetch.forward). 2) The output projection: the root and the last block gathered
        (every unit under grad_op / no_shard), the last block's all-gather buffer not yet released,
        the logits made."""
        x, g, e = self.x, self.g, self.e
        grads = self.accumulated(None) + self.replica_grads
        h_alive = 0 if self.autocast or e == 4 else x.residual(e)  # fp32 and autocast: saved already
        # The step starts with the last step's gradients (the tracker's forward stage starts before zero_grad).
        out = [self.phase("forward (last step's gradients)", grads=self.states.resident["grads"])]
        first = next((j for j in range(self.L) if g.own[j]), None)
        if self.all_gathers and first is not None:
            # 0) The first block's all-gather lands while the root's all-gather output is still held (freed at
            # that unit's wait) beside the root's gathered parameters: what a large vocabulary's step peaks at.
            out.append(
                self.phase(
                    "forward (root gathered)",
                    grads=grads,
                    unsharded=self.e_p * g.root_numel,
                    comm=self.e_p * (g.root_numel + g.own[first]) - self.f8_saved[first],
                    activations=x.residual(e),
                )
            )
        for i in range(self.L):
            if not self.checkpointed[i]:
                in_block = self.full_block + h_alive + x.dispatch_forward_peak(e)
            elif self.op_level:
                in_block = self.act_block[i] + x.op_level_forward_peak(e, self.s.ac_ops) + h_alive
            else:
                # (expert parallel's dispatch holds as much past a checkpointed block's peak: measured under
                # sharding=hybrid ac=full on 4 gloo ranks)
                in_block = self.block_input + x.checkpointed_forward_peak(e) + x.dispatch_forward_peak(e)
            if not self.gathers:
                unsh, comm = sum(self.casts[: i + 1]), self.bucket
            else:
                unsh = self.e_p * (
                    g.root_numel
                    + (sum(self.held[: i + 1]) + self.alone[i] if not self.reshard else g.own[i] + g.largest_nested[i])
                ) - (sum(self.f8_saved[: i + 1]) if not self.reshard else self.f8_saved[i])
                comm = (
                    self.e_p * (self.last_gathered(i) + sum(g.own[i + 1 : i + 1 + self.fwd_depth]))
                    - (self.f8_saved[i] if g.own[i] else 0)
                    - sum(self.f8_saved[i + 1 : i + 1 + self.fwd_depth])
                    if self.all_gathers
                    else 0
                )
            out.append(
                self.phase(
                    f"forward block {i}",
                    grads=grads,
                    unsharded=unsh,
                    comm=comm,
                    activations=sum(self.act_block[:i]) + in_block,
                    temporaries=self.f8_forward[i],
                )
            )
        if not self.gathers:
            unsh, comm = sum(self.casts) + self.output_cast, self.bucket
        else:
            unsh = self.e_p * (
                g.root_numel + (sum(self.held) if not self.reshard else (g.own[self.L - 1] if self.keep_last else 0))
            ) - (sum(self.f8_saved) if not self.reshard else (self.f8_saved[-1] if self.keep_last else 0))
            comm = (
                self.e_p * self.last_gathered(self.L - 1) - (self.f8_saved[-1] if g.own[-1] else 0)
                if self.all_gathers
                else 0
            )
        # Tensor parallel without loss parallel: the column-parallel output is gathered to a replicated one
        # (parallel/tp.py), so the local shard of the logits and the all-gather's output are alive next to it.
        tp_gather = self.logits // self.s.tp + self.logits if self.s.tp > 1 and self.vocab_share == 1 else 0
        out.append(
            self.phase(
                "forward (output projection)",
                grads=grads,
                unsharded=unsh,
                comm=comm,
                activations=self.all_acts + self.head + self.logits,
                temporaries=tp_gather,
            )
        )
        return out

    def loss(self) -> list[Phase]:
        """3) The loss's forward (the end of the forward stage), while log_softmax's output (fp32) is
        made; logits that are not fp32 have their fp32 copy (``.float()``) alive then. Then its
        backward: log_softmax's output and the loss gradients (fp32); the logits themselves are gone.

        All the logits at once (``trainer.loss_chunks=1``): the loss is taken after the model's forward,
        and a resharded root is gathered again only after its backward. One slice's
        (``fsdp_exp.models.loss``): the loss is the root's output, so the root stays gathered through the
        slices and is gathered again before their backward, where each slice's logits are made again
        beside the output projection's weight gradient (made by the first) and the hidden states'
        gradient, accumulated over the slices (with the next slice's, zero-padded, being added). The
        output projection's weight gradient is summed over the slices by autograd before it reaches the
        parameter: the sum so far, the next slice's and their sum are alive at once (measured with torch's
        tracker), which is the moment of the loss's backward when the head's weight outweighs a slice's
        logits."""
        g, e = self.g, self.e
        chunked = self.chunks > 1
        if not self.gathers:
            unsh, comm = sum(self.casts) + self.output_cast, self.bucket
        elif not self.reshard:
            unsh, comm = self.e_p * (g.root_numel + sum(self.held)), 0
        else:
            unsh, comm = self.e_p * ((g.own[self.L - 1] if self.keep_last else 0) + (g.root_numel if chunked else 0)), 0
        grads = self.accumulated(None) + self.replica_grads
        acts = self.all_acts + self.head
        float_copy = 4 * self.logit_elements if self.logits != 4 * self.logit_elements else 0
        # Loss parallel (torch's log_softmax on the vocabulary shards) holds one more fp32 tensor of the
        # logits' size in the forward and the backward; in a slice's backward half that (both measured with
        # torch's tracker on CPU).
        sharded = self.log_softmax if self.vocab_share > 1 else 0
        # Inside the root's forward the last block's all-gather output is still held (as at the projection).
        forward_comm = self.e_p * self.last_gathered(self.L - 1) if chunked and self.all_gathers else comm
        forward = self.phase(
            "loss forward",
            grads=grads,
            unsharded=unsh,
            comm=forward_comm,
            activations=acts + self.logits + self.log_softmax,
            temporaries=float_copy + sharded,
        )
        if not chunked:
            return [
                forward,
                self.phase(
                    "loss backward",
                    grads=grads,
                    unsharded=unsh,
                    comm=comm,
                    activations=acts + self.log_softmax,
                    temporaries=2 * 4 * self.logit_elements + sharded,
                ),
            ]
        # A slice's recomputed log_softmax output, its gradient and the logits' (fp32), the recomputed logits
        # and their gradient's cast to param_dtype; or the head's weight gradient three times.
        made_again = 3 * self.log_softmax + self.logits + (self.logits if float_copy else 0)
        # (Under autocast the slices share one cast of the weight: the sums are in param_dtype, before the cast.)
        weight_sums = (
            3
            * (e if self.autocast else self.e_grad_w)
            * (g.root_early_numel if self.gathers else g.root_early_full_numel)
        )
        return [
            forward,
            self.phase(
                "loss backward",
                grads=grads,
                unsharded=unsh,
                comm=comm,
                activations=acts,
                temporaries=max(made_again, weight_sums) + 2 * self.resid_grad + sharded // 2,
            ),
        ]

    def backward(self) -> list[Phase]:
        """4) Each block's backward, last to first, at its peak (the SwiGLU's): the gradient arriving
        from above, the weight gradient just made, the activation gradients inside the block; 5) its
        gradient reduction."""
        x, g, e = self.x, self.g, self.e
        out = []
        for i in reversed(range(self.L)):
            recompute = self.full_block if self.checkpointed[i] else 0
            acts = sum(self.act_block[:i]) + (0 if self.checkpointed[i] else self.full_block)
            inner = self.resid_grad + x.backward_peak(e) + recompute  # beside the new weight gradients
            if not self.gathers:
                grads = self.replica_grads or (
                    4 * g.root_early_full_numel + 4 * sum(g.block_full_numel[i + 1 :]) + 4 * x.block_weight_grads
                )
                out.append(
                    self.phase(
                        f"block {i} backward",
                        grads=grads,
                        unsharded=sum(self.casts[: i + 1]),
                        comm=self.bucket,
                        activations=acts,
                        temporaries=inner + self.f8_backward[i],
                    )
                )
                continue
            # sharded gradients of the blocks already reduced (offloaded to the host on CUDA); all of them
            # exist already when earlier micro-batches reduced theirs (``accumulated``)
            done = 0 if self.sharded_before else sum(g.block_local_bytes[i + 1 :]) * self.grads_here
            previous_rs = self.e_r * self.reduced[i + 1] if i + 1 < self.L else 0  # freed at the next one
            new_grads = self.e_p * g.root_early_numel + self.e_grad_w * x.peak_weight_grad
            if self.keeps_unsharded and self.e_r == self.e_p:
                new_grads = 0  # later micro-batches accumulate into the kept gradients in place
            # Under expert parallel the experts' unit is gathered on demand in the middle of the block's backward:
            # at the experts' peak its all-gather output is the one alive (none where ep = shard), the blocks'
            # prefetch not yet (measured with torch's tracker at ep=2 and 4 on 4 gloo ranks).
            gathering = self.e_p * g.nested_all_gather[i] if self.s.ep > 1 and self.all_gathers else self.prefetched(i)
            out.append(
                self.phase(
                    f"block {i} backward",
                    grads=done + self.accumulated(i),
                    unsharded=self.gathered_in_backward(i),
                    comm=gathering + previous_rs,
                    activations=acts,
                    temporaries=new_grads + inner + self.f8_backward[i],
                )
            )
            # Post-backward: the block is resharded, its gradients copied into the reduce-scatter input
            # (reduce_dtype), the unsharded ones freed.
            unsh = self.e_p * (g.root_numel + (sum(self.held[:i]) if not self.reshard else 0))
            rest = dict(
                unsharded=unsh,
                activations=sum(self.act_block[:i]),
                temporaries=self.e_p * g.root_early_numel + self.resid_grad,
            )
            out.append(
                self.phase(
                    f"block {i} reduce-scatter",
                    grads=done + self.accumulated(i - 1) + self.e_p * g.block_numel[i],
                    comm=self.prefetched(i) + self.e_r * self.reduced[i],
                    **rest,
                )
            )
            if self.gloo_copy:  # the last weight's unsharded gradient is still referenced; the output shard exists
                out.append(
                    self.phase(
                        f"block {i} reduce-scatter (gloo copy)",
                        grads=done
                        + self.accumulated(i - 1)
                        + g.block_local_bytes[i] * self.grads_here
                        + self.e_p * x.peak_weight_grad,
                        comm=self.prefetched(i) + 2 * self.e_r * self.reduced[i],
                        **rest,
                    )
                )
        return out

    def root_reduction(self) -> list[Phase]:
        """6) The root's gradient reduction, after the input embedding's backward: FSDP2 reshards the root
        before it reduces (its post-backward), so only its unsharded gradients and the buffers are left."""
        if not self.gathers:
            return []
        g = self.g
        return [
            self.phase(
                "root reduce-scatter",
                grads=self.sharded_before or sum(g.block_local_bytes) * self.grads_here,
                comm=self.e_r * g.root_numel * (2 if self.gloo_copy else 1),
                temporaries=self.e_p * g.root_numel,
            )
        ]

    def optimizer_step(self) -> Phase:
        """7) The optimizer step: CUDA's foreach AdamW makes a temporary the size of all shards. The
        per-tensor loop (CPU) makes two per tensor (the second moment's sqrt, then its quotient by the
        bias correction, ``denom``) while the previous tensor's ``denom`` is still alive: the largest
        previous + 2 x this tensor, within each parameter group (matrices, then norms: fsdp_exp.optim)."""
        st = self.states.resident
        if self.s.kind == "cuda":
            temporaries = int(st["params"])
        else:
            temporaries = max(_loop_temporaries(sizes) for sizes in self.states.optimizer_groups)
        return self.phase("optimizer step", grads=st["grads"], comm=self.bucket, temporaries=temporaries)


def _loop_temporaries(sizes: list[int]) -> int:
    return max((prev + 2 * cur for prev, cur in zip([0, *sizes[:-1]], sizes)), default=0)
