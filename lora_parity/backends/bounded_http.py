"""HTTP calls to a server lora-parity may not control (an attached vLLM server, a Tinker service),
bounded in every way a server could hold a run: a connect and read timeout, a total deadline that
also ends a server trickling bytes (a watchdog shuts the socket down), a cap on the response's size,
and no redirects (a redirect is an error: the API key in the headers never follows it to another
host). Standard library only.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass

MAX_RESPONSE_BYTES = 64 * 2**20
"""Largest response read: a /v1/completions answer with prompt_logprobs for a batch of probes is
well under 1 MB."""
MAX_ERROR_BYTES = 4096
"""Of an error response, only this much is read (it goes into a one-line message)."""


class HTTPCallError(OSError):
    """The call could not complete: unreachable, timed out, too large, or a redirect."""


@dataclass(frozen=True)
class Response:
    """A complete response (any status)."""

    status: int
    body: bytes


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HTTPCallError(f"not an http(s) URL: {parts.scheme}://{parts.hostname or ''}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s,
                                           context=ssl.create_default_context()), target
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s), target


def _body(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The response's body: at most `max_bytes` (an error status's cut at `MAX_ERROR_BYTES`)."""
    limit = max_bytes if response.status < 400 else MAX_ERROR_BYTES
    length = response.getheader("Content-Length")
    if response.status < 400 and length is not None and length.isdigit() and int(length) > limit:
        raise HTTPCallError(f"answered {length} bytes, more than the {limit} a response may have")
    chunks, size = [], 0
    while size <= limit:
        chunk = response.read1(min(65536, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit and response.status < 400:
        raise HTTPCallError(f"answered more than the {limit} bytes a response may have")
    return b"".join(chunks)[:limit]


def _failure(e: Exception, expired: bool, timeout_s: float, deadline_s: float) -> HTTPCallError:
    """What a socket or protocol error means, in one line."""
    if expired:  # the watchdog shut the socket down
        return HTTPCallError(f"no complete answer within {deadline_s:g} s")
    if isinstance(e, TimeoutError):
        return HTTPCallError(f"no answer within {timeout_s:g} s")
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return HTTPCallError(reason or type(e).__name__)


def request(url: str, body: bytes | None = None, headers: dict[str, str] | None = None, *, timeout_s: float,
            deadline_s: float, max_bytes: int = MAX_RESPONSE_BYTES) -> Response:
    """POST `body` (GET without one) to `url` and return the whole response, within `deadline_s` in
    all; each wait on the socket at most `timeout_s`. A 3xx is an error (never followed); so is a
    body over `max_bytes` (`MAX_ERROR_BYTES` for an error status, whose body is cut, not refused)."""
    conn, target = _connection(url, timeout_s)
    expired = threading.Event()
    sockets: list[socket.socket] = []

    def watchdog() -> None:  # a server that trickles bytes never trips the per-read timeout
        expired.set()
        for sock in sockets:  # the connection's own: a response read to the close has taken it over
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline_s, watchdog)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if conn.sock is not None:
            sockets.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting
            raise HTTPCallError(f"no complete answer within {deadline_s:g} s")
        conn.request("POST" if body is not None else "GET", target, body=body, headers=headers or {})
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise HTTPCallError(f"answered {response.status} (a redirect, not followed)")
        data = _body(response, max_bytes)
        if expired.is_set():  # the watchdog's shutdown reads as the end of the body
            raise HTTPCallError(f"no complete answer within {deadline_s:g} s")
        return Response(response.status, data)
    except HTTPCallError:
        raise
    except (OSError, http.client.HTTPException) as e:
        raise _failure(e, expired.is_set(), timeout_s, deadline_s) from None
    finally:
        timer.cancel()
        conn.close()
