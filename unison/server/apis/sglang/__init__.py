from unison.server.apis.sglang.routes import router as router
