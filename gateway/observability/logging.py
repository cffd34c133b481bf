"""One structured JSON line per request. Never a key or prompt text: only ids, names, counts and timings."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

_logger = logging.getLogger("gateway.requests")


def setup_logging(level: str = "INFO") -> None:
    if not _logger.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        _logger.addHandler(h)
        _logger.propagate = False
    _logger.setLevel(level)


def log_request(fields: dict[str, Any]) -> None:
    if _logger.isEnabledFor(logging.INFO):
        _logger.info(orjson.dumps(fields).decode())
