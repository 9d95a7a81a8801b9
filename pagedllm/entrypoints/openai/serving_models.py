"""``GET /v1/models``, the check that a request names a served model or LoRA adapter (404
otherwise), and the adapters loaded and unloaded at run time."""

from __future__ import annotations

import time

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """The names the one loaded model is served under.

    Args:
        served_model_names: one or more names (the first is the default for requests that omit
            ``model`` and the ``model_name`` metrics label).
        root: the model as given on the command line (folder, .gguf file), or the default model's
            file.
        max_model_len: the effective tokens per request.
    Raises:
        ValueError: no names given.
    """

    def __init__(self, served_model_names: list[str], root: str, max_model_len: int,
                 lora_modules: list[tuple[str, str]] = ()) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())
        # [LoRA] adapter name -> its LoRARequest (``--lora-modules``, then load / unload at run time).
        self.lora_requests: dict = {}
        self._next_lora_id = 1
        for name, path in lora_modules:
            self.add_lora(name, path)

    def add_lora(self, name: str, path: str):
        """Serve adapter ``name`` from ``path`` (a fresh ``lora_int_id``); returns its ``LoRARequest``.

        Raises:
            OpenAIError: 400 for a name already served (a model or an adapter) or a bad name / path.
        """
        from pagedllm.lora.request import LoRARequest

        if name in self.served_model_names or name in self.lora_requests:
            raise OpenAIError(400, f"The model or LoRA adapter `{name}` is already served", "invalid_request_error",
                              param="lora_name")
        try:
            lora = LoRARequest(name, self._next_lora_id, path)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", param="lora_name") from None
        self._next_lora_id += 1
        self.lora_requests[name] = lora
        return lora

    def remove_lora(self, name: str):
        """Stop serving adapter ``name``; returns its ``LoRARequest``.

        Raises:
            OpenAIError: 404 for an adapter not served.
        """
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"The LoRA adapter `{name}` does not exist. Served adapters: "
                              f"{list(self.lora_requests)}", "invalid_request_error", param="lora_name",
                              code="model_not_found")
        return lora

    def lora_for(self, name: str | None):
        """The ``LoRARequest`` a resolved model name runs with, or None for the base model."""
        return self.lora_requests.get(name) if name else None

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def resolve(self, name: str | None) -> str:
        """The served name a request asked for (None: the default one).

        Raises:
            OpenAIError: 404 ``model_not_found`` for a name that is not served.
        """
        if name is None or name == "":
            return self.default_name
        if name in self.served_model_names or name in self.lora_requests:
            return name
        raise OpenAIError(404, f"The model `{name}` does not exist. Served models: "
                          f"{self.served_model_names + list(self.lora_requests)}",
                          "invalid_request_error", param="model", code="model_not_found")

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=name, created=self.created, root=self.root, max_model_len=self.max_model_len)
                 for name in self.served_model_names]
        cards += [ModelCard(id=name, created=self.created, root=lora.lora_path, parent=self.default_name,
                            max_model_len=self.max_model_len) for name, lora in self.lora_requests.items()]
        return ModelList(data=cards)
