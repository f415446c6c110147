"""The engine adapter: vLLM's HTTP API and NIXL `kv_transfer_params` contract, over aiohttp.

This is the only module that knows vLLM field names (`kv_transfer_params`, `min_tokens`, …)
and the only one that sees aiohttp. Every aiohttp/asyncio failure is translated here into
the `router.errors` tree, with the engine URL in the message:

    connect refused / DNS / no route       -> EngineUnavailable (connect_failed=True)
    connection reset / server disconnected -> EngineUnavailable
    deadline passed                        -> EngineTimeout
    5xx, or a reply that is not JSON       -> EngineError
    4xx                                    -> EngineRejected (engine's status and message)

aiohttp rather than httpx: httpx's pool scans every pooled connection on each request and
collapses under concurrency. aiohttp's client sets TCP_NODELAY on every connection it makes
(`BaseProtocol.connection_made`), so small SSE writes are not held back by Nagle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from router.config import RouterConfig
from router.errors import (
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    RouterError,
)

__all__ = [
    "EngineClient",
    "EngineStream",
    "PrefillUsage",
    "decode_body",
    "extract_kv_params",
    "prefill_body",
    "prefill_usage",
    "rewrite_usage",
]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_SSE_ERROR = b'data: {"error"'

# What the router asks of P in pull mode (vLLM NixlConnector, design.md §2). Built fresh per
# request by `prefill_body` so no request can mutate a shared dict.
_PREFILL_KV_REQUEST: tuple[tuple[str, Any], ...] = (
    ("do_remote_decode", True),
    ("do_remote_prefill", False),
    ("remote_engine_id", None),
    ("remote_block_ids", None),
    ("remote_host", None),
    ("remote_port", None),
)
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg's JSON: the client body, non-streaming, one token, asking P to keep
    the KV for a remote decode. `body` is not modified."""
    b = dict(body)
    for key in _PREFILL_DROP:
        b.pop(key, None)
    b["kv_transfer_params"] = dict(_PREFILL_KV_REQUEST)
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    return _json_encode(b)


def decode_body(body: dict[str, Any], kv_params: Any | None) -> bytes:
    """The decode leg's JSON: the original body plus P's `kv_transfer_params`, passed as an
    opaque blob. With `kv_params=None` (fallback) any client-sent params are removed so D
    computes the prompt itself. Mutates `body` (the caller's per-request copy)."""
    if kv_params is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = kv_params
    return _json_encode(body)


def extract_kv_params(reply: Mapping[str, Any]) -> Any | None:
    """P's `kv_transfer_params`, or None when P sent none (then decode must recompute)."""
    params = reply.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None


@dataclass(frozen=True, slots=True)
class PrefillUsage:
    """The prompt side of billing, as P counted it."""

    prompt_tokens: int
    prompt_tokens_details: Any | None


def prefill_usage(reply: Mapping[str, Any]) -> PrefillUsage | None:
    """Usage from P's reply, or None when P reported none."""
    usage = reply.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return None
    return PrefillUsage(usage["prompt_tokens"], usage.get("prompt_tokens_details"))


def rewrite_usage(usage: dict[str, Any], prefill: PrefillUsage) -> None:
    """Make a decode usage object bill right: prompt side from P, completion from D."""
    usage["prompt_tokens"] = prefill.prompt_tokens
    usage["prompt_tokens_details"] = prefill.prompt_tokens_details
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    usage["total_tokens"] = prefill.prompt_tokens + completion


def _engine_message(raw: bytes) -> str:
    """Best-effort error text from an engine reply (vLLM or FastAPI shapes)."""
    try:
        obj = _json_decode(raw)
    except msgspec.DecodeError:
        return raw[:200].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for key in ("message", "detail"):
            if isinstance(obj.get(key), str):
                return str(obj[key])
    return raw[:200].decode("utf-8", "replace")


def _check_status(url: str, status: int, raw: bytes) -> None:
    if status < 300:
        return
    if status < 400:  # redirects are never followed: an engine URL is used as configured
        raise EngineError(f"engine {url} answered HTTP {status} (redirects are not followed)")
    message = _engine_message(raw)
    if status >= 500:
        raise EngineError(f"engine {url} returned HTTP {status}: {message}")
    raise EngineRejected(message, status=status)


@contextlib.contextmanager
def _translate(url: str, what: str) -> Iterator[None]:
    """Map aiohttp/asyncio exceptions raised in the block to `RouterError`s."""
    try:
        yield
    except RouterError:
        raise
    except TimeoutError:  # asyncio.timeout and aiohttp.ServerTimeoutError both land here
        raise EngineTimeout(f"engine {url} timed out ({what})") from None
    except aiohttp.ClientConnectorError as exc:
        msg = f"cannot connect to engine {url}: {exc.os_error}"
        raise EngineUnavailable(msg, connect_failed=True) from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise EngineUnavailable(f"engine {url} dropped the connection: {exc!r}") from None
    except aiohttp.ClientError as exc:
        raise EngineError(f"engine {url} request failed: {exc!r}") from None


