"""Structured, one-line logs that carry the request id.

Every line is ``time level logger [request_id] message key=value ...`` so a person
on call can grep one request across the router and the workers.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import sys
from collections.abc import Iterable

__all__ = ["LOG_LEVELS", "add_log_level_flag", "request_id_var", "configure_logging", "error_lines", "kv"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` of a command line, any case; another word is a usage error, not a traceback."""
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")


def configure_logging(level: str = "INFO") -> None:
    """Send this process's logs to stderr, one line each, with the current request id."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise


def kv(**fields: object) -> str:
    """Format fields as ``key=value`` pairs for a log line."""
    return " ".join(f"{k}={v}" for k, v in fields.items())


# What marks a line of a vLLM server's output as part of why it failed.
_ERROR_MARKS = ("Error", "error:", "Exception", "Traceback", "raise ", "FAILED")


def error_lines(lines: Iterable[str], limit: int) -> list[str]:
    """The last ``limit`` lines of a vLLM server's output that say why it failed.

    vLLM's start-up warning about the open-files limit quotes an ``OSError`` without one
    having happened: it is left out.
    """
    picked = [line for line in lines if any(mark in line for mark in _ERROR_MARKS) and "ulimit" not in line]
    return picked[-limit:]
