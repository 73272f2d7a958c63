"""The Hugging Face hub as fsdp_exp meets it, before any rank starts: a hub name (``data.dataset``,
``data.tokenizer``, ``model.hf_config``) is read through the hub's clients (datasets, tokenizers,
huggingface_hub). On a machine that cannot reach the hub they retry for about half a minute before they
look in their local caches, or refuse.

``unreachable`` says at once whether that would happen: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` /
``TRANSFORMERS_OFFLINE`` are set, or one TCP connection to the endpoint (``HF_ENDPOINT``, through the
proxy the environment names) does not open within ``PROBE_TIMEOUT_S``. Then ``offline`` sends the clients
straight to their caches, and a name they do not hold is refused in seconds; with the hub in reach
nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Iterator, Optional

from fsdp_exp.net import connect_problem

PROBE_TIMEOUT_S = 3.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = ("1", "ON", "YES", "TRUE")  # what the hub's clients take for "set"


def offline_variables() -> list[str]:
    return [name for name in OFFLINE_VARIABLES if os.environ.get(name, "").upper() in _TRUE]


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@functools.cache
def _probe(url: str) -> Optional[str]:
    """Once per process and endpoint: the launcher asks for the dataset, the tokenizer and the model."""
    return connect_problem(url, PROBE_TIMEOUT_S)


def unreachable() -> Optional[str]:
    """None when the hub's clients may go online; else why not, in words for a refusal."""
    variables = offline_variables()
    if variables:
        return f"{' and '.join(variables)} {'is' if len(variables) == 1 else 'are'} set"
    why = _probe(endpoint())
    return None if why is None else f"the hub ({endpoint()}) cannot be reached from this machine ({why})"


def how_to_reach() -> str:
    """The fix's part that brings the hub back (for a refusal that ``unreachable`` explains)."""
    variables = offline_variables()
    if variables:
        return f"unset {' and '.join(variables)} once to download it"
    return f"run it once where {endpoint()} is reachable (HF_ENDPOINT names a mirror, HTTPS_PROXY a proxy)"


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """huggingface_hub (and datasets, where imported) in offline mode: their local caches only, no request.
    Both read their switch when called, not only at import."""
    from unittest import mock

    from huggingface_hub import constants

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(constants, "HF_HUB_OFFLINE", True))
        if "datasets.config" in sys.modules:
            stack.enter_context(mock.patch.object(sys.modules["datasets.config"], "HF_HUB_OFFLINE", True))
        yield
