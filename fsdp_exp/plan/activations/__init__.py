"""The planner's activation models, one per model family: the bytes each block saves for backward and
the transient peaks of its forward and backward, derived from the family's own modules.

``profile_for`` picks the family's model by the spec's ``name`` (``PROFILES``): the registry lives here,
above ``fsdp_exp.models``, so that a model family never imports the planner. A new family adds its module
here and one line in ``PROFILES``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_exp.plan.activations import hf, llama
from fsdp_exp.plan.activations.profile import ActivationProfile, TokenCounts

if TYPE_CHECKING:
    from fsdp_exp.config.schema import ModelConfig

__all__ = ["PROFILES", "ActivationProfile", "TokenCounts", "profile_for"]

# model.name -> (its spec, model config, micro-batch, sequence length, tp, sequence parallel, cp) -> its profile
PROFILES = {
    "llama": llama.profile,
    "hf": hf.profile,
}


def profile_for(
    cfg: "ModelConfig",
    micro_batch: int,
    seq_len: int,
    tp: int,
    sequence_parallel: bool,
    cp: int = 1,
    ep: int = 1,
    imbalance: float = 1.0,
) -> ActivationProfile:
    """Per-rank activation sizes of one micro-batch of the model ``cfg`` (``ActivationProfile``); under context
    parallel (``cp`` > 1) each rank holds seq_len / cp tokens of every sequence; under expert parallel (``ep`` >
    1) its experts run on the copies the EP group sends them, ``imbalance`` (max / mean copies per expert) times
    the mean at the busiest rank."""
    from dataclasses import fields, replace

    from fsdp_exp.models import spec_for

    spec = spec_for(cfg)
    if spec.name not in PROFILES:
        raise NotImplementedError(f"the planner has no activation model of model.name={spec.name}")
    profile = PROFILES[spec.name](spec, cfg, micro_batch, seq_len, tp, sequence_parallel, cp)
    if ep > 1 or imbalance != 1.0:
        if "ep" not in {f.name for f in fields(profile)}:
            raise NotImplementedError(f"the planner has no expert-parallel model of model.name={spec.name}")
        profile = replace(profile, ep=ep, imbalance=imbalance)
    return profile
