"""A fake vLLM engine with LoRA adapters (`--enable-lora`), on top of `FakeEngine`.

What real vLLM 0.32 does, for the edge cases it will not produce on demand:
- `GET /v1/models` lists the base model and each loaded adapter with `parent` (the base
  model) and `root` (its load path);
- `POST /v1/load_lora_adapter {lora_name, lora_path}` loads one (200 `Success: ...`; 400
  when it is already loaded; here also `load_fail_status` and `load_delay_s`);
- a completion naming a model it does not serve is a 404 (`The model `x` does not
  exist.`), so a leg for an adapter the engine lacks can never be served by the base model.

Answers say who computed them: the text starts with `<MODEL>` (the adapter's name, or the
base model's), so a test sees base-model output at once. `served` lists (model, is_prefill)
of every completion answered 2xx.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from tests.router.fake_engine import FakeEngine, Recorded, _chunk, _send

BASE = "tiny"


@dataclass
class FakeLoraEngine(FakeEngine):
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path (loaded)
    load_fail_status: int | None = None  # answer loads with this status
    load_delay_s: float = 0.0
    loads: list[dict[str, Any]] = field(default_factory=list)  # every load request body
    served: list[tuple[str, bool]] = field(default_factory=list)
    models_status: int = 200  # GET /v1/models answers this (non-200: an error body)
    base: str = BASE  # the base model's name (vLLM --served-model-name)
    max_model_len: int = 2048  # what /v1/models reports (vLLM --max-model-len)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.models_status)
        data: list[dict[str, Any]] = [{"id": self.base, "object": "model", "root": "/m/base",
                                       "parent": None,
                                       "max_model_len": self.max_model_len}]
        data += [{"id": name, "object": "model", "root": path, "parent": self.base}
                 for name, path in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.loads.append(body)
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        if self.load_fail_status is not None:
            return web.json_response(
                {"error": {"message": "Loading lora failed: no adapter_config.json",
                           "type": "NotFoundError", "code": self.load_fail_status}},
                status=self.load_fail_status)
        name = body["lora_name"]
        if name in self.adapters:
            return web.json_response(
                {"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                           "type": "InvalidUserInput", "code": 400}}, status=400)
        self.adapters[name] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body.get("model")
        if model not in (self.base, None) and model not in self.adapters:
            self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body))
            return web.json_response(
                {"error": {"message": f"The model `{model}` does not exist.",
                           "type": "NotFoundError", "param": "model", "code": 404}},
                status=404)
        resp = await super()._completion(request)  # aiohttp keeps the body read once
        if resp.status < 300:
            self.served.append((model or self.base, self.requests[-1].is_prefill))
        return resp

    def _decode_reply(self, rec: Recorded, chat: bool) -> dict[str, Any]:
        reply = super()._decode_reply(rec, chat)
        tag = f"<{rec.body.get('model') or self.base}>"
        for choice in reply["choices"]:
            if chat:
                choice["message"]["content"] = tag + choice["message"]["content"]
            else:
                choice["text"] = tag + choice["text"]
        return reply

    async def _stream(self, request: web.Request, rec: Recorded,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = self.answer_id_of(rec, chat)
        for tok in (f"<{rec.body.get('model') or self.base}>", *self.tokens):
            await _send(resp, {**_chunk(chat, tok), "id": rid})
        await resp.write(b"data: [DONE]\n\n")
        self.finished_streams += 1
        await resp.write_eof()
        return resp
