from unison.server.apis.anthropic.routes import router as router
