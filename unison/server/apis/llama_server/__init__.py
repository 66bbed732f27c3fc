from unison.server.apis.llama_server.routes import router as router
