"""The HTTP APIs served, one package each, all thin: each translates its bodies into the
pipeline's neutral input (server/pipeline/) and renders the typed output in its own JSON. No API
imports another. Adding one: a package here, and its router in ROUTERS."""

from fastapi import APIRouter

from unison.server.apis import anthropic, llama_server, ollama, openai, sglang

# In this order: a path two APIs share answers as the first one here does.
ROUTERS: list[APIRouter] = [*openai.ROUTERS, anthropic.router, ollama.router, llama_server.router,
                             sglang.router]
