from unison.server.apis.ollama.routes import router as router
