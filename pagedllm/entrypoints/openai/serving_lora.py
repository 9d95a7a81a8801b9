"""[LoRA] The server's adapters: ``--lora-modules`` parsing, and vLLM's run-time routes
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (behind
``--enable-runtime-lora-updating``, off by default)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` entries, ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``.

    Raises:
        ValueError: naming ``--lora-modules`` for an entry of neither form.
    """
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                modules.append((str(entry["name"]), str(entry["path"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: JSON entries need \"name\" and \"path\"") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
            modules.append((name, path))
    return modules


def add_lora_routes(app: FastAPI, state) -> None:
    """The load / unload routes on ``app`` (``state``: the ``ServerState``: its ``models`` and ``engine``)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        lora = state.models.add_lora(request.lora_name, request.lora_path)
        try:
            await state.engine.add_lora(lora)
        except ValueError as exc:
            state.models.remove_lora(request.lora_name)
            raise bad_request(str(exc), param="lora_path") from None
        logger.info("LoRA adapter %r served from %s", lora.lora_name, lora.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        lora = state.models.remove_lora(request.lora_name)
        await state.engine.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

