"""Every registered data-parallel backend is one object behind one interface (fsdp_exp/parallel/backend.py):
real instances, asked without a process group. What a backend's vocabulary column calls "refused at
validation" its own check refuses, and an unknown backend name is refused with the closest real one (here
in-process; its exit 2 on the command line: tests/integration/test_config_cli.py)."""

from __future__ import annotations

import copy
import functools
import inspect

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import STRATEGIES, validate
from fsdp_exp.parallel.backend import BACKEND_ROLES, Backend, PlannerRules, backend_for, backend_names, get_backend
from fsdp_exp.parallel.vocabulary import ROWS

from conftest import run_config

# A role is what one kind of caller needs of a backend; more than this and it is two roles.
MAX_ROLE_METHODS = 10

# Per vocabulary row, the config values that set that knob away from its default (as its override or
# preset would: ``wrap=experts`` is ``wrap.policy=experts`` on a model with experts).
KNOB = {
    "sharding=full": {"sharding.strategy": "full"},
    "sharding=grad_op": {"sharding.strategy": "grad_op"},
    "sharding=hybrid": {"sharding.strategy": "hybrid"},
    "sharding=no_shard": {"sharding.strategy": "no_shard"},
    "sharding=optimizer": {"sharding.strategy": "optimizer"},
    "sharding.reshard_after_forward=N": {"sharding.reshard_after_forward": "2"},
    "sharding.reshard_last_block": {"sharding.reshard_last_block": True},
    "precision.param_dtype": {"precision.param_dtype": "bf16"},
    "precision.storage_dtype=bf16": {"precision.storage_dtype": "bf16", "precision.param_dtype": "bf16"},
    "precision.reduce_dtype": {"precision.reduce_dtype": "bf16"},
    "precision.output_dtype": {"precision.output_dtype": "fp32"},
    "precision.buffer_dtype": {"precision.buffer_dtype": "fp32"},
    "precision.cast_forward_inputs": {"precision.cast_forward_inputs": False},
    "precision.loss_scaler=dynamic": {"precision.loss_scaler": "dynamic"},
    "offload=params": {"offload.params": True},
    "offload=optimizer": {"offload.optimizer": True},
    "prefetch.forward=k": {"prefetch.forward": 2},
    "prefetch.backward=k": {"prefetch.backward": 2},
    "prefetch.backward_timing": {"prefetch.backward_timing": "post"},
    "prefetch.limit_all_gathers": {"prefetch.limit_all_gathers": True},
    "wrap=block": {"wrap.policy": "block"},
    "wrap=size": {"wrap.policy": "size"},
    "wrap=experts": {"model.n_experts": 4, "wrap.policy": "experts"},
    "wrap=none": {"wrap.policy": "none"},
    "sharding.use_orig_params": {"sharding.use_orig_params": True},
    "sharding.sync_module_states": {"sharding.sync_module_states": False},
    "ac=full / selective / selective_op": {"ac.mode": "full"},
    "trainer.grad_sync=every_micro_batch": {"trainer.grad_sync": "every_micro_batch"},
    "trainer.grad_sync=last_micro_batch": {"trainer.grad_sync": "last_micro_batch"},
    "compile=true": {"compile": True},
    "parallel.tp=N": {"parallel.tp": 2},
    "parallel.pp=N": {"parallel.pp": 2},
    "parallel.cp=N": {"parallel.cp": 2},
}


@functools.cache
def default_config(name: str):
    """The composed default config with ``name`` selected, running the first strategy it can (skipped when
    an optional backend's package is not installed)."""
    backend = get_backend(name)
    if backend.missing_dependency():
        pytest.skip(f"sharding.backend={name} is not installed: {backend.missing_dependency()}")
    return run_config([f"sharding.backend={name}", f"sharding.strategy={backend.strategies[0]}"])


def with_values(cfg, values: dict):
    cfg = copy.deepcopy(cfg)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        group = functools.reduce(getattr, parents, cfg)
        assert hasattr(group, leaf), path  # a misspelt path would set nothing the backend reads
        setattr(group, leaf, value)
    return cfg


def test_every_vocabulary_row_has_a_knob_to_try():
    assert set(KNOB) == set(ROWS)


