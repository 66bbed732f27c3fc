"""llama.cpp's names for the sampling options, shared by the llama-server and Ollama APIs (Ollama
runs llama.cpp): not an API of its own."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from unison.json_types import JSONObject

# The sampling fields as llama.cpp names them, in llama-server's /completion and in Ollama's
# options alike (Ollama runs llama.cpp), and the chat's or completion's field each sets.
LLAMA_CPP_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                      "typical_p": "typical_p", "repeat_penalty": "repetition_penalty",
                      "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                      "stop": "stop"}

class LlamaCppSampling(BaseModel):
    """LLAMA_CPP_SAMPLING's fields."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None

    def given(self, names: dict[str, str]) -> JSONObject:
        """The fields set, as the chat's or completion's (`names`: ours -> theirs)."""
        return {chat: v for name, chat in names.items() if (v := getattr(self, name)) is not None}
