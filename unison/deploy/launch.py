"""`unison serve`: the launcher owns the core and its registry; N uvicorn workers are the frontends.

The launcher has no frontend of its own: with N = 1 uvicorn runs the app in this process, with
N > 1 in N worker processes sharing the port; either way each attaches through the registry (one
code path). Ready means the core lists N attached frontends. Several models: the launcher owns a
model pool instead (model_pool.py), which starts each model's core when a worker first asks for
it; ready means the workers answer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from unison.api.core_process import CoreProcess
from unison.config import EngineConfig
from unison.deploy.model_pool import ModelPool, ModelSource
from unison.server.app import ENV, create_app
from unison.server.models_app import create_models_app
from unison.server.settings import ServeSettings, WorkerSettings
from unison.wire import registry
from unison.wire.messages import ServerInfo

log = logging.getLogger("unison.server")


# The request the ready line suggests, by what the model serves.
TRY_ME = {
    "generate": ("/v1/completions",
                 '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'),
    "embed": ("/v1/embeddings", '{"input": ["The capital of France is Paris."]}'),
    "rerank": ("/v1/rerank",
               '{"query": "capital of France", "documents": ["Paris is the capital.", "Cats purr."]}'),
}

def serve(config: EngineConfig, settings: ServeSettings) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if settings.data_parallel:
        return _serve_data_parallel(config, settings)
    workers = config.tokenizer_worker_num
    # The core admits the HTTP workers and `extra_frontends` Engines attached from elsewhere.
    core = CoreProcess(dataclasses.replace(config, tokenizer_worker_num=workers + settings.extra_frontends),
                       publish=True)
    failure: list[str] = []  # why the server stopped on its own, when it did
    stopping = threading.Event()
    try:
        core.wait_published(config.startup_timeout)
        assert core.registry_path is not None  # published: CoreProcess(publish=True)
        if config.listen:
            info = registry.read(core.registry_path).info
            log.warning("remote frontends attach at %s with server_key %s", info.tcp_address, info.server_key)
        to_workers = WorkerSettings(settings, _model_name(settings, config), str(core.registry_path),
                                    os.getpid())
        threading.Thread(target=_announce_when_ready, daemon=True, name="unison-ready",
                         args=(settings, workers, config.startup_timeout, core.proc.poll, failure)).start()
        threading.Thread(target=_stop_when_core_exits, daemon=True, name="unison-core-watch",
                         args=(core, stopping, failure)).start()
        _run_uvicorn(to_workers, workers, config.log_level)
    finally:
        stopping.set()
        core.stop()
    if failure:
        log.error("the server stopped: %s", failure[0])
        return 1
    return 0 if core.proc.returncode in (0, -signal.SIGTERM) else 1


def serve_models(config: EngineConfig, settings: ServeSettings, sources: list[ModelSource]) -> int:
    """Several models: the launcher's pool starts each one's core when first asked for."""
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    names = [s.name for s in sources]
    if unknown := [n for n in settings.preload if n not in names]:
        raise ValueError(f"--preload {unknown}: not among the models {names}")
    workers = config.tokenizer_worker_num
    pool = ModelPool(config, sources, frontends=workers + settings.extra_frontends,
                     models_max=settings.models_max, idle_unload_s=settings.idle_unload_s,
                     load_timeout=settings.model_load_timeout)
    failure: list[str] = []
    signal.signal(signal.SIGTERM, _exit)  # while preloading: stop the pool's cores on the way out
    try:
        for name in settings.preload:
            try:
                pool.load_now(name)
            except RuntimeError as e:
                raise ValueError(f"--preload: {e}") from None
        to_workers = WorkerSettings(settings, "", "", os.getpid(), pool_endpoint=pool.endpoint,
                                    models=tuple(names))
        threading.Thread(target=_announce_models, daemon=True, name="unison-ready",
                         args=(settings, names, config.startup_timeout, failure)).start()
        _run_uvicorn(to_workers, workers, config.log_level)
    finally:
        pool.close()
    if failure:
        log.error("the server stopped: %s", failure[0])
        return 1
    return 0


def _serve_data_parallel(config: EngineConfig, settings: ServeSettings) -> int:
    """N cores in Ray actors; the same HTTP workers, each attached to every core over TCP."""
    from unison.deploy.data_parallel import RayReplicas

    if settings.routing == "kv" and config.kv_events_config is not None and config.kv_events is None:
        raise ValueError("--routing kv reads the replicas' KV events: leave --kv-events-config out "
                         "(each replica then publishes on a free port) or enable it")
    workers, size = config.tokenizer_worker_num, settings.data_parallel_size
    runtime = tempfile.mkdtemp(prefix=f"unison-{os.getpid()}-")  # 0700: the replicas file holds a key
    failure: list[str] = []
    cores = None
    try:
        # Each core takes every HTTP worker as a frontend, and one more (a worker re-attaching).
        cores = RayReplicas(dataclasses.replace(config, tokenizer_worker_num=workers + 1), size,
                            settings.ray_address, Path(runtime) / "replicas.json")
        log.warning("%d replicas: %s", size, ", ".join(
            f"core pid {w.core_pid} on {w.host} at {w.address}" for w in cores.where if w is not None))
        to_workers = WorkerSettings(settings, _model_name(settings, config), "", os.getpid(),
                                    replicas_path=str(cores.path))
        threading.Thread(target=_announce_when_ready, daemon=True, name="unison-ready",
                         args=(settings, workers * size, config.startup_timeout,
                               lambda: None, failure)).start()
        _run_uvicorn(to_workers, workers, config.log_level)
    finally:
        if cores is not None:
            cores.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    if failure:
        log.error("the server stopped: %s", failure[0])
        return 1
    return 0


def _run_uvicorn(settings: WorkerSettings, workers: int, log_level: str) -> None:
    os.environ[ENV] = settings.to_json()
    # With one worker uvicorn runs here and, once shut down, re-raises the SIGTERM it caught
    # under the handler it found: the default one would kill the launcher before it stops
    # the core and reports. The signal is handled by then.
    signal.signal(signal.SIGTERM, lambda *_: None)
    factory: Callable[[WorkerSettings], ASGIApp] = create_models_app if settings.pool_endpoint else create_app
    app: ASGIApp | str = factory(settings) if workers == 1 else f"{factory.__module__}:{factory.__name__}"
    uvicorn.run(app, host=settings.serve.host, port=settings.serve.port,
                workers=None if workers == 1 else workers,
                factory=workers > 1, log_level=log_level, timeout_graceful_shutdown=5)


def _model_name(settings: ServeSettings, config: EngineConfig) -> str:
    if settings.served_model_name is not None:
        return settings.served_model_name
    if config.model_repo is not None:  # the Hugging Face id as the user gave it
        return config.model_repo
    if config.model_path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(config.model_path))


def _exit(*_: object) -> None:
    raise SystemExit(0)


def _announce_models(settings: ServeSettings, names: list[str], timeout: float, failure: list[str]) -> None:
    """Log the URL once the workers answer (each model loads on its first request)."""
    url = f"http://{settings.host}:{settings.port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                log.warning("Unison ready at %s with models %s (each loads on its first request).\n  curl "
                            "%s/v1/models", url, names, url)
                return
        except OSError:
            time.sleep(0.2)
    failure.append(f"the server did not get ready: its workers did not answer within {timeout:.0f} s")
    log.error("%s", failure[0])
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_when_core_exits(core: CoreProcess, stopping: threading.Event, failure: list[str]) -> None:
    """The core died (killed, crashed): nothing can be served. Say why and stop the workers."""
    code = core.proc.wait()
    if stopping.is_set():
        return  # the launcher stopped it
    how = (f"killed by {signal.Signals(-code).name}" if code < 0
           else f"exit code {code}; see its log above")
    failure.append(f"the engine core (pid {core.pid}) exited ({how})")
    log.error("%s; stopping the server", failure[0])
    os.kill(os.getpid(), signal.SIGTERM)


def _announce_when_ready(settings: ServeSettings, workers: int, timeout: float,
                         exited: Callable[[], int | None], failure: list[str]) -> None:
    """Log the URL (the page's, and a curl line) once every worker has attached; stop the launch if
    that does not happen."""
    url, api_key, ui = f"http://{settings.host}:{settings.port}", settings.api_key, not settings.disable_ui
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and exited() is None:
        try:
            req = urllib.request.Request(f"{url}/get_server_info", headers=headers)
            with urllib.request.urlopen(req, timeout=2) as r:
                info = ServerInfo.from_dict(json.load(r))
                if len(info.frontends) >= workers:
                    auth = " -H \"Authorization: Bearer $API_KEY\"" if api_key else ""
                    path, body = TRY_ME[info.core.task]
                    kinds = ", ".join(sorted(set(info.core.weights.values()))) or "n/a"
                    page = f"\n  Chat and watch the engine at {url}/, or try:" if ui else " Try:"
                    log.warning("Unison ready at %s with %d frontend worker(s), linears as %s.%s\n  curl "
                                "%s%s -H 'Content-Type: application/json'%s -d '%s'",
                                url, workers, kinds, page, url, path, auth, body)
                    return
        except OSError:
            pass
        time.sleep(0.2)
    if exited() is None:  # else the core watcher reports
        failure.append(f"the server did not get ready: {workers} worker(s) did not attach to the "
                       f"engine within {timeout:.0f} s")
        log.error("%s", failure[0])
        os.kill(os.getpid(), signal.SIGTERM)
