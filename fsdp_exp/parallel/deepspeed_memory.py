"""What a DeepSpeed engine holds, tensor by tensor: its model states counted as every backend's are.

The engine keeps its states in its own structures (flat buffers, partitions), not as the module's
parameters and the optimizer's state, so they are read from where DeepSpeed keeps them, each storage
counted once (views into one flat buffer share it, padding included), in six kinds: ``params``,
``master`` (the fp32 copies the optimizer steps), ``moments``, ``grads`` (at the accumulation
boundary), ``step_grads`` (the fp32 copy the optimizer step reads, seen by a pre-step hook on the
AdamW) and ``buffers`` (communication buckets, flags: reported apart, not a model state). In the
trainer's keys ``grads`` is grads + step_grads and ``optim_state`` is master + moments. Which of
DeepSpeed's attributes each kind reads, and the bytes per parameter measured by stage: the docs page
backends.md ("DeepSpeed ZeRO as a fourth backend").
"""

from __future__ import annotations

import torch
from torch import nn

GRAD_WORDS = ("grad",)


def _category(attribute: str) -> str:
    """Where a tensor the ZeRO optimizer holds belongs, by DeepSpeed's name for it."""
    name = attribute.lower()
    if any(word in name for word in GRAD_WORDS):
        return "grads"
    return "master" if "fp32" in name else "buffers"


def _key(t: torch.Tensor):
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr()) if storage.nbytes() else None


def _tensors(obj, depth: int = 0):
    """Tensors inside ``obj``: itself, or in its (nested) lists, tuples and dicts."""
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)


class _Ledger:
    """Storage bytes by category and by where they were found; each storage counted once (first wins)."""

    def __init__(self):
        self.seen: set = set()
        self.bytes: dict[str, int] = {}
        self.where: dict[str, int] = {}

    def add(self, category: str, where: str, t) -> None:
        if t is None or not torch.is_tensor(t):
            return
        key = _key(t)
        if key is None or key in self.seen:
            return
        self.seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        self.bytes[category] = self.bytes.get(category, 0) + nbytes
        self.where[f"{category}:{where}"] = self.where.get(f"{category}:{where}", 0) + nbytes


class ZeroStateBytes:
    """The trainer's model-state counter for a DeepSpeed engine (``Backend.model_state_counter``)."""

    def __init__(self, engine: nn.Module):
        self.engine = engine
        self.basic = engine.basic_optimizer
        self.grads: dict[str, int] = {}
        self.grad_where: dict[str, int] = {}
        self.grad_keys: set = set()
        self.step_grads = 0
        self.step_grad_where: dict[str, int] = {}
        engine.fsdp_exp_state_counter = self  # the backend's optimizer_step calls before_step()
        self.basic.register_step_pre_hook(self._at_step)

    def _module_params(self, ledger: _Ledger) -> None:
        for p in self.engine.module.parameters():
            if hasattr(p, "ds_tensor"):
                ledger.add("params", "ds_tensor (partition)", p.ds_tensor)
            ledger.add("params", "module parameters", p.data)

    def before_step(self) -> None:
        """At the accumulation boundary, before ``engine.step()``: the gradients the engine holds."""
        ledger = _Ledger()
        self._module_params(ledger)  # known storages first, so that no parameter is taken for a gradient
        for p in self.engine.module.parameters():
            ledger.add("grads", "module .grad", p.grad)
        opt = self.engine.optimizer
        if opt is not self.basic:
            for name, value in vars(opt).items():
                if any(word in name.lower() for word in GRAD_WORDS):
                    for t in _tensors(value):
                        ledger.add("grads", name.split("__")[-1], t)
        self.grads = {"grads": ledger.bytes.get("grads", 0)}
        self.grad_where = {k: v for k, v in ledger.where.items() if k.startswith("grads:")}
        self.grad_keys = ledger.seen
        self.step_grads, self.step_grad_where = 0, {}

    def _at_step(self, optimizer, args, kwargs) -> None:
        """Before each AdamW step (ZeRO steps one parameter group or sub-group at a time, freeing each
        group's fp32 gradients after it): the fp32 gradients that are not the ones already counted."""
        ledger = _Ledger()
        ledger.seen = set(self.grad_keys)
        for group in optimizer.param_groups:
            for p in group["params"]:
                ledger.add("step_grads", "master .grad (fp32)", p.grad)
        if ledger.bytes.get("step_grads", 0) > self.step_grads:  # the largest group's, alive at once
            self.step_grads = ledger.bytes["step_grads"]
            self.step_grad_where = {k: v for k, v in ledger.where.items() if k.startswith("step_grads:")}

    def breakdown(self) -> dict:
        """Bytes by category (params, master, moments, grads, step_grads, buffers) and by DeepSpeed's
        attribute name (``where``)."""
        ledger = _Ledger()
        self._module_params(ledger)
        for group in self.basic.param_groups:
            for p in group["params"]:
                ledger.add("master", "optimizer parameter groups (fp32)", p)
        for state in self.basic.state.values():
            for name, value in state.items():
                if torch.is_tensor(value) and value.ndim > 0:
                    ledger.add("moments", name, value)
        opt = self.engine.optimizer
        if opt is not self.basic:
            for name, value in vars(opt).items():
                for t in _tensors(value):
                    ledger.add(_category(name), name.split("__")[-1], t)
        out = {k: ledger.bytes.get(k, 0) for k in ("params", "master", "moments", "buffers")}
        out["grads"] = self.grads.get("grads", 0)
        out["step_grads"] = self.step_grads
        where = {k: v for k, v in ledger.where.items() if not k.startswith("grads:")}
        out["where"] = {**where, **self.grad_where, **self.step_grad_where}
        return out

    def __call__(self) -> dict[str, int]:
        b = self.breakdown()
        params, grads, optim = b["params"], b["grads"] + b["step_grads"], b["master"] + b["moments"]
        return {"params": params, "grads": grads, "optim_state": optim, "model_states": params + grads + optim}
