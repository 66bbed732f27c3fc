"""`unison serve`: the launcher owns the core and its registry; N uvicorn workers are the frontends.

The launcher has no frontend of its own: with N = 1 uvicorn runs the app in this process, with
N > 1 in N worker processes sharing the port; either way each attaches through the registry (one
code path). Ready means the core lists N attached frontends.
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
from pathlib import Path
from typing import Any

import uvicorn

from unison import registry
from unison.config import EngineConfig
from unison.core_process import CoreProcess
from unison.server.app import ENV, create_app
from unison.server.streaming import Settings

log = logging.getLogger("unison.server")


def serve(config: EngineConfig, *, host: str, port: int, api_key: str | None,
          served_model_name: str | None, tool_call_parser: str | None = None,
          generation_config: str = "auto", chat_template: str | None = None,
          max_request_bytes: int | None = None, data_parallel_size: int = 1,
          ray_address: str | None = None, routing: str = "least_loaded", ui: bool = True,
          extra_frontends: int = 0) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if data_parallel_size > 1 or ray_address:
        return _serve_data_parallel(config, data_parallel_size, ray_address, routing, host=host, port=port,
                                    api_key=api_key, served_model_name=served_model_name,
                                    tool_call_parser=tool_call_parser, generation_config=generation_config,
                                    chat_template=chat_template, max_request_bytes=max_request_bytes,
                                    ui=ui)
    workers = config.tokenizer_worker_num
    # The core admits the HTTP workers and `extra_frontends` Engines attached from elsewhere.
    core = CoreProcess(dataclasses.replace(config, tokenizer_worker_num=workers + extra_frontends),
                       publish=True)
    failure: list[str] = []  # why the server stopped on its own, when it did
    stopping = threading.Event()
    try:
        core.wait_published(config.startup_timeout)
        if config.listen:
            info = registry.read(core.registry_path).info
            log.warning("remote frontends attach at %s with server_key %s", info.tcp_address, info.server_key)
        settings = Settings(
            registry_path=str(core.registry_path), owner_pid=os.getpid(), api_key=api_key,
            served_model_name=served_model_name or _default_name(config.model_path),
            max_request_bytes=max_request_bytes, tool_call_parser=tool_call_parser,
            generation_config=generation_config, chat_template=chat_template, ui=ui,
        )
        threading.Thread(target=_announce_when_ready, daemon=True, name="unison-ready",
                         args=(host, port, workers, api_key, ui, config.startup_timeout, core.proc.poll,
                               failure)).start()
        threading.Thread(target=_stop_when_core_exits, daemon=True, name="unison-core-watch",
                         args=(core, stopping, failure)).start()
        _run_uvicorn(settings, host, port, workers, config.log_level)
    finally:
        stopping.set()
        core.stop()
    if failure:
        log.error("the server stopped: %s", failure[0])
        return 1
    return 0 if core.proc.returncode in (0, -signal.SIGTERM) else 1


def _serve_data_parallel(config: EngineConfig, size: int, ray_address: str | None, routing: str, *,
                         host: str, port: int, api_key: str | None, **settings_args: Any) -> int:
    """N cores in Ray actors; the same HTTP workers, each attached to every core over TCP."""
    from unison.server.data_parallel import RayReplicas

    if routing == "kv" and config.kv_events_config is not None and config.kv_events is None:
        raise ValueError("--routing kv reads the replicas' KV events: leave --kv-events-config out "
                         "(each replica then publishes on a free port) or enable it")
    workers = config.tokenizer_worker_num
    runtime = tempfile.mkdtemp(prefix=f"unison-{os.getpid()}-")  # 0700: the replicas file holds a key
    failure: list[str] = []
    cores = None
    try:
        # Each core takes every HTTP worker as a frontend, and one more (a worker re-attaching).
        cores = RayReplicas(dataclasses.replace(config, tokenizer_worker_num=workers + 1), size,
                            ray_address, Path(runtime) / "replicas.json")
        log.warning("%d replicas: %s", size, ", ".join(
            f"core pid {w.core_pid} on {w.host} at {w.address}" for w in cores.where))
        settings_args["served_model_name"] = (settings_args["served_model_name"]
                                              or _default_name(config.model_path))
        settings = Settings(registry_path="", owner_pid=os.getpid(), api_key=api_key,
                            replicas_path=str(cores.path), routing=routing, **settings_args)
        threading.Thread(target=_announce_when_ready, daemon=True, name="unison-ready",
                         args=(host, port, workers * size, api_key, settings.ui, config.startup_timeout,
                               lambda: None, failure)).start()
        _run_uvicorn(settings, host, port, workers, config.log_level)
    finally:
        if cores is not None:
            cores.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    if failure:
        log.error("the server stopped: %s", failure[0])
        return 1
    return 0


def _run_uvicorn(settings: Settings, host: str, port: int, workers: int, log_level: str) -> None:
    os.environ[ENV] = json.dumps(dataclasses.asdict(settings))
    # With one worker uvicorn runs here and, once shut down, re-raises the SIGTERM it caught
    # under the handler it found: the default one would kill the launcher before it stops
    # the core and reports. The signal is handled by then.
    signal.signal(signal.SIGTERM, lambda *_: None)
    app: Any = create_app(settings) if workers == 1 else "unison.server.app:create_app"
    uvicorn.run(app, host=host, port=port, workers=None if workers == 1 else workers,
                factory=workers > 1, log_level=log_level, timeout_graceful_shutdown=5)


def _default_name(model_path: str | None) -> str:
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model_path))


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


def _announce_when_ready(host: str, port: int, workers: int, api_key: str | None, ui: bool, timeout: float,
                         exited: Any, failure: list[str]) -> None:
    """Log the URL (the page's, and a curl line) once every worker has attached; stop the launch if
    that does not happen."""
    url = f"http://{host}:{port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and exited() is None:
        try:
            req = urllib.request.Request(f"{url}/get_server_info", headers=headers)
            with urllib.request.urlopen(req, timeout=2) as r:
                info = json.load(r)
                if len(info["frontends"]) >= workers:
                    auth = " -H \"Authorization: Bearer $API_KEY\"" if api_key else ""
                    body = '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
                    kinds = ", ".join(sorted(set(info.get("weights", {}).values()))) or "n/a"
                    page = f"\n  Chat and watch the engine at {url}/, or try:" if ui else " Try:"
                    log.warning("Unison ready at %s with %d frontend worker(s), linears as %s.%s\n  curl "
                                "%s/v1/completions -H 'Content-Type: application/json'%s -d '%s'",
                                url, workers, kinds, page, url, auth, body)
                    return
        except OSError:
            pass
        time.sleep(0.2)
    if exited() is None:  # else the core watcher reports
        failure.append(f"the server did not get ready: {workers} worker(s) did not attach to the "
                       f"engine within {timeout:.0f} s")
        log.error("%s", failure[0])
        os.kill(os.getpid(), signal.SIGTERM)
