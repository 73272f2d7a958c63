"""The published GPU record as fsdp_exp runs: each row of a published table (``benchmarks/published/*.csv``,
the columns its README lists) mapped to the overrides of ``python -m fsdp_exp`` that express it, or the reason
it cannot be (``express``), and its run config (``Configs``: Hydra composes once per choice of config groups).

MPT (llm-foundry) is GPT-2's block in transformers (``model=hf``: LayerNorm with biases, biases on every
linear, a GELU MLP of ``ffn_dim``, full multi-head attention, tied embeddings, a learned position table of
``seq_len`` rows): the parameter count matches the published one exactly, which the caller checks. Llama 2/3
(torchtitan) is the llama family with the row's width, depth, heads, vocabulary and SwiGLU rounding. FSDP1
``FULL_SHARD`` -> ``sharding=fsdp1`` (composer's: ``prefetch=none``, its FSDPConfig's forward_prefetch=False), FSDP2 -> ``sharding=full``, HSDP -> ``sharding=hybrid``; composer's
``amp_bf16`` (FSDP ``mixed_precision=DEFAULT``: fp32 reduction) -> ``precision=bf16``, ``PURE`` ->
``precision=bf16_pure``; FP8 -> ``precision=float8`` with the scaling recipe the row names (torchao's tensorwise,
rowwise, rowwise_with_gw_hp; torchtitan's default, tensorwise, where a torchtitan row names none) and float8
all-gathers where it says so; ``compile`` yes -> ``compile=true``; AC none / full / selective layer (every 2nd
block, torchtitan's default) / per-op; pipeline stages (``pp``, ``vp``, ``micro_batch``) -> ``parallel.pp*``
(``pipeline_overrides``); context parallel (``cp``) -> ``parallel.cp`` and the method the row names
(``context_overrides``); a mixture of experts in every block (``moe_model_overrides``) with expert parallel
(``ep`` -> ``parallel.ep``, FSDP2 without resharding after forward -> ``sharding=grad_op``), what the Llama family's
MoE leaves out of it stated and counted (``moe_approximation``), and timed with the dispatcher and attention kernel
the row ran (``expert_dispatch``: DeepEP; ``attention_kernel``: TransformerEngine's cuDNN attention, FlexAttention).
Formats fsdp_exp cannot train (NVFP4, MXFP8, FP8 with delayed or blockwise scaling) are not expressible, and say why.

Used by ``benchmarks/published.py`` (the figures) and ``tune.calibrate_from=<a table>`` (the fit).
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdp_exp.tune.experts_perf import OWN_DISPATCH, ExpertDispatch, destination_ranks

# The published device names -> the device table's (fsdp_exp/plan/devices.py).
DEVICES = {
    "A100_80GB": "a100_80gb",
    "A100_40GB": "a100_40gb",
    "H100_80GB": "h100_80gb",
    "H100_SXM": "h100_80gb",
    "H100_96GB": "h100_96gb_500w",
    "H100_PCIE": "h100_pcie",
    "H200": "h200_141gb",
    "B200": "b200_192gb",
}
# Each source's MFU convention (fsdp_exp/metrics/flops.py CONVENTIONS) and its peak's dtype.
CONVENTION = {"llmfoundry": "llmfoundry", "torchtitan": "torchtitan_2024_04"}


@dataclass
class Row:
    source: str  # the file's stem
    index: int
    fields: dict
    overrides: list[str] = field(default_factory=list)
    device: Optional[str] = None
    network: Optional[str] = None
    not_expressible: Optional[str] = None
    model_fields: dict = field(default_factory=dict)  # the model's fields, as the overrides set them
    # what the mapping leaves out of the architecture, and the parameters that drops (the count checked is less them)
    approximation: Optional[str] = None
    dropped_params: int = 0
    attention_kernel: str = "fa2"  # the attention kernel the row ran (fsdp_exp.plan.devices.ATTENTION_KERNELS)
    dispatch: ExpertDispatch = OWN_DISPATCH  # a mixture of experts' dispatcher, as the row ran it
    # predictions
    predicted_tokens: Optional[float] = None
    need_gib: Optional[float] = None
    device_gib: Optional[float] = None
    verdict: Optional[str] = None  # fits | borderline | refused
    mfu_recomputed: Optional[float] = None
    error: Optional[str] = None

    @property
    def published_tokens(self) -> Optional[float]:
        text = self.fields.get("tokens_per_s_per_gpu") or ""
        return float(text) if text else None

    @property
    def published_oom(self) -> bool:
        return "OOM" in (self.fields.get("memory_as_published") or "")

    @property
    def table(self) -> str:
        f = self.fields
        return f"{self.source} | {f['model']} | {f['gpu']}"

    @property
    def name(self) -> str:
        f = self.fields
        return (
            f"{f['model']} {f['gpu']} x{f['n_gpus']} seq {f['seq_len']} mb {f['micro_batch']} "
            f"AC {f['activation_checkpointing'].split(' (')[0]} {f['precision']}"
        )


def load(paths: list[Path], rows_per_file: Optional[int] = None) -> list[Row]:
    """The rows of published tables (CSV files, or folders of them), each file's first ``rows_per_file``."""
    files = [f for p in paths for f in (sorted(Path(p).glob("*.csv")) if Path(p).is_dir() else [Path(p)])]
    out = []
    for path in files:
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
        for i, fields in enumerate(records[:rows_per_file] if rows_per_file else records):
            out.append(Row(path.stem, i, fields))
    return out


