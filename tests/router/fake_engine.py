"""A recording fake of a vLLM engine with the NixlConnector, served over real HTTP.

It speaks the pull-mode contract (docs/flows.md): a request whose `kv_transfer_params`
has `do_remote_decode: true` is a prefill and gets one token plus the params a decode
engine needs; anything else is a decode, answered as JSON or as an SSE stream with the
configured tokens. Every request (path, headers, JSON body) is recorded.

Usage numbers are deliberately different per role so tests can see which one the router
billed: prefill reports PREFILL_PROMPT_TOKENS / PREFILL_CACHED_TOKENS, decode reports
DECODE_PROMPT_TOKENS / DECODE_CACHED_TOKENS and one completion token per streamed token.

Data parallel (`dp_size` > 1): N ranks behind one URL, as vLLM `--data-parallel-size N`
with internal load balancing. A request's `X-data-parallel-rank` header picks its rank
(unless `honour_rank_header` is off), else ranks take turns; each rank has its own NIXL
identity (engine id `<engine_id>_dp<rank>`, side-channel port 5600 + rank), and
`Recorded.rank` says which rank served a request. `vllm_push` makes a prefill answer like
vLLM's NixlPushConnector (its identity, `transfer_mode: "push"`); with a shared `PushBoard`,
a decode leg naming a P identity waits until that P answered the same request id, as a vLLM
D waits for P's WRITE (a leg naming the wrong rank waits in vain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from pdgate.proxy import KVReady, NotifySender

PREFILL_PROMPT_TOKENS = 11
PREFILL_CACHED_TOKENS = 3
DECODE_PROMPT_TOKENS = 99
DECODE_CACHED_TOKENS = 96


@dataclass
class Recorded:
    """One request as the engine received it."""

    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    rank: int | None = None  # the DP rank that served it (None: not data-parallel)
    at: float = field(default_factory=time.monotonic)  # arrival
    delayed_until: float | None = None  # when its `delay_s` was over (a completion)

    @property
    def is_prefill(self) -> bool:
        params = self.body.get("kv_transfer_params")
        return isinstance(params, dict) and params.get("do_remote_decode") is True


# vLLM's routes besides completions that the router passes through to one engine.
VLLM_OTHER_ROUTES = (
    ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"), ("POST", "/v1/score"),
    ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/version"),
)

# What a token-id-listing P reports: the prompt's ids (the client's, when it sent ids) and
# the token it sampled ("P": its id in the tiny model's vocabulary, so the router's check
# that P's text decodes from P's id passes).
FAKE_PROMPT_IDS = (101, 102, 103)
FAKE_FIRST_TOKEN = 52

@dataclass
class PushBoard:
    """Where vLLM push-mode fakes meet: P marks (its rank's engine id, request id) once it
    answered; a D leg naming that identity decodes only after the mark."""

    landed: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)

    def event(self, engine_id: str, request_id: str) -> asyncio.Event:
        return self.landed.setdefault((engine_id, request_id), asyncio.Event())


@dataclass
class FakeEngine:
    """Configurable fake engine. Mutate the knobs between requests as a test needs."""

    engine_id: str = "fake"
    tokens: tuple[str, ...] = ("Hello", " world", "!")
    return_kv_params: bool = True
    fail_status: int | None = None  # answer completions with this status
    fail_message: str | None = None  # ... and this error message
    # As D: answer 500 to a decode carrying KV params, like vLLM when P died before D read
    # the KV (kv_load_failure_policy "fail"); decodes without params still succeed.
    fail_kv_loads: bool = False
    delay_s: float = 0.0  # before answering a completion
    drop_completions: bool = False  # close the connection unanswered (killed mid-request)
    token_delay_s: float = 0.0  # between streamed tokens (none before the first)
    first_token_delay_s: float = 0.0  # after the stream's headers, before its first token
    health_status: int = 200
    requests: list[Recorded] = field(default_factory=list)
    aborted_streams: int = 0
    finished_streams: int = 0
    # Notify/push flows (router/flows_*.py): serve /v1/kv/reserve, /v1/kv/info and
    # /v1/kv/abort like a shim; as P, answer KV-ready "ok" | "failed" | "never" (no notice)
    # and reply with pdgate params unless `push_params` is off (P stopped early).
    kv_endpoints: bool = True
    kv_ready: str = "ok"
    kv_write_fails_to: str | None = None  # a 'failed' notice for writes into this engine id
    kv_ready_delay_s: float = 0.0  # the notice trails P's reply by this much
    reply_after_notice_s: float = 0.0  # as P: the reply trails the notice by this much
    push_params: bool = True
    first_token_ids: list[int] | None = None  # as P: put in the reply's pdgate params
    # As P: answer `return_token_ids` as vLLM does (the pull flow's early first token).
    token_ids: bool = False
    # As D: a push leg asked to continue after P's token answers with one SSE error event
    # (the shim's answer when the push did not land).
    fail_continuations: bool = False
    # Faults of a broken engine: answer with this reply/event `id` (default: vLLM's
    # `cmpl-<X-Request-Id>`), list these prompt ids, give P's token this text, name this
    # request id in P's kv_transfer_params.
    answer_id: str | None = None
    listed_prompt_ids: list[int] | None = None
    first_token_text: str = "P"
    kv_request_id: str | None = None
    reserves: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    # (path, Authorization header or None) of every request, health probes included.
    auth_seen: list[tuple[str, str | None]] = field(default_factory=list)
    # Data parallel: ranks behind this URL; whether the rank header is obeyed; ranks that
    # answer 503 (a broken rank in a healthy process); as P, vLLM push-connector answers.
    dp_size: int = 1
    honour_rank_header: bool = True
    failing_ranks: set[int] = field(default_factory=set)
    vllm_push: bool = False
    push_board: PushBoard | None = None
    push_wait_s: float = 10.0  # as D: how long a push leg waits for P's mark (then 500)
    serve_metrics: bool = False  # GET /metrics as vLLM's: one `engine` label per DP rank
    # With serve_metrics: each rank's (waiting, running, KV usage) as vLLM's gauges say
    # them (ranks not listed: all 0); the test changes them while the engine runs.
    load: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    metrics_reads: int = 0  # GET /metrics served
    _next_rank: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _sender: NotifySender | None = None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the engine stops (so teardown never waits)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    @property
    def prefills(self) -> list[Recorded]:
        return [r for r in self.requests if r.is_prefill]

    @property
    def decodes(self) -> list[Recorded]:
        return [r for r in self.requests if not r.is_prefill]

    async def start(self) -> str:
        self._stopping.clear()
        app = web.Application(middlewares=[self._record_auth])
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", self._health)
        if self.serve_metrics:
            app.router.add_get("/metrics", self._metrics)
        for method, path in VLLM_OTHER_ROUTES:
            app.router.add_route(method, path, self._other)
        if self.kv_endpoints:
            app.router.add_post("/v1/kv/reserve", self._reserve)
            app.router.add_post("/v1/kv/info", self._info)
            app.router.add_post("/v1/kv/abort", self._abort)
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def add_routes(self, app: web.Application) -> None:
        """More routes of a subclass (tests/router/fake_lora_engine.py: vLLM's LoRA API)."""

    async def stop(self) -> None:
        self._stopping.set()
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _other(self, request: web.Request) -> web.StreamResponse:
        """vLLM's other routes (embeddings, tokenize, ...): recorded, answered with what
        was asked (as SSE when `stream`); `fail_status` applies."""
        body = await request.json() if request.can_read_body else {}
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body,
                                      self._rank_of(request)))
        if self.fail_status:
            err = {"error": {"message": self.fail_message or "fake failure", "type": "X",
                             "code": self.fail_status}}
            return web.json_response(err, status=self.fail_status)
        answer = {"object": "fake", "path": request.path, "engine": self.engine_id,
                  "model": body.get("model")}
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in ("a", "b"):
            await _send(resp, {**answer, "part": part})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _reserve(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.reserves.append(body)
        return web.json_response({
            **self.info(), "reservation_id": f"{body['request_id']}@1",
            "block_ids": list(range(7, 7 + -(-body["num_tokens"] // 4))),
            "num_tokens": body["num_tokens"]})

    def info(self) -> dict[str, Any]:
        info = {"engine_id": self.engine_id, "agent_name": f"{self.engine_id}-agent",
                "host": "127.0.0.1", "port": 5700, "block_size": 4, "num_blocks": 64}
        if self.first_token_ids is not None:
            info["landed_tokens"] = True  # as a shim: its landed notices name the token
        return info

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info())

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body["request_id"])
        return web.json_response(body)

    def _push(self, rec: Recorded) -> dict[str, Any] | None:
        """As P in notify/push mode: send the KV-ready notice; the reply's params."""
        params = rec.body["kv_transfer_params"]
        mode = params.get("pdgate_mode")
        if mode is None or not self.push_params:
            return None
        endpoint = params.get("notify_endpoint")
        if endpoint and self.kv_ready != "never":
            ok = self.kv_ready == "ok" and \
                params.get("remote_engine_id") != self.kv_write_fails_to
            notice = KVReady(
                request_id=params["notify_request_id"], engine_id=self.engine_id,
                token=params.get("notify_token", ""), status="ok" if ok else "failed",
                error=None if ok else "fake write failure")
            if self.kv_ready_delay_s:
                asyncio.get_running_loop().call_later(
                    self.kv_ready_delay_s, self._notify, endpoint, notice)
            else:
                self._notify(endpoint, notice)
        reply: dict[str, Any] = {"pdgate_mode": mode, "remote_engine_id": self.engine_id}
        if self.first_token_ids is not None:
            reply["first_token_ids"] = self.first_token_ids
        return reply

    def _notify(self, endpoint: str, notice: KVReady) -> None:
        if self._sender is None:
            self._sender = NotifySender()
        self._sender.send(endpoint, notice)

    @web.middleware
    async def _record_auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.auth_seen.append((request.path, request.headers.get("Authorization")))
        return await handler(request)  # type: ignore[no-any-return]

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        lines = []
        for i, name in enumerate(("vllm:num_requests_waiting", "vllm:num_requests_running",
                                  "vllm:kv_cache_usage_perc")):
            lines.append(f"# TYPE {name} gauge")
            lines += [f'{name}{{model_name="tiny",engine="{r}"}} '
                      f'{self.load.get(r, (0.0, 0.0, 0.0))[i]}' for r in range(self.dp_size)]
        return web.Response(text="\n".join(lines) + "\n")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health_status)

    def _rank_of(self, request: web.Request) -> int | None:
        """The DP rank that runs `request`: its header's, else the next in turn."""
        if self.dp_size == 1:
            return None
        asked = request.headers.get("X-data-parallel-rank", "")
        if self.honour_rank_header and asked.isdigit() and int(asked) < self.dp_size:
            return int(asked)
        rank, self._next_rank = self._next_rank, (self._next_rank + 1) % self.dp_size
        return rank

    def rank_engine_id(self, rank: int | None) -> str:
        """The NIXL engine id of `rank` (vLLM appends `_dp<rank>` under data parallel)."""
        return self.engine_id if rank is None else f"{self.engine_id}_dp{rank}"

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rec = Recorded(request.path, CIMultiDict(request.headers), body,
                       self._rank_of(request))
        self.requests.append(rec)
        if self.delay_s:
            await self._pause(self.delay_s)
        rec.delayed_until = time.monotonic()
        if self.drop_completions and request.transport is not None:
            request.transport.abort()
            return web.Response()  # never written: the connection is gone
        status = self.fail_status or (503 if rec.rank in self.failing_ranks else None)
        if status is not None:
            err = {"error": {"message": self.fail_message or f"fake failure {status}",
                             "type": "X", "code": status}}
            return web.json_response(err, status=status)
        if not rec.is_prefill and not await self._pushed_to(rec):
            err = {"error": {"message": "pushed KV never landed", "type": "X", "code": 500}}
            return web.json_response(err, status=500)
        if self.fail_kv_loads and not rec.is_prefill and "kv_transfer_params" in body:
            err = {"error": {"message": "KV load failed", "type": "X", "code": 500}}
            return web.json_response(err, status=500)
        chat = request.path.endswith("/chat/completions")
        if rec.is_prefill:
            reply = self._prefill_reply(rec, chat)
            if self.reply_after_notice_s:
                await self._pause(self.reply_after_notice_s)
            return web.json_response(reply)
        kv = body.get("kv_transfer_params") or {}
        if body.get("stream") and self.fail_continuations and kv.get("continue_after_prefill"):
            err = {"error": {"message": "no token from the prefill engine", "type": "X",
                             "code": 502}}
            return web.Response(body=b"data: " + json.dumps(err).encode() + b"\n\n",
                                content_type="text/event-stream")
        if body.get("stream"):
            return await self._stream(request, rec, chat)
        return web.json_response(self._decode_reply(rec, chat))

    def answer_id_of(self, rec: Recorded, chat: bool) -> str:
        """The `id` this engine answers `rec` with: vLLM's `cmpl-<X-Request-Id>`."""
        if self.answer_id is not None:
            return self.answer_id
        return f"{'chatcmpl' if chat else 'cmpl'}-{rec.headers.get('X-Request-Id', 'fake')}"

    def _prefill_reply(self, rec: Recorded, chat: bool) -> dict[str, Any]:
        reply = _reply(chat, self.first_token_text, rec.body.get("n") or 1)
        reply["id"] = self.answer_id_of(rec, chat)
        reply["usage"] = {
            "prompt_tokens": PREFILL_PROMPT_TOKENS,
            "completion_tokens": 1,
            "total_tokens": PREFILL_PROMPT_TOKENS + 1,
            "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED_TOKENS},
        }
        if self.token_ids and rec.body.get("return_token_ids") and not chat:
            prompt = rec.body.get("prompt")
            listed = self.listed_prompt_ids or (
                prompt if isinstance(prompt, list) else list(FAKE_PROMPT_IDS))
            reply["choices"][0].update(prompt_token_ids=listed, token_ids=[FAKE_FIRST_TOKEN])
        if rec.body["kv_transfer_params"].get("pdgate_mode"):
            reply["kv_transfer_params"] = self._push(rec)
        elif self.vllm_push:
            reply["kv_transfer_params"] = self.push_identity(rec)
        else:
            reply["kv_transfer_params"] = self.kv_params(rec) if self.return_kv_params else None
        return reply

    def kv_params(self, rec: Recorded) -> dict[str, Any]:
        """What this engine, as P, tells D (the vLLM NixlConnector shape)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.rank_engine_id(rec.rank),
            "remote_request_id": self.kv_request_id or rec.headers.get("X-Request-Id"),
            "remote_block_ids": [4],  # one block holds the three prompt tokens
            "remote_host": "127.0.0.1",
            "remote_port": 5601 + (rec.rank or 0),
            "tp_size": 1,
        }

    async def _pushed_to(self, rec: Recorded) -> bool:
        """As D with a push board: wait for the P that `rec` names to have answered."""
        kv = rec.body.get("kv_transfer_params") or {}
        if self.push_board is None or not kv.get("do_remote_prefill"):
            return True
        landed = self.push_board.event(str(kv.get("remote_engine_id")), _rid(rec))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(landed.wait(), self.push_wait_s)
        return landed.is_set()

    def push_identity(self, rec: Recorded) -> dict[str, Any]:
        """As a vLLM NixlPushConnector P: the identity of the rank that served `rec`
        (marked on the push board: the push lands on a D leg naming it)."""
        if self.push_board is not None:
            self.push_board.event(self.rank_engine_id(rec.rank), _rid(rec)).set()
        return {
            "transfer_mode": "push", "remote_engine_id": self.rank_engine_id(rec.rank),
            "remote_host": "127.0.0.1", "remote_port": 5600 + (rec.rank or 0),
            "tp_size": 1, "pp_size": 1,
            "remote_request_id": f"cmpl-{rec.headers.get('X-Request-Id')}-0",
        }

    def _decode_reply(self, rec: Recorded, chat: bool) -> dict[str, Any]:
        reply = _reply(chat, "".join(self.tokens), rec.body.get("n") or 1)
        reply["id"] = self.answer_id_of(rec, chat)
        reply["usage"] = _decode_usage(len(self.tokens))
        return reply

    async def _stream(self, request: web.Request, rec: Recorded, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        opts = rec.body.get("stream_options") or {}
        rid = self.answer_id_of(rec, chat)
        try:
            for i, tok in enumerate(self.tokens):
                if i and self.token_delay_s:
                    await self._pause(self.token_delay_s)
                elif not i and self.first_token_delay_s:
                    await self._pause(self.first_token_delay_s)
                await _send(resp, {**_chunk(chat, tok), "id": rid})
            if opts.get("include_usage"):
                final = {**_chunk(chat, None), "id": rid}
                final["usage"] = _decode_usage(len(self.tokens))
                await _send(resp, final)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            self.aborted_streams += 1
            return resp
        except asyncio.CancelledError:  # aiohttp cancels the handler when the peer leaves
            self.aborted_streams += 1
            raise
        self.finished_streams += 1
        await resp.write_eof()
        return resp


def _rid(rec: Recorded) -> str:
    return str(rec.headers.get("X-Request-Id"))


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _decode_usage(completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": DECODE_PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": DECODE_PROMPT_TOKENS + completion,
        "prompt_tokens_details": {"cached_tokens": DECODE_CACHED_TOKENS},
    }


def _reply(chat: bool, text: str, n: int) -> dict[str, Any]:
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": text},
                    "finish_reason": "length"} for i in range(n)]
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1,
                "model": "tiny", "choices": choices}
    choices = [{"index": i, "text": text, "finish_reason": "length", "logprobs": None}
               for i in range(n)]
    return {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": choices}


def _chunk(chat: bool, token: str | None) -> dict[str, Any]:
    if chat:
        choices = [] if token is None else [
            {"index": 0, "delta": {"content": token}, "finish_reason": None}]
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                "model": "tiny", "choices": choices}
    choices = [] if token is None else [{"index": 0, "text": token, "finish_reason": None}]
    return {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": choices}
