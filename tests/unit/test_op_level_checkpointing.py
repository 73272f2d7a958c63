"""Op-level selective activation checkpointing (fsdp_exp/parallel/ac.py) keeps what the planner says: one
checkpointed block's forward on the CPU, measured by torch's MemTracker, against the model family's
activation profile (fsdp_exp/plan/activations/llama.py), for both ``ac.ops`` policies. No process group."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_exp.plan.activations import profile_for
from fsdp_exp.models.llama import TransformerBlock, rope_tables
from fsdp_exp.ops import OpSaver
from fsdp_exp.parallel.ac import _op_level_context

from conftest import TINY_BATCH, TINY_MODEL, run_config

BATCH, SEQ = 2, 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tracked_saved(cfg, ops: str, dtype: torch.dtype) -> int:
    """Activation bytes the tracker sees alive after the block's forward, less its input, its output and the
    rotary tables it was handed: what the checkpointed block saved for backward."""
    torch.manual_seed(0)
    block = checkpoint_wrapper(
        TransformerBlock(cfg.model).to(dtype), preserve_rng_state=False, context_fn=partial(_op_level_context, ops)
    )
    cos, sin = rope_tables(cfg.model.dim // cfg.model.n_heads, SEQ, cfg.model.rope_theta)
    x = torch.randn(BATCH, SEQ, cfg.model.dim, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        out = block(x, cos, sin)
        activations = tracker.get_tracker_snapshot()[torch.device("cpu")]
    tracked = next(v for k, v in activations.items() if getattr(k, "value", k) == "Activation")
    out.float().sum().backward()  # the saved tensors serve a real backward
    given = x.untyped_storage().nbytes() + out.untyped_storage().nbytes() + cos.nbytes + sin.nbytes
    return tracked - given


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("ops", ["every_other_matmul", "every_matmul"])
def test_op_level_checkpointing_saves_what_the_planner_counts(ops, precision, model):
    extra = ["model.n_experts=4", "model.experts_top_k=2"] if model == "moe" else []
    cfg = run_config([*TINY_MODEL, *TINY_BATCH, *extra, f"precision={precision}", "ac=selective_op", f"ac.ops={ops}"])
    e = DTYPES[precision].itemsize
    planned = profile_for(cfg.model, BATCH, SEQ, 1, False).op_level_saved(e, ops)
    tracked = _tracked_saved(cfg, ops, DTYPES[precision])
    assert abs(planned / tracked - 1) < 0.03, (planned, tracked)


def test_torchtitans_rule_saves_every_other_matmul_and_every_attention_kernel():
    """The 1st, 3rd, ... matmul of a block (mm or addmm) in forward order, every attention kernel and
    collective; a fresh saver starts the count again (one per block forward and one per recompute)."""
    aten = torch.ops.aten
    saver = OpSaver("every_other_matmul")
    sequence = [
        aten.mm.default,
        aten.addmm.default,
        aten.mul.Tensor,
        aten.mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.mm.default,
        aten.bmm.default,
    ]
    assert [saver.saves(op) for op in sequence] == [True, False, False, True, True, False, False]
    assert OpSaver("every_other_matmul").saves(aten.mm.default)
    everything = OpSaver("every_matmul")
    assert [everything.saves(op) for op in sequence] == [True, True, False, True, True, True, True]
