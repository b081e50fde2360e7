"""Reaching the Hugging Face hub, or saying quickly and clearly that we cannot.

Why: offline, the hub clients retry for half a minute before a vague error. Every hub access goes
through :func:`require_hub`, which honours the offline switches and probes the endpoint with a short
timeout (skipped behind a proxy, where a direct probe proves nothing).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from inkling_fp4.errors import DataError

PROBE_TIMEOUT_S = 3.0


def hub_offline_flag() -> bool:
    """True when the user switched the hub clients to offline mode."""
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _endpoint_reachable() -> bool:
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def require_hub(what: str, instead: str) -> None:
    """Raise a DataError naming ``what`` and the ``instead`` remedy when the hub cannot be reached."""
    if hub_offline_flag():
        raise DataError(
            f"{what} needs the Hugging Face hub but offline mode is set (HF_HUB_OFFLINE); {instead}"
        )
    if not _endpoint_reachable():
        raise DataError(f"{what} needs the Hugging Face hub, which cannot be reached (offline?); {instead}")