# ------------------------------------------------------------------------------------------------ mapping
def framework(fields: dict) -> str:
    text = fields["framework"].lower()
    return (
        "llmfoundry" if "llm-foundry" in text or "composer" in text else "torchtitan" if "torchtitan" in text else text
    )


def _int(text: str, default: int = 0) -> int:
    return int(text) if (text or "").strip().isdigit() else default


def model_overrides(f: dict) -> list[str] | str:
    """The model as the row's architecture, or why it cannot be expressed."""
    d, layers, heads, kv = int(f["d_model"]), int(f["n_layers"]), int(f["n_heads"]), _int(f["n_kv_heads"])
    ffn, vocab, seq = _int(f["ffn_dim"]), int(f["vocab"]), int(f["seq_len"])  # no ffn_dim: every block's an MoE
    kind = f["ffn_type"]
    if kind.startswith("GELU MLP") and "learned pos-emb" in kind:
        # MPT as llm-foundry builds it: GPT-2's block (LayerNorm with biases, biases on every linear, a GELU
        # MLP, full multi-head attention), tied embeddings and a learned position table of seq_len rows.
        fields = {
            "model_type": "gpt2",
            "vocab_size": vocab,
            "n_positions": seq,
            "n_embd": d,
            "n_layer": layers,
            "n_head": heads,
            "n_inner": ffn,
            "activation_function": "gelu",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": True,
        }
        body = ",".join(f"{k}:{v}" for k, v in fields.items())
        return ["model=hf", "+model.hf_fields={" + body + "}"]
    if kind.startswith("MoE in every layer") and "untied" in kind:
        return moe_model_overrides(f)
    if kind.startswith("SwiGLU") and "untied" in kind:
        base = [
            "model=llama7b",
            f"model.dim={d}",
            f"model.n_layers={layers}",
            f"model.n_heads={heads}",
            f"model.n_kv_heads={kv or heads}",
            f"model.vocab_size={vocab}",
            f"model.max_seq_len={seq}",
        ]
        return base + _swiglu_hidden(d, ffn)
    return f"architecture not mapped: {kind}"


