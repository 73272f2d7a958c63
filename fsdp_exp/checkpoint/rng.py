"""Every random number generator of one rank (Python, NumPy, torch CPU, CUDA), as a
torch.distributed.checkpoint ``Stateful``: saved per rank, so that a resumed run draws what the
uninterrupted one would have drawn."""

from __future__ import annotations

import random

import torch


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    except ImportError:
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class RngState:
    """This process's RNGs (and ``device``'s CUDA generator) behind ``state_dict`` / ``load_state_dict``."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        return rng_state(self.device)

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state, self.device)
