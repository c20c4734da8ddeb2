"""Log lines as `key=value` pairs (logfmt), so that a stream's or a batch's story can be grepped
and parsed: the service's stream lines, the Runs' dataset errors."""

from __future__ import annotations

import json


def logfmt(**fields: object) -> str:
    """`key=value` pairs for a log line; values with spaces, quotes or `=` are quoted (JSON)."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\\') or not text.isprintable():
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)