class EngineStream:
    """An open streaming response from an engine (status already checked as 2xx).

    Iterate `chunks()` for the body as it arrives; always call `close()` (idempotent). A
    stream read to the end returns its connection to the pool; one closed early drops it.
    """

    def __init__(self, url: str, resp: aiohttp.ClientResponse, idle_timeout_s: float) -> None:
        self._url = url
        self._resp = resp
        self._idle = idle_timeout_s
        self._done = False
        self._first = b""  # read by `check_start`, handed out first by `chunks`

    async def check_start(self, timeout_s: float) -> None:
        """Read the first chunk (within `timeout_s`) and raise `EngineError` if it is an SSE
        error event. vLLM answers a stream it cannot even start (e.g. a decode engine given
        KV params it cannot use) with HTTP 200 and one error event; checking here keeps that
        failure retryable and lets the client get a 502 instead of a 200 with an error
        inside. On any exception the stream is closed."""
        try:
            with _translate(self._url, "decode first byte"):
                async with asyncio.timeout(timeout_s):
                    self._first = await self._resp.content.readany()
            if self._first.startswith(_SSE_ERROR):
                event = self._first[len(b"data: "):].split(b"\n", 1)[0]
                raise EngineError(f"engine {self._url} failed the stream: "
                                  f"{_engine_message(event)}")
        except BaseException:
            self.close()
            raise
        self._done = not self._first

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as received; each wait is bounded by the idle timeout."""
        if self._first:
            first, self._first = self._first, b""
            yield first
        content = self._resp.content
        while not self._done:
            with _translate(self._url, "stream idle"):
                async with asyncio.timeout(self._idle):
                    chunk = await content.readany()
            if not chunk:
                self._done = True
                return
            yield chunk

    def close(self) -> None:
        """Release the upstream connection (to the pool if fully read, else closed)."""
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


class EngineClient:
    """HTTP client for engine legs: one pooled aiohttp session per router app.

    Deadlines (seconds, from `RouterConfig`): connect; prefill total; decode first byte
    (response headers); decode idle (gap between body chunks).
    """

    def __init__(self, session: aiohttp.ClientSession, config: RouterConfig) -> None:
        self._session = session
        self._cfg = config
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout_s, sock_connect=config.connect_timeout_s
        )
        # Non-streaming decode: the engine answers only when generation is done, so one
        # read deadline (first byte) bounds both the header wait and the body read.
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s,
            sock_read=config.decode_first_byte_timeout_s,
        )
        # Streaming decode: asyncio.timeout around each wait instead, because sock_read
        # would apply one value to both the first-byte wait and the inter-chunk gaps.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s
        )
        self._health_timeout = aiohttp.ClientTimeout(total=config.health_timeout_s)

    @property
    def first_byte_timeout_s(self) -> float:
        """Seconds a decode engine may take to send its first byte (see `check_start`)."""
        return self._cfg.decode_first_byte_timeout_s

    @classmethod
    def create(cls, config: RouterConfig) -> EngineClient:
        """Build the pooled session; must run on the event loop that will use it."""
        connector = aiohttp.TCPConnector(
            limit=config.max_connections,
            limit_per_host=0,
            # Below uvicorn's (and so vLLM's) 5 s keep-alive, so we drop idle connections
            # before the engine does and never send on a half-closed one.
            keepalive_timeout=config.engine_keepalive_s,
            ttl_dns_cache=300,
        )
        # The engine key rides on every call (legs, health probes, KV aborts, reservations).
        auth = {"Authorization": f"Bearer {config.engine_api_key}"} \
            if config.engine_api_key else None
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers=auth,
        )
        return cls(session, config)

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._session.close()

    async def post_json(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """POST a non-streaming prefill request; return the decoded JSON object."""
        with _translate(url, "prefill"):
            async with self._session.post(
                url + path, data=body, headers=headers, timeout=self._prefill_timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        _check_status(url, status, raw)
        try:
            obj = _json_decode(raw)
        except msgspec.DecodeError:
            raise EngineError(f"engine {url} returned invalid JSON") from None
        if not isinstance(obj, dict):
            raise EngineError(f"engine {url} returned JSON that is not an object")
        return obj

    async def post_raw(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> bytes:
        """POST a non-streaming decode request; return the 2xx body bytes."""
        with _translate(url, "decode"):
            async with self._session.post(
                url + path, data=body, headers=headers, timeout=self._decode_timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        _check_status(url, status, raw)
        return raw

    async def open_stream(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> EngineStream:
        """POST a streaming decode request and wait for a 2xx status line.

        Non-2xx replies are read, closed and raised; the caller owns the returned stream.
        """
        with _translate(url, "decode first byte"):
            async with asyncio.timeout(self._cfg.decode_first_byte_timeout_s):
                resp = await self._session.post(
                    url + path, data=body, headers=headers, timeout=self._stream_timeout,
                    allow_redirects=False,
                )
            if resp.status >= 300:
                try:
                    async with asyncio.timeout(self._cfg.decode_idle_timeout_s):
                        raw = await resp.read()
                finally:
                    resp.release()
                _check_status(url, resp.status, raw)
        return EngineStream(url, resp, self._cfg.decode_idle_timeout_s)

    async def abort_kv(self, url: str, request_id: str, timeout_s: float) -> str:
        """Best effort: ask prefill engine `url` to free the KV blocks it pinned for
        `request_id` (`POST /v1/kv/abort`, served by engine_shim). Never raises; returns
        "ok", "unsupported" (404/405: e.g. vLLM has no such route) or "failed"."""
        body = _json_encode({"request_id": request_id})
        try:
            async with self._session.post(
                url + "/v1/kv/abort", data=body, allow_redirects=False,
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError):
            return "failed"
        if 200 <= status < 300:
            return "ok"
        return "unsupported" if status in (404, 405) else "failed"

    async def health(self, url: str) -> bool:
        """True when `GET {url}/health` answers 2xx within the health timeout."""
        try:
            async with self._session.get(
                url + "/health", timeout=self._health_timeout, allow_redirects=False
            ) as r:
                await r.read()
                return 200 <= r.status < 300
        except (aiohttp.ClientError, TimeoutError):
            return False