def moe_model_overrides(f: dict) -> list[str]:
    """A mixture of experts in every block (the record's MoE rows: ``n_experts``, ``experts_top_k``,
    ``n_shared_experts``, ``moe_ffn_dim``, ``head_dim``; Qwen3's query/key norms where ``attention`` says qk_norm) as
    the Llama family's MoE: routed SwiGLU experts behind a softmax top-k router. What the family has no place for is
    left out by ``moe_approximation``."""
    heads, kv = int(f["n_heads"]), _int(f["n_kv_heads"])
    out = [
        "model=llama7b",
        f"model.dim={f['d_model']}",
        f"model.n_layers={f['n_layers']}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={kv or heads}",
        f"model.vocab_size={f['vocab']}",
        f"model.max_seq_len={f['seq_len']}",
        f"model.n_experts={f['n_experts']}",
        f"model.experts_top_k={f['experts_top_k']}",
        f"model.moe_hidden_dim={f['moe_ffn_dim']}",
        f"model.n_shared_experts={_int(f['n_shared_experts'])}",
    ]
    if _int(f.get("head_dim", "")):
        out.append(f"model.head_dim={f['head_dim']}")
    if "qk_norm" in f.get("attention", ""):
        out.append("model.qk_norm=true")
    return out


def moe_approximation(f: dict) -> tuple[str, int]:
    """(what the Llama family's MoE leaves out of the row's architecture, the parameters that drops), from the row's
    ``attention`` and ``ffn_type`` columns: GPT-OSS's q/k/v/o biases, attention sinks, the experts' and the router's
    biases (counted from the row's shape), its sliding-window layers (run as full causal attention, their
    attention priced as such) and its clamped SwiGLU (as SwiGLU). ("", 0) where nothing is left out."""
    attention, kind = f.get("attention", "").lower(), f["ffn_type"].lower()
    d, layers, heads, kv = int(f["d_model"]), int(f["n_layers"]), int(f["n_heads"]), _int(f["n_kv_heads"])
    hd, experts, width = _int(f.get("head_dim", "")) or d // heads, _int(f["n_experts"]), _int(f["moe_ffn_dim"])
    parts, dropped = [], 0
    if "biases" in attention:
        dropped += layers * (heads * hd + 2 * (kv or heads) * hd + d)
        parts.append("q/k/v/o biases")
    if "sinks" in attention:
        dropped += layers * heads
        parts.append("attention sinks")
    if "with biases" in kind:
        dropped += layers * (experts * (2 * width + d) + experts)
        parts.append("the experts' and the router's biases")
    if not parts and "sliding-window" not in attention and "clamped" not in kind:
        return "", 0
    text = f"left out: {', '.join(parts)} ({dropped:,} parameters)" if parts else "nothing left out"
    if "sliding-window" in attention:
        text += "; the sliding-window layers run as full causal attention"
    if "clamped" in kind:
        text += "; the clamped SwiGLU as SwiGLU"
    return text, dropped


def attention_kernel(f: dict) -> str:
    """The attention kernel a row ran: FlexAttention where its notes name it, cuDNN's fused attention where they name
    TransformerEngine's (``attn te``), else FlashAttention-2 (llm-foundry's and torchtitan's rows, 2023-2024)."""
    notes = f.get("notes", "").lower()
    if "flexattn" in notes or "flexattention" in notes:
        return "flex"
    if "attn te" in notes:
        return "cudnn"
    return "fa2"


def expert_dispatch(f: dict) -> ExpertDispatch:
    """A mixture of experts' dispatcher as the row ran it: DeepEP (its framework column) is a fused dispatcher that
    sends each token once to each EP rank holding one of its experts; under NeMo AutoModel's force-balanced "fake"
    gate (its ``task`` says "fake balanced gate") token i goes to the k experts from i x k on, so the ranks it
    reaches are those k consecutive experts' (``destination_ranks``). Anything else: fsdp_exp's own dispatcher."""
    said = (f["framework"] + " " + f.get("notes", "")).lower()
    if "deepep" not in said:
        return OWN_DISPATCH
    k, experts, ep = _int(f["experts_top_k"]), _int(f["n_experts"]), _int(f["ep"], 1)
    consecutive = "fake balanced gate" in f.get("task", "").lower()
    ranks = destination_ranks(k, experts, ep, consecutive) if ep > 1 else 1.0
    gate = "the force-balanced gate's consecutive experts" if consecutive else "a uniformly random top-k"
    return ExpertDispatch(True, ranks, f"DeepEP: {ranks:g} ranks a token ({gate})")


