"""Nothing accepted is ignored: every option of the layout's config groups (sharding, precision, offload,
prefetch, wrap, ac: each YAML option) and the layout knobs of the trainer (grad_sync, loss_chunks), tried on
each layout (pp=1 at 2 ranks, pp=2 at 2 ranks, tp=2 at 4), must be refused by preflight or change what the
run is planned to be: the memory plan (fsdp_exp.plan) or the topology. Without
ranks, so the applied settings a run records are not read here: test_backends checks those per backend.

The model has 4 blocks and 4 micro-batches per step, so that prefetch depth and gradient sync have something
to act on. An option that changes nothing in the config (the layout's own default) is skipped.
"""

from __future__ import annotations

import functools
import json

import pytest

from fsdp_exp import composability
from fsdp_exp.config import plain
from fsdp_exp.config.variants import group_options
from fsdp_exp.parallel.backend import backend_for
from fsdp_exp.plan import plan
from fsdp_exp.preflight import validate

BASE = ("model.n_layers=4", "trainer.micro_batch_size=1")
LAYOUTS = {"pp=1": (), "pp=2": ("parallel.pp=2",), "tp=2": ("parallel.tp=2", "trainer.nproc_per_node=4")}
GROUPS = ("sharding", "precision", "offload", "prefetch", "wrap", "ac")
KNOBS = ("trainer.grad_sync=every_micro_batch", "trainer.grad_sync=last_micro_batch", "trainer.loss_chunks=1")
OPTIONS = [f"{group}={option}" for group in GROUPS for option in group_options(group)] + list(KNOBS)
# Accepted under pipeline parallel and still ignored: the stage plan keeps the states of offload=params on the
# device although the stages offload them, and last_micro_batch is what the stages do anyway (prefetch and
# every_micro_batch are refused by name under pp since the pipeline work).
IGNORED_UNDER_PP = {"offload=params", "trainer.grad_sync=last_micro_batch"}


def _resolved(overrides: tuple[str, ...]) -> dict:
    """The config as the user asks for it, trainer.grad_sync=auto read as the backend's natural choice (at
    pp=1: pipeline stages fix their own reduction, so there an explicit value is a change)."""
    cfg = composability.config_of(overrides)
    resolved = plain(cfg)
    if cfg.trainer.grad_sync == "auto" and cfg.parallel.pp == 1:
        resolved["trainer"]["grad_sync"] = backend_for(cfg).natural_grad_sync
    return resolved


@functools.cache
def _what_changes(overrides: tuple[str, ...]) -> str:
    cfg = composability.config_of(overrides)
    topology = validate(cfg, cuda_devices=0)
    planned = plan(cfg, topology).to_dict()
    return json.dumps([planned, topology.as_dict()], sort_keys=True, default=str)


def _cases():
    for layout in LAYOUTS:
        for option in OPTIONS:
            marks = []
            if layout == "pp=2" and option in IGNORED_UNDER_PP:
                marks = [pytest.mark.xfail(strict=True, reason="ignored inside pipeline stages")]
            yield pytest.param(layout, option, marks=marks, id=f"{layout}-{option}")


@pytest.mark.parametrize("layout,option", list(_cases()))
def test_an_option_preflight_accepts_changes_the_plan_or_the_layout(layout, option):
    base = (*BASE, *LAYOUTS[layout])
    overrides = (*base, option)
    if composability.outcome(overrides) is not None:
        return  # refused by name before any rank starts
    if _resolved(overrides) == _resolved(base):
        return  # the layout's own default
    assert _what_changes(overrides) != _what_changes(base), (
        f"{option} under {layout} is accepted and changes neither the plan nor the topology"
    )
