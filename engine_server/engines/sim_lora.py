"""The simulated engine's runtime LoRA API, as vLLM serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING
(vllm/entrypoints/serve/lora/api_router.py, vllm/entrypoints/openai/models/serving.py): the
same paths, request fields, status codes and error bodies. An adapter "loads" when its folder
holds an adapter_config.json, as a PEFT adapter does; requests may then name it as their model.
"""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


class SimLoras:
    def __init__(self, base_model: str):
        self.base_model = base_model
        self.loaded: dict[str, str] = {}  # name -> path

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/load_lora_adapter", self.load), web.post("/v1/unload_lora_adapter", self.unload)]

    async def _body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return _error(400, "the body must be a JSON object", "BadRequestError")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.base_model:
            return _error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if name in self.loaded and not body.get("load_inplace"):
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.loaded[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = body.get("lora_name") if body is not None else None
        if not name:
            return _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.loaded:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
