"""A model family is one spec behind one interface (fsdp_exp/models/spec.py): the registry refuses an
unknown family with the closest real one, the planner and tensor parallel read the same plan (the
planner's per-rank shape of every parameter is the one torch's styles give it), and the inventory the
planner reads says where each parameter belongs without the planner knowing a name."""

from __future__ import annotations

import inspect

import pytest
import torch

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate
from fsdp_exp.models import REGISTRY, build_meta, count_params, get_spec, spec_for
from fsdp_exp.models.spec import COLWISE, ROWWISE, SPEC_ROLES, ModelSpec

from conftest import run_config


def test_an_unknown_family_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean model.name=llama"):
        get_spec("lama")
    with pytest.raises(ConfigError, match="model.name='lama' is not a known architecture") as err:
        validate(run_config(["model.name=lama"]), cuda_devices=0)
    assert "fix:" in str(err.value)
    assert all(isinstance(spec, ModelSpec) and spec.name == name for name, spec in REGISTRY.items())


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_planner_and_tensor_parallel_shard_the_same_dims(sequence_parallel):
    """tp.py turns the family's plan into torch's styles; the planner derives each parameter's
    tensor-parallel shape from the same plan. Applied to a meta model on a 2-rank mesh of torch's
    in-process fake process group (shapes only, no traffic), every DTensor's local shape on rank 0 is the
    planner's, including the embedding with a vocabulary that 2 does not divide."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_exp.parallel import tp
    from fsdp_exp.plan.states import tp_shape

    cfg = run_config(
        [
            "model=llama_tiny",
            "model.vocab_size=251",
            "parallel.tp=2",
            "trainer.nproc_per_node=2",
            f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
        ]
    )
    spec = spec_for(cfg.model)
    plan = spec.tensor_parallel_plan(cfg.model)
    root_styles, block_styles = tp.styles(plan, sequence_parallel)
    kinds = {COLWISE: "ColwiseParallel", ROWWISE: "RowwiseParallel"}
    assert {k: type(v).__name__ for k, v in block_styles.items() if k in plan.block} == {
        k: kinds[v] for k, v in plan.block.items()
    }
    assert {k: type(v).__name__ for k, v in root_styles.items() if k in plan.root} == {
        k: kinds[v] for k, v in plan.root.items()
    }

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build_meta(cfg.model)
        tp.apply(model, cfg, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        shapes = {
            name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
            for name, p in model.named_parameters()
        }
    finally:
        dist.destroy_process_group()
    inventory = spec.inventory(cfg.model)
    assert shapes == {entry.name: tp_shape(entry, 2) for entry in inventory.params}
    assert shapes["tok_embeddings.weight"] == (126, 64)  # torch's rowwise embedding: vocabulary rows
    assert shapes["layers.0.attention.wo.weight"] == (64, 32)  # rowwise linear: input features


def test_the_inventory_places_every_parameter_without_the_planner_knowing_names():
    cfg = run_config(["model=moe_tiny"]).model
    spec = spec_for(cfg)
    inventory = spec.inventory(cfg)
    assert inventory is spec.inventory(cfg)  # cached per model config
    assert build_meta(cfg) is not spec.meta_model(cfg)  # what gets wrapped is never the shared one
    assert inventory.blocks == ("layers.0", "layers.1")
    for entry in inventory.params:
        in_block = entry.name.startswith(("layers.0.", "layers.1."))
        assert (entry.block is not None) == in_block, entry
        if in_block:
            assert entry.name.startswith(inventory.blocks[entry.block] + ".")
    assert inventory.input_params == {"tok_embeddings.weight"}
    assert inventory.output_params == {"output.weight"}
    head_dim = cfg.dim // cfg.n_heads
    rotary = 2 * 4 * cfg.max_seq_len * head_dim // 2  # the rotary tables, fp32
    routing = cfg.n_layers * 4 * (2 * cfg.n_experts + 3)  # per layer: expert bias and load; dropped, aux, forwards
    assert inventory.buffer_bytes == rotary + routing
    assert count_params(cfg) == sum(p.numel() for p in build_meta(cfg).parameters())
    tied = run_config(["model=llama_tiny", "model.tie_embeddings=true"]).model
    assert spec.tied_weights(tied) == {"output.weight": "tok_embeddings.weight"}
    assert spec.inventory(tied).output_params == frozenset()  # the tied output weight is the embedding's


def test_the_hugging_face_mapping_names_every_parameter_and_refuses_experts():
    cfg = run_config(["model=llama_tiny"]).model
    spec = spec_for(cfg)
    state = {name: torch.zeros(p.shape) for name, p in build_meta(cfg).named_parameters()}
    names = spec.to_hf(state, cfg)
    assert len(names) == len(state) and all(n.startswith(("model.", "lm_head.")) for n in names)
    w1 = next(e for e in spec.inventory(cfg).params if e.name == "layers.0.feed_forward.w1.weight")
    assert spec.hf_config(cfg)["intermediate_size"] == w1.shape[0]
    assert spec.why_no_hf_export(run_config(["model=moe_tiny"]).model) is None  # Mixtral's layout (test_moe.py)
    shared = run_config(["model=moe_tiny", "model.n_shared_experts=1"]).model
    assert "shared experts" in spec.why_no_hf_export(shared)
    with pytest.raises(ValueError, match="shared experts"):
        spec.to_hf({}, shared)


# A role is what one kind of caller needs of a model family; more than this and it is two roles.
MAX_ROLE_METHODS = 10


def public_methods(cls) -> set[str]:
    """The public methods a class defines itself (not those it inherits)."""
    return {name for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")}


@pytest.mark.parametrize("role", SPEC_ROLES, ids=lambda role: role.__name__)
def test_each_model_spec_role_is_small(role):
    assert 1 <= len(public_methods(role)) <= MAX_ROLE_METHODS, sorted(public_methods(role))


def test_every_model_spec_method_belongs_to_exactly_one_role():
    """The interface is its roles: ModelSpec adds no method of its own, and no method is in two roles."""
    assert not public_methods(ModelSpec)
    per_role = [public_methods(role) for role in SPEC_ROLES]
    assert sum(map(len, per_role)) == len(set().union(*per_role))
    every_method = {
        name for name, value in inspect.getmembers(ModelSpec, inspect.isfunction) if not name.startswith("_")
    }
    assert every_method == set().union(*per_role)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_family_implements_each_role_fully(name):
    spec = REGISTRY[name]
    assert all(isinstance(spec, role) for role in SPEC_ROLES)
    assert not type(spec).__abstractmethods__, f"{name} lacks {sorted(type(spec).__abstractmethods__)}"
