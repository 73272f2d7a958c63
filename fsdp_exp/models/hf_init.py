"""A Hugging Face model's own initialization, replayed per parameter from (seed, name).

transformers initializes a model with its ``initialize_weights`` (each architecture's ``_init_weights``:
normal with ``initializer_range`` for linear and embedding weights, zeros for biases, ones (or zeros)
for norms, GPT-2's scaled residual projections, Gemma's embedding scale, rotary tables...). fsdp_exp
cannot run it on a sharded model: every rank would draw different numbers. So it runs it once on a
meta-device copy under a ``TorchFunctionMode`` that does nothing but write down, per tensor, what the
architecture does to it (``record``): which init function, with which arguments, on which slice
(an embedding's padding row). ``full_value`` then replays that recipe on one full tensor with a
generator seeded by (seed, name), so any world size and any sharding get the same values; values the
architecture computes rather than draws (rotary tables) are kept from the recording.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Functions that write a whole tensor: what came before them no longer matters.
OVERWRITES = {
    "normal_",
    "uniform_",
    "fill_",
    "zero_",
    "constant_",
    "ones_",
    "zeros_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "eye_",
    "dirac_",
    "sparse_",
    "copy_",
}
# Other in-place functions an initialization may apply on top (scaling, clamping).
UPDATES = {"mul_", "div_", "add_", "sub_", "clamp_", "fmod_", "abs_", "neg_", "masked_fill_", "exp_", "log_"}


@dataclass
class Step:
    """One in-place function applied to (a slice of) a tensor: ``func(target[path], *args, **kwargs)``."""

    func: Callable
    path: tuple  # successive ``__getitem__`` keys; () = the whole tensor
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.func.__name__


@dataclass
class Recipe:
    steps: list[Step] = field(default_factory=list)

    def add(self, step: Step) -> None:
        if step.path == () and step.name in OVERWRITES:
            self.steps = []
        self.steps.append(step)


class _Recorder(TorchFunctionMode):
    """Writes down the in-place functions applied to known tensors (and their slices); does not run them."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names  # id(tensor) -> its name
        self.views: dict[int, tuple[str, tuple]] = {}
        self.keep: list = []  # views stay alive, so that their ids are not reused
        self.recipes: dict[str, Recipe] = {}
        self.unknown: set[str] = set()

    def _where(self, tensor: Any) -> Optional[tuple[str, tuple]]:
        if not isinstance(tensor, torch.Tensor):
            return None
        if id(tensor) in self.names:
            return self.names[id(tensor)], ()
        return self.views.get(id(tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data and args:
            where = self._where(args[0])  # ``param.data``: the same tensor
            out = func(*args, **kwargs)
            if where:
                self.views[id(out)] = where
                self.keep.append(out)
            return out
        target = kwargs.get("tensor", args[0] if args else None)
        where = self._where(target)
        if where is None:
            return func(*args, **kwargs)
        if name == "__getitem__":
            out = func(*args, **kwargs)
            self.views[id(out)] = (where[0], where[1] + (args[1],))
            self.keep.append(out)
            return out
        if name in OVERWRITES or name in UPDATES:
            rest = args[1:] if "tensor" not in kwargs else args
            kwargs.pop("tensor", None)
            rest = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in rest)
            kwargs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*rest, *kwargs.values())):
                self.unknown.add(where[0])  # copied from another meta tensor: no value to keep
            self.recipes.setdefault(where[0], Recipe()).add(Step(func, where[1], rest, kwargs))
            return target
        return func(*args, **kwargs)


def record(model: nn.Module) -> tuple[dict[str, Recipe], set[str]]:
    """(recipe per parameter and buffer name, names whose recipe cannot be replayed) of ``model``, a
    fresh meta-device transformers model (the recording marks its modules initialized)."""
    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(t): n for n, t in model.named_buffers()})
    recorder = _Recorder(names)
    with recorder, torch.no_grad():
        model.initialize_weights()
    return recorder.recipes, recorder.unknown


def _takes_generator(func: Callable) -> bool:
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a C method: the random ones take a generator
        return func.__name__ in {
            "normal_",
            "uniform_",
            "random_",
            "bernoulli_",
            "exponential_",
            "geometric_",
            "log_normal_",
            "cauchy_",
        }


def full_value(recipe: Recipe, shape, seed: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """The full tensor the recipe makes, random draws from a generator seeded with ``seed`` only."""
    full = torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for step in recipe.steps:
            target = full
            for key in step.path:
                target = target[key]
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in step.args)
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.kwargs.items()}
            if kwargs.get("generator", 0) is None or _takes_generator(step.func):
                kwargs["generator"] = gen
            step.func(target, *args, **kwargs)  # a Tensor method or a torch.nn.init function: target first
    return full
