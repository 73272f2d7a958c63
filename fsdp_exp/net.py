"""Can this machine reach a server? One TCP connection, in a bounded time.

Asked before a client that would retry for long (huggingface_hub backs off for about half a minute on a
machine without a network; W&B's uploader waits longer), so that such a machine hears why in seconds.
A leaf: it imports nothing of fsdp_exp.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from typing import Optional
from urllib.parse import urlparse


def connect_problem(url: str, timeout: float) -> Optional[str]:
    """None when a TCP connection to ``url``'s host opens within ``timeout`` seconds, else why not.

    Behind a proxy (HTTPS_PROXY, ...; as the HTTP clients of the hub and W&B honour it) the connection
    tried is the proxy's. Name resolution has no timeout of its own (a machine without a resolver can wait
    far longer), so the attempt runs in a thread that is abandoned when the time is up."""
    parsed = urlparse(url)
    if not parsed.hostname:
        return f"the address {url!r} names no host"
    proxy = None if urllib.request.proxy_bypass(parsed.hostname) else urllib.request.getproxies().get(parsed.scheme)
    target, via = parsed, ""
    if proxy:
        target = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        via = f" (the proxy {proxy})"
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    outcome: dict[str, Optional[str]] = {}

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome["error"] = None
        except OSError as err:
            outcome["error"] = f"{type(err).__name__}: {err.strerror or err}"

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" not in outcome:
        return f"no connection to {host}:{port}{via} within {timeout:g} s"
    if outcome["error"]:
        return f"{host}:{port}{via}: {outcome['error']}"
    return None
