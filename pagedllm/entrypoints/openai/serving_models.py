"""``GET /v1/models`` and the check that a request names a served model (404 otherwise)."""

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

    def __init__(self, served_model_names: list[str], root: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

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
        if name in self.served_model_names:
            return name
        raise OpenAIError(404, f"The model `{name}` does not exist. Served models: {self.served_model_names}",
                          "invalid_request_error", param="model", code="model_not_found")

    def show_available_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=self.created, root=self.root,
                                         max_model_len=self.max_model_len)
                               for name in self.served_model_names])
