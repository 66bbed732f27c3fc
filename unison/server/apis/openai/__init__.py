from unison.server.apis.openai import pooling, responses, routes

# /v1/completions, /v1/chat/completions, /v1/models and vLLM's beside them; the pooling routes;
# the Responses API.
ROUTERS = [routes.router, pooling.router, responses.router]
