"""The one HTTP error type: a request that got no answer, or an answer with an error status."""

from __future__ import annotations

import json

from slimectl.contract.errors import SlimectlError


class HttpError(SlimectlError):
    """A request to ``url`` failed: ``status`` is the HTTP status of the refusal, or None when no
    usable answer came (unreachable, timed out; for the sync helper also a body that is not JSON).
    The message is one line naming the URL and, where there is one, the fix."""

    def __init__(self, message: str, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


def refusal_message(what: str, url: str, method: str, path: str, status: int, raw: bytes) -> str:
    """``engine http://h:p: POST /generate failed with HTTP 400: <reason>`` (the one wording of a refusal)."""
    return f"{what} {url}: {method} {path} failed with HTTP {status}: {error_reason(raw)}"


def error_reason(raw: bytes) -> str:
    """The one-line reason in an error body: SGLang/OpenAI ``{"error": {"message"}}``, or a
    ``message``/``detail``/``error`` field, or the body's text."""
    try:
        body = json.loads(raw)
    except ValueError:
        text = " ".join(raw.decode("utf-8", errors="replace").split())
        return text[:300] or "(empty body)"
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return json.dumps(body)[:300]