@pytest.mark.parametrize("name", backend_names())
def test_every_registered_backend_implements_the_interface(name):
    backend = get_backend(name)
    assert isinstance(backend, Backend) and backend.name == name
    assert backend.api and backend.column_title and isinstance(backend.tracks_memory, bool)
    assert backend.strategies and set(backend.strategies) <= set(STRATEGIES)

    cfg = default_config(name)
    assert backend_for(cfg) is backend
    backend.check(cfg, "cpu")  # its own default configuration is legal
    topology = validate(cfg, cuda_devices=0)
    rules = backend.planner_rules(cfg)
    assert isinstance(rules, PlannerRules) and rules.param_layout in ("dim0", "flat", "replicated")
    assert 1 <= backend.shard_group(topology) <= topology.dp_size
    assert isinstance(backend.state_dict_options(), dict)
    for strategy in backend.strategies:
        shape, names = backend.data_parallel_mesh(strategy, dp=4, replicate=2, shard=2)
        assert len(shape) == len(names) and _product(shape) == 4, (strategy, shape, names)
    assert set(backend.vocabulary()) <= set(ROWS), "a vocabulary row that docs/vocabulary.md does not list"


def public_methods(cls) -> set[str]:
    """The public methods a class defines itself (not those it inherits)."""
    return {name for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")}


@pytest.mark.parametrize("role", BACKEND_ROLES, ids=lambda role: role.__name__)
def test_each_backend_role_is_small(role):
    assert 1 <= len(public_methods(role)) <= MAX_ROLE_METHODS, sorted(public_methods(role))


def test_every_backend_method_belongs_to_exactly_one_role():
    """The interface is its roles: Backend adds no method of its own, and no method is in two roles."""
    assert not public_methods(Backend)
    per_role = [public_methods(role) for role in BACKEND_ROLES]
    assert sum(map(len, per_role)) == len(set().union(*per_role))
    every_method = {name for name, value in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}
    assert every_method == set().union(*per_role)


@pytest.mark.parametrize("name", backend_names())
def test_every_registered_backend_implements_each_role_fully(name):
    backend = get_backend(name)
    assert all(isinstance(backend, role) for role in BACKEND_ROLES)
    assert not type(backend).__abstractmethods__, f"{name} lacks {sorted(type(backend).__abstractmethods__)}"


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


@pytest.mark.parametrize(
    "name,row", [(name, row) for name in backend_names() for row in ROWS if row not in get_backend(name).vocabulary()]
)
def test_a_knob_the_vocabulary_calls_refused_is_refused_by_the_backend(name, row):
    backend, cfg = get_backend(name), default_config(name)
    backend.check(cfg, "cpu")
    with pytest.raises(ConfigError):
        backend.check(with_values(cfg, KNOB[row]), "cpu")


def test_an_unknown_backend_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError) as err:
        validate(run_config(["sharding.backend=fsdp3"]), cuda_devices=0)
    assert "sharding.backend='fsdp3' is not one of fsdp2, fsdp1, ddp, deepspeed" in str(err.value)
    assert "did you mean sharding.backend=fsdp2?" in str(err.value)


def test_grad_sync_auto_is_each_backends_own_rule_and_a_setting_it_cannot_honour_is_refused():
    """trainer.grad_sync=auto: FSDP reduces every micro-batch into the sharded gradient, DDP only the last
    (no_sync), DeepSpeed by its engine's rule (ZeRO-2/3 every micro-batch, ZeRO-0/1 at the boundary), which
    it alone honours."""
    for name, rule in (("fsdp2", "every_micro_batch"), ("fsdp1", "every_micro_batch"), ("ddp", "last_micro_batch")):
        assert get_backend(name).grad_sync(default_config(name)) == rule
        for value in ("every_micro_batch", "last_micro_batch"):  # both honoured
            cfg = with_values(default_config(name), {"trainer.grad_sync": value})
            get_backend(name).check(cfg, "cpu")
            assert get_backend(name).grad_sync(cfg) == value
    deepspeed = get_backend("deepspeed")
    for strategy, rule, other in (
        ("full", "every_micro_batch", "last_micro_batch"),
        ("optimizer", "last_micro_batch", "every_micro_batch"),
    ):
        cfg = with_values(default_config("deepspeed"), {"sharding.strategy": strategy})
        assert deepspeed.grad_sync(cfg) == rule
        deepspeed.check(with_values(cfg, {"trainer.grad_sync": rule}), "cpu")
        with pytest.raises(ConfigError, match="trainer.grad_sync=auto"):
            deepspeed.check(with_values(cfg, {"trainer.grad_sync": other}), "cpu")
    with pytest.raises(ConfigError, match="trainer.grad_sync='sometimes'"):
        validate(run_config(["trainer.grad_sync=sometimes"]), cuda_devices=0)
