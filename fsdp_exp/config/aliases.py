"""What a user means by a config option fsdp_exp does not have: the words other tools use, and their fix here.

A refusal of an unknown option (``sharding=fsdp2``) offers the closest real one by spelling, and spelling
misleads: ``fsdp2`` is one letter from ``fsdp1``, a different backend, while the user meant FSDP2, which is
this project's default (``sharding=full``). This table maps the names other tools and papers use to what
they mean here; the spelling match runs over these names as well as the real options, so a near miss of an
alias (``bf16_mixd``) lands on the alias's fix too. A leaf: it imports nothing of fsdp_exp.
tests/unit/test_option_aliases.py composes every fix, so none names an option that does not exist.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from fsdp_exp.errors import closest


class Alias(NamedTuple):
    fixes: tuple[str, ...]  # the overrides that give what the word means, the likeliest first
    means: str  # what the word means, in this project's words


def _a(*fixes: str, means: str) -> Alias:
    return Alias(fixes, means)


# (group, word) -> its fix. Words are matched lower case with "-" read as "_" (``bf16-mixed``, ``BF16_MIXED``).
ALIASES: dict[tuple[str, str], Alias] = {
    # sharding: backends named as options, and the strategies' names in torch, DeepSpeed and Lightning
    ("sharding", "fsdp2"): _a(
        "sharding=full", "sharding.backend=fsdp2", means="FSDP2, the default backend, whose full shard is sharding=full"
    ),
    ("sharding", "fsdp"): _a("sharding=full", "sharding=fsdp1", means="FSDP2's full shard; FSDP1's is sharding=fsdp1"),
    ("sharding", "fully_shard"): _a("sharding=full", means="FSDP2's fully_shard, parameters resharded after forward"),
    ("sharding", "full_shard"): _a("sharding=full", means="FULL_SHARD: parameters, gradients and optimizer sharded"),
    ("sharding", "shard_grad_op"): _a("sharding=grad_op", means="SHARD_GRAD_OP: gradients and optimizer sharded"),
    ("sharding", "hybrid_shard"): _a("sharding=hybrid", means="HYBRID_SHARD: shard in a node, replicate across"),
    ("sharding", "hsdp"): _a("sharding=hybrid", means="hybrid sharding: shard in a group, replicate across groups"),
    ("sharding", "fsdp1_full"): _a("sharding=fsdp1", means="FSDP1 with FULL_SHARD"),
    ("sharding", "zero"): _a("sharding=zero3", "sharding=full", means="ZeRO stage 3, by DeepSpeed or by FSDP2"),
    ("sharding", "zero0"): _a("sharding=ddp", means="ZeRO stage 0: replicas, gradients all-reduced"),
    ("sharding", "zero_1"): _a(
        "sharding=zero1", "sharding=optimizer", means="ZeRO stage 1, by DeepSpeed or by torch's ZeroRedundancyOptimizer"
    ),
    ("sharding", "zero_2"): _a("sharding=zero2", "sharding=grad_op", means="ZeRO stage 2, by DeepSpeed or by FSDP2"),
    ("sharding", "zero_3"): _a("sharding=zero3", "sharding=full", means="ZeRO stage 3, by DeepSpeed or by FSDP2"),
    ("sharding", "deepspeed"): _a("sharding=zero3", means="DeepSpeed; its stages are sharding=zero1|zero2|zero3"),
    ("sharding", "deepspeed_stage_1"): _a("sharding=zero1", means="DeepSpeed ZeRO stage 1"),
    ("sharding", "deepspeed_stage_2"): _a("sharding=zero2", means="DeepSpeed ZeRO stage 2"),
    ("sharding", "deepspeed_stage_3"): _a("sharding=zero3", means="DeepSpeed ZeRO stage 3"),
    ("sharding", "zero_redundancy_optimizer"): _a("sharding=optimizer", means="torch's ZeroRedundancyOptimizer"),
    ("sharding", "dp"): _a("sharding=ddp", means="data parallel: DistributedDataParallel"),
    ("sharding", "data_parallel"): _a("sharding=ddp", means="DistributedDataParallel"),
    ("sharding", "distributed_data_parallel"): _a("sharding=ddp", means="DistributedDataParallel"),
    ("sharding", "ddp_spawn"): _a("sharding=ddp", means="DistributedDataParallel; fsdp_exp starts the ranks itself"),
    ("sharding", "ddp_find_unused_parameters_true"): _a("sharding=ddp", means="DistributedDataParallel"),
    ("sharding", "replicate"): _a("sharding=ddp", "sharding=no_shard", means="full replicas, by DDP or by FSDP2"),
    ("sharding", "none"): _a("sharding=ddp", "sharding=no_shard", means="no sharding: full replicas"),
    # precision: Lightning's and the papers' names
    ("precision", "fp8"): _a("precision=float8", means="torchao's float8 matmuls, bf16 otherwise"),
    ("precision", "float8_e4m3fn"): _a("precision=float8", means="torchao's float8 matmuls, bf16 otherwise"),
    ("precision", "fp8_all_gather"): _a("precision=float8_all_gather", means="float8 matmuls and all-gathers"),
    ("precision", "bf16_mixed"): _a("precision=bf16", means="bf16 compute, fp32 master weights and reduction"),
    ("precision", "bfloat16"): _a("precision=bf16", means="bf16 compute, fp32 master weights and reduction"),
    ("precision", "bf16_true"): _a("precision=bf16_pure", means="bf16 compute and reduction, fp32 master weights"),
    ("precision", "pure_bf16"): _a("precision=bf16_pure", means="bf16 compute and reduction, fp32 master weights"),
    ("precision", "fp16_mixed"): _a("precision=fp16", means="fp16 compute with a loss scaler, fp32 master weights"),
    ("precision", "16_mixed"): _a("precision=fp16", means="fp16 compute with a loss scaler, fp32 master weights"),
    ("precision", "float16"): _a("precision=fp16", means="fp16 compute with a loss scaler, fp32 master weights"),
    ("precision", "half"): _a("precision=fp16", means="fp16 compute with a loss scaler, fp32 master weights"),
    ("precision", "amp"): _a(
        "precision=bf16", "precision=fp16", means="mixed precision: bf16, or fp16 with a loss scaler"
    ),
    ("precision", "mixed"): _a(
        "precision=bf16", "precision=fp16", means="mixed precision: bf16, or fp16 with a loss scaler"
    ),
    ("precision", "fp32_true"): _a("precision=fp32", means="fp32 throughout"),
    ("precision", "32_true"): _a("precision=fp32", means="fp32 throughout"),
    ("precision", "float32"): _a("precision=fp32", means="fp32 throughout"),
    ("precision", "full"): _a("precision=fp32", means="fp32 throughout"),
    # activation checkpointing and offload: on/off words
    ("ac", "true"): _a("ac=full", means="every block recomputed in backward"),
    ("ac", "on"): _a("ac=full", means="every block recomputed in backward"),
    ("ac", "false"): _a("ac=none", means="no activation checkpointing"),
    ("ac", "off"): _a("ac=none", means="no activation checkpointing"),
    ("ac", "selective_layer"): _a("ac=selective", means="every n-th block checkpointed"),
    ("ac", "op"): _a("ac=selective_op", means="op-level selective checkpointing"),
    ("offload", "cpu"): _a("offload=params", means="parameters, gradients and optimizer state on the host"),
    ("offload", "param"): _a("offload=params", means="parameters, gradients and optimizer state on the host"),
    ("offload", "optim"): _a("offload=optimizer", means="the optimizer state on the host"),
    ("offload", "off"): _a("offload=none", means="nothing offloaded"),
    ("offload", "false"): _a("offload=none", means="nothing offloaded"),
}


def _normal(word: str) -> str:
    return word.strip().lower().replace("-", "_")


def meant(group: str, word: str, options: list[str]) -> Optional[Alias]:
    """What ``group=word`` (not one of ``options``) most likely means: an alias's fix, or the closest real
    option by spelling, whichever of the two is closer; None when nothing is close."""
    aliases = {w: alias for (g, w), alias in ALIASES.items() if g == group}
    normal = _normal(word)
    if normal in aliases:
        return aliases[normal]
    real = {_normal(option): option for option in options}
    if normal in real:  # a case or dash slip of a real option
        return Alias((f"{group}={real[normal]}",), means="")
    near = closest(normal, [*real, *aliases])
    if near is None:
        return None
    return aliases[near] if near in aliases else Alias((f"{group}={real[near]}",), means="")


def fix_text(alias: Alias) -> str:
    """``alias`` as a refusal's fix: "sharding=full or sharding.backend=fsdp2 (FSDP2, the default backend, ...)"."""
    return " or ".join(alias.fixes) + (f" ({alias.means})" if alias.means else "")
