"""The knob vocabulary: each config value and what every backend hands torch for it.

The vocabulary page of docs/ is this module's output
(``python -m fsdp_exp.composability > docs/vocabulary.md``, which adds the composability table) and a
test keeps them equal. The rows are the config knobs listed below; each registered backend
(``fsdp_exp.parallel.backend.BACKEND_MODULES``) fills its own column from ``Backend.vocabulary()``, which
builds the sharding rows from the very mappings its ``apply`` uses (fsdp2.RESHARD_AFTER_FORWARD,
fsdp1.STRATEGY_NAMES). A row a backend leaves out reads "refused at validation", and its ``check``
refuses that knob: the backend interface test tries each such row against each backend.
"""

from __future__ import annotations

from fsdp_exp.parallel.backend import Backend, backend_names, get_backend

REFUSED = "refused at validation"

# The table's rows: config knob -> its ZeRO analogue (the reader's reference point, not a backend).
ROWS: dict[str, str] = {
    "sharding=full": "stage 3",
    "sharding=grad_op": "stage 2",
    "sharding=hybrid": "stage 3 within a shard group (MiCS / hpZ)",
    "sharding=no_shard": "stage 0",
    "sharding=optimizer": "stage 1",
    "sharding.reshard_after_forward=N": "hpZ secondary partition",
    "sharding.reshard_last_block": "n/a",
    "precision.param_dtype": "bf16 / fp16 section",
    "precision.storage_dtype=bf16": "n/a (fp32 master weights always)",
    "precision.reduce_dtype": "`communication_data_type`",
    "precision.output_dtype": "n/a",
    "precision.buffer_dtype": "n/a",
    "precision.cast_forward_inputs": "n/a",
    "precision.loss_scaler=dynamic": "`fp16.loss_scale=0`",
    "offload=params": "`offload_param` + `offload_optimizer`",
    "offload=optimizer": "`offload_optimizer`",
    "prefetch.forward=k": "`stage3_prefetch_bucket_size`",
    "prefetch.backward=k": "`stage3_prefetch_bucket_size`",
    "prefetch.backward_timing": "n/a",
    "prefetch.limit_all_gathers": "`stage3_max_live_parameters`",
    "wrap=block": "n/a",
    "wrap=size": "n/a",
    "wrap=experts": "MoE expert groups",
    "wrap=none": "n/a",
    "sharding.use_orig_params": "n/a",
    "sharding.sync_module_states": "n/a",
    "ac=full / selective / selective_op": "`activation_checkpointing`",
    "trainer.grad_sync=every_micro_batch": "stages 2 and 3 (reduce into the partitions each micro-batch)",
    "trainer.grad_sync=last_micro_batch": "stages 0 and 1 (reduce at the accumulation boundary)",
    "compile=true": "n/a",
    "parallel.tp=N": "Megatron TP",
    "parallel.pp=N": "DeepSpeed's `PipelineModule` (ZeRO-0/1 only: its engine refuses ZeRO-2/3 under pipelining)",
    "parallel.cp=N": "DeepSpeed-Ulysses sequence parallel (all-to-all of heads for sequence)",
}
SHARDING_ROWS = [key for key in ROWS if key.startswith("sharding=")]

# Named policies the table's rows refer to, in words (the code that applies them is named in each).
POLICIES = """\
## Named policies

**Op-level selective checkpointing** (`ac=selective_op`, `fsdp_exp/parallel/ac.py`, by the rule `OpSaver` in `fsdp_exp/ops.py`). Every block is
checkpointed, and torch's selective checkpoint API decides op by op what the block keeps for its backward;
everything else is recomputed there.

- `ac.ops=every_other_matmul` (the preset's policy) is torchtitan's per-op SAC. Counting a block's matmuls in
  the order its forward runs them, the odd ones (1st, 3rd, 5th, ...) keep their output and the even ones are
  recomputed; the count starts again in every block and again in its recompute, so both pick the same ones. In
  a Llama block the seven matmuls are wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2 are kept, wk, wo and w3
  recomputed. Whatever the count, the outputs of SDPA's kernels (flash, memory-efficient, cuDNN, the CPU's
  flash: output and log-sum-exp) and of collectives inside the block (reduce-scatter, all-reduce,
  all-to-all: tensor parallel's) are always kept. torchtitan counts `aten.mm` only, since its linear layers
  have no bias; here a linear layer with a bias (`aten.addmm`) counts as a matmul too. Batched matmuls are
  neither counted nor kept.
- `ac.ops=every_matmul` keeps every matmul's output (mm, addmm, bmm) and the same kernels' and collectives':
  no matmul is recomputed (HFU equals MFU), at about 1.7 times the first policy's saved bytes (Llama-3 8B's block).

**Gradient accumulation** (`trainer.grad_sync`, `fsdp_exp/parallel/__init__.py`: `Parallelized.gradient_sync`).
`every_micro_batch` reduces each micro-batch's gradients as its backward finishes each unit, adding them to
the sharded gradient: between micro-batches a rank holds the gradient shard only, and each unit's unsharded
gradient lives only until its reduce-scatter. `last_micro_batch` accumulates the unsharded gradients locally
and reduces once, after the last micro-batch: one collective per unit per step instead of one per micro-batch,
at the cost of every unit's whole unsharded gradient from the first backward to the last. `auto` (the default)
is the backend's rule, recorded resolved in `run.json["applied"]["grad_sync"]`.
"""


def backends() -> list[Backend]:
    return [get_backend(name) for name in backend_names()]


def row(key: str) -> tuple[str, ...]:
    """One row of the table: the knob, each backend's cell (in registry order), the ZeRO analogue."""
    return (f"`{key}`", *(backend.vocabulary().get(key, REFUSED) for backend in backends()), ROWS[key])


def sharding_rows() -> list[tuple[str, ...]]:
    return [row(key) for key in SHARDING_ROWS]


def render_markdown() -> str:
    titles = ["config", *(backend.column_title for backend in backends()), "ZeRO analogue"]
    header = "| " + " | ".join(titles) + " |\n" + "|" + "---|" * len(titles)
    rows = "\n".join("| " + " | ".join(row(key)) + " |" for key in ROWS)
    return (
        "# Knob vocabulary\n\nGenerated by `python -m fsdp_exp.composability`; do not edit by hand. "
        f"Select the backend with `sharding.backend={'|'.join(backend_names())}` (`sharding=ddp` for DDP). "
        f'"{REFUSED}" means the combination fails before any rank starts, with a message naming '
        'the equivalent; every run records what reached torch in `run.json["applied"]` and reads it '
        'back from the wrapped model in `applied["inspected"]`.\n\n' + header + "\n" + rows + "\n\n" + POLICIES
    )


if __name__ == "__main__":
    print(render_markdown(), end="")