def _swiglu_hidden(d: int, ffn: int) -> list[str]:
    """``multiple_of`` / ``ffn_dim_multiplier`` giving Llama's SwiGLU hidden size ``ffn`` for width ``d``
    (Llama rounds int(2/3 x 4d x multiplier) up to a multiple)."""
    for multiplier in (None, 1.3, 1.5, 2.0, 1.0, 1.2):
        for multiple in (256, 1024, 4096, 512, 2048):
            hidden = int(2 * 4 * d / 3)
            if multiplier is not None:
                hidden = int(multiplier * hidden)
            if multiple * ((hidden + multiple - 1) // multiple) == ffn:
                out = [f"model.multiple_of={multiple}"]
                return out + ([f"model.ffn_dim_multiplier={multiplier}"] if multiplier is not None else [])
    return [f"model.multiple_of={ffn}"]  # no rule found: the parameter check below says so


def sharding_overrides(f: dict) -> list[str] | str:
    text = (f["sharding"] + " " + f["framework"]).upper()
    ep = _int(f["ep"], 1)
    if ep > 1 and "FSDP2" not in text:
        return "expert parallel rows are expressible on FSDP2 only (fsdp_exp's EP is built on it)"
    tp = [f"parallel.tp={_int(f['tp'], 1)}"] if _int(f["tp"], 1) > 1 else []
    tp += [f"parallel.ep={ep}"] if ep > 1 else []
    tp += pipeline_overrides(f) + context_overrides(f)
    # composer (llm-foundry) runs FSDP1 with its FSDPConfig's defaults: forward_prefetch=False (each unit's
    # all-gather issued when the unit runs), backward_prefetch=BACKWARD_POST, limit_all_gathers=True
    composer = ["prefetch=none", "prefetch.backward_timing=post"] if "COMPOSER" in text else []
    if "FULL_SHARD" in text and "FSDP1" in text:
        return ["sharding=fsdp1"] + composer + tp
    if "SHARD_GRAD_OP" in text and "FSDP1" in text:  # ZeRO-2 on FSDP1: units stay gathered from forward to backward
        return ["sharding=fsdp1", "sharding.strategy=grad_op"] + composer + tp
    if "HYBRID" in text or "HSDP" in text:
        return ["sharding=hybrid"] + tp
    if "FSDP2" in text or "FULLY_SHARD" in text:
        # FSDP2 keeping units gathered from forward to backward (reshard_after_forward=False): ZeRO-2 on FSDP2
        kept = "RESHARD_AFTER_FORWARD=FALSE" in text.replace(" ", "")
        return ["sharding=grad_op" if kept else "sharding=full"] + tp
    if "FULL_SHARD" in text:
        return ["sharding=fsdp1"] + tp
    return f"sharding not mapped: {f['sharding']}"


def context_overrides(f: dict) -> list[str]:
    """A row's context parallel: ``cp`` -> parallel.cp, with the method the row names (Ulysses / all-to-all),
    else ring: torchtitan's and Megatron's context parallel pass keys and values round the group."""
    cp = _int(f["cp"], 1)
    if cp <= 1:
        return []
    said = (f.get("notes", "") + " " + f["sharding"] + " " + f["framework"]).lower()
    method = "all_to_all" if ("ulysses" in said or "all-to-all" in said or "a2a" in said) else "ring"
    return [f"parallel.cp={cp}", f"parallel.cp_method={method}"]


def pipeline_overrides(f: dict) -> list[str]:
    """A row's pipeline stages: ``pp`` -> parallel.pp; ``vp`` (virtual stages, each rank's stages) > 1 ->
    interleaved 1F1B with that many stages per rank (Megatron's and torchtitan's interleaved schedule), else the
    schedule the row names (GPipe, or 1F1B: both sources' default). The micro-batch count follows
    trainer.micro_batch_size (the row's ``micro_batch``: the pipeline's micro-batch)."""
    pp = _int(f["pp"], 1)
    if pp <= 1:
        return []
    vp = _int(f.get("vp", ""), 1)
    said = (f.get("notes", "") + " " + f["sharding"]).lower()
    if vp > 1:
        return [f"parallel.pp={pp}", "parallel.pp_schedule=interleaved_1f1b", f"parallel.pp_stages_per_rank={vp}"]
    schedule = "gpipe" if "gpipe" in said else "1f1b"
    return [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}"]


def loss_override(f: dict) -> str:
    """How a row took its loss. llm-foundry's MPT (2023-2024) takes it with a fused cross-entropy kernel
    (``loss_fn: fused_crossentropy``, its default: flash-attn's, the gradient written in place over the logits), which
    holds no float32 copy of the logits: its memory is planned as fsdp_exp's default loss takes it
    (``trainer.loss_chunks=auto``: sliced where the logits matter to the peak) and its step timed without the
    sliced loss's second forward of the output projection (``fused_loss``: a fused kernel reads each logit once).
    torchtitan's (2024) casts all of a micro-batch's logits to float32 and takes the loss at once:
    ``trainer.loss_chunks=1``, planned and timed so."""
    return "trainer.loss_chunks=auto" if fused_loss(f) else "trainer.loss_chunks=1"


def fused_loss(f: dict) -> bool:
    return framework(f) == "llmfoundry"


def timing_config(cfg, row: "Row"):
    """The config a row's step is timed with: a fused loss (``fused_loss``) recomputes nothing, as
    ``trainer.loss_chunks=1`` prices it; otherwise the row's own config."""
    if not fused_loss(row.fields):
        return cfg
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, loss_chunks="1"))


def ac_override(f: dict) -> str:
    text = f["activation_checkpointing"].lower()
    if text.startswith("none") or text == "no":
        return "ac=none"
    if text.startswith("full"):
        return "ac=full"
    if "per-op" in text or "op" in text.split("(")[-1]:
        return "ac=selective_op"
    return "ac=selective"  # layer-wise: torchtitan's default selective_ac_option is every 2nd block


# FP8 formats fsdp_exp cannot train, each with why (checked before the FP8 recipes: "mxfp8" holds "fp8").
NOT_EXPRESSIBLE_FORMATS = {
    "nvfp4": "NVFP4 (4-bit) training: fsdp_exp's float8 training (torchao) covers FP8 only",
    "fp4": "FP4 training: fsdp_exp's float8 training (torchao) covers FP8 only",
    "mxfp8": "MXFP8: precision.float8_recipe=mxfp8 is refused (fsdp_exp does not build torchao's MXFP8 training yet)",
    "delayed": "FP8 with delayed scaling: torchao's float8 training (0.18) scales dynamically only",
    "blockwise": "FP8 with blockwise scaling: not one of torchao's float8 recipes that fsdp_exp builds",
    "block-wise": "FP8 with blockwise scaling: not one of torchao's float8 recipes that fsdp_exp builds",
}
# The scaling recipes as rows name them -> torchao's recipe names (precision.float8_recipe), most specific first.
FLOAT8_RECIPES = (
    ("rowwise_with_gw_hp", "rowwise_with_gw_hp"),
    ("gw_hp", "rowwise_with_gw_hp"),
    ("rowwise", "rowwise"),
    ("row-wise", "rowwise"),
    ("tensorwise", "tensorwise"),
    ("tensor-wise", "tensorwise"),
    ("per-tensor", "tensorwise"),
    ("current scaling", "tensorwise"),
)


def precision_overrides(f: dict) -> list[str] | str:
    """The row's precision as overrides, or why it cannot be expressed."""
    text = (f["precision"] + " " + f["precision_detail"]).lower()
    if "fp8" in text or "float8" in text or "fp4" in text:
        return _float8_overrides(f, text)
    if "pure" in text:
        return ["precision=bf16_pure"]  # FSDP mixed_precision=PURE: bf16 gradients reduced in bf16
    if "bf16" in text and "automodel" in f["framework"].lower().replace(" ", ""):
        # NeMo AutoModel's MoE models cast their parameters to bf16 when they initialize their weights (its Qwen3
        # model's initialize_weights), so its sharded parameters, gradients and AdamW moments are bf16; its
        # MixedPrecisionPolicy then computes in bf16 and reduces in fp32
        return ["precision=bf16", "precision.storage_dtype=bf16"]
    if "bf16" in text:
        return ["precision=bf16"]  # bf16 compute, fp32 reduction
    return f"precision not mapped: {f['precision']} ({f['precision_detail']})"


def _float8_overrides(f: dict, text: str) -> list[str] | str:
    for name, why in NOT_EXPRESSIBLE_FORMATS.items():
        if name in text:
            return f"precision not expressible: {f['precision']} ({f['precision_detail']}): {why}"
    recipe = next((recipe for said, recipe in FLOAT8_RECIPES if said in text), None)
    if recipe is None and framework(f) == "torchtitan":
        recipe = "tensorwise"  # torchtitan's float8 converter without a recipe name: tensorwise dynamic scaling
    if recipe is None:
        return (
            f"precision not expressible: {f['precision']} ({f['precision_detail']}): FP8 without a named scaling "
            "recipe (fsdp_exp needs tensorwise or rowwise)"
        )
    gathers = "all-gather" in text or "all_gather" in text
    return ["precision=float8", f"precision.float8_recipe={recipe}"] + (
        ["precision.float8_all_gather=true"] if gathers else []
    )


def compile_overrides(f: dict) -> list[str]:
    return ["compile=true"] if (f.get("compile") or "").lower().startswith("yes") else []


def network_of(f: dict, device: str) -> str:
    text = f["interconnect"].lower()
    if "roce" in text and "1600" in text:
        return "roce_8x200g"
    if "roce" in text and "3200" in text:  # llm-foundry's H100 tables: RoCE, not AWS's EFA
        return "roce_8x400g"
    if "3200" in text:
        return "ib_ndr_8x400g" if "ib" in text or "infiniband" in text else "efa_3200g"
    return ""  # the device's own default network


def express(row: Row) -> None:
    f = row.fields
    gpu = DEVICES.get(f["gpu"].split(" (")[0].upper())  # "H100_80GB (DGX-H100)": the system in brackets
    if gpu is None:
        row.not_expressible = f"device {f['gpu']} is not in the device table"
        return
    model = model_overrides(f)
    sharding = sharding_overrides(f)
    precision = precision_overrides(f)
    for problem in (model, sharding, precision):
        if isinstance(problem, str):
            row.not_expressible = problem
            return
    n_gpus = int(f["n_gpus"])
    per_node = _int(f["gpus_per_node"]) or min(8, n_gpus)
    row.device, row.network = gpu, network_of(f, gpu)
    row.model_fields = _model_fields(model)
    row.attention_kernel, row.dispatch = (
        attention_kernel(f),
        expert_dispatch(f) if _int(f.get("n_experts", "")) else OWN_DISPATCH,
    )
    if _int(f.get("n_experts", "")):
        text, dropped = moe_approximation(f)
        row.approximation, row.dropped_params = text or None, dropped
    row.overrides = (
        model
        + sharding
        + precision
        + compile_overrides(f)
        + [
            ac_override(f),
            loss_override(f),
            f"trainer.nproc_per_node={per_node}",
            f"trainer.nnodes={n_gpus // per_node}",
            f"trainer.global_batch_size={f['global_batch']}",
            f"trainer.micro_batch_size={f['micro_batch']}",
            f"trainer.seq_len={f['seq_len']}",
            "trainer.device=cuda",
        ]
    )


def row_perf(perf, row: Row):
    """The device's figures as the row ran: its network between nodes and its attention kernel."""
    from fsdp_exp.plan.devices import with_attention_kernel, with_network

    perf = with_network(perf, row.network) if row.network else perf
    return with_attention_kernel(perf, row.attention_kernel)


def _model_fields(model: list[str]) -> dict:
    """The model config's fields the overrides set: ``model.k=v`` as typed values, ``+model.hf_fields={...}``
    as the dict."""
    import yaml

    out: dict = {}
    for override in model:
        key, _, value = override.lstrip("+").partition("=")
        if key.startswith("model."):
            out[key.removeprefix("model.")] = (
                yaml.safe_load(value.replace(":", ": ").replace(",", ", "))
                if value.startswith("{")
                else yaml.safe_load(value)
            )
    return out


def _trainer_fields(row: Row) -> dict:
    values = dict(o.partition("=")[::2] for o in row.overrides if o.startswith("trainer."))
    return {
        "nproc_per_node": values["trainer.nproc_per_node"],
        "nnodes": int(values["trainer.nnodes"]),
        "global_batch_size": int(values["trainer.global_batch_size"]),
        "micro_batch_size": int(values["trainer.micro_batch_size"]),
        "seq_len": int(values["trainer.seq_len"]),
        "device": values["trainer.device"],
        "loss_chunks": values["trainer.loss_chunks"],
    }


class Configs:
    """Each row's run config. Hydra composes once per choice of the config groups (the model family, sharding,
    precision, AC); every other row of that choice is the composed config with its model's fields and the
    trainer's values replaced (``dataclasses.replace``): what Hydra composes from the same overrides (tested),
    at a thousandth of the cost."""

    def __init__(self, compose):
        self.compose, self.bases = compose, {}

    def __call__(self, row: Row):
        # the model's field names belong to the key: a field one row sets and another leaves at its preset's
        # value must not be carried over from the row composed first
        groups = tuple(o for o in row.overrides if not o.lstrip("+").startswith(("model.", "trainer."))) + tuple(
            sorted(row.model_fields)
        )
        if groups not in self.bases:
            self.bases[groups] = self.compose(row.overrides)
            return self.bases[groups]
        base = self.bases[groups]
        return dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, **row.model_fields),
            trainer=dataclasses.replace(base.trainer, **_trainer_fields(row)),
        )


def step_samples(paths: list[Path]) -> dict[str, dict]:
    """The published runs with a throughput, by device: ``{device: {"samples": [(its costs (``step_time.costs_for``), published tokens/s of
    the whole run, DevicePerf with the row's network)], "perf": the device's DevicePerf, "runs": n}}``, for
    ``tune.calibrate_from=<a published table>``. Rows that cannot be expressed, or whose mapped architecture
    misses the published parameter count, are left out."""
    from fsdp_exp.preflight import validate
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.models import spec_for
    from fsdp_exp.plan.devices import device_table
    from fsdp_exp.tune.step_time import costs_for
    from fsdp_exp.tune.compose import hydra_session

    table = device_table()
    groups: dict[str, dict] = {}
    with hydra_session() as (compose, _):
        configs = Configs(compose)
        for row in load(paths):
            express(row)
            if row.not_expressible or not row.published_tokens:
                continue
            cfg = configs(row)
            published_n = _int(row.fields.get("n_params", "")) - row.dropped_params
            if published_n and sum(p.numel for p in spec_for(cfg.model).inventory(cfg.model).params) != published_n:
                continue
            try:
                topology = validate(cfg, cuda_devices=int(cfg.trainer.nproc_per_node))
            except ConfigError:
                continue
            perf = table[row.device].perf
            group = groups.setdefault(row.device, {"samples": [], "perf": perf, "runs": 0})
            group["samples"].append(
                (
                    costs_for(timing_config(cfg, row), topology, dispatch=row.dispatch),
                    row.published_tokens * topology.world_size,
                    row_perf(perf, row),
                )
            )
            group["runs"] += 1
    return groups
