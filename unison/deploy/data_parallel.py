"""Data parallelism on Ray: N engine cores, each in a Ray actor placed anywhere in the cluster.

A `CoreActor` owns one core process that listens on its node's address over TCP, CURVE-keyed,
trusting the HTTP workers' one key. `RayReplicas` (in the launcher, the Ray driver) starts the
actors, writes where each core listens to the replicas file the HTTP workers follow
(deploy/replicas.py), and rewrites it when Ray restarts an actor. Ray does not see the death of
an actor's child process, so the actor exits when its core dies and Ray restarts it. A restarted
actor starts its core from the server's original options; if the weights were updated since,
the launcher has it load the ones its siblings serve before any worker is sent to it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from unison.api.core_process import CoreProcess, curve_keypair
from unison.config import EngineConfig, KVEventsConfig
from unison.deploy.replicas import ReplicaAddress, ReplicaSet, write_replica_set
from unison.wire import registry

log = logging.getLogger("unison.server")

WATCH_S = 0.5  # how often the launcher asks each actor where its core is


class ReplicaState(msgspec.Struct, frozen=True):
    """What the launcher polls from each actor."""

    where: ReplicaAddress
    model_path: str | None  # the weights its core serves now (a weight update changes it)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--data-parallel-size > 1 runs its engine cores on Ray, which is not "
                         "installed: pip install 'unison[ray]' (or pip install 'ray[serve]')") from None
    return ray


class CoreActor:
    """One replica: a core process owned by this actor, listening on the node's address."""

    def __init__(self, config: bytes, index: int, trusted_key: str) -> None:
        import ray

        cfg = msgspec.msgpack.decode(config, type=EngineConfig)
        node = ray.util.get_node_ip_address()
        cfg.listen = f"tcp://{node}:*"
        cfg.trusted_client_keys = (trusted_key,)
        cfg.data_parallel_rank = index
        if cfg.kv_events_config is None:  # the HTTP workers route by the load reports (and events)
            cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{node}:*",
                                                  replay_endpoint=f"tcp://{node}:*")
        self.index, self.stopping = index, False
        self.core = CoreProcess(cfg, publish=True)  # the registry tells the address it bound
        self.core.wait_published(cfg.startup_timeout)
        assert self.core.registry_path is not None  # (publish=True)
        self.registry_path = self.core.registry_path
        info = registry.read(self.registry_path)
        address, key = info.info.tcp_address, info.info.server_key
        assert address is not None and key is not None  # a core that listens publishes both
        self.where = ReplicaAddress(index, address, key, info.core_pid, socket.gethostname())
        threading.Thread(target=self._exit_with_core, daemon=True, name="unison-core-watch").start()

    def state(self) -> bytes:
        served = registry.read(self.registry_path).config.model_path  # the core republishes it
        return msgspec.msgpack.encode(ReplicaState(self.where, served))

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        """Load `model_path` into this replica's core, through a frontend of its own for the call."""
        from unison.api.engine import Engine

        engine = Engine.attach_tokenizer_worker(os.getpid(), registry_file=self.core.registry_path)
        try:
            return engine.update_weights_from_disk(model_path)[:2]
        finally:
            engine.shutdown()

    def stop(self) -> None:
        self.stopping = True
        self.core.stop()

    def _exit_with_core(self) -> None:
        self.core.proc.wait()
        if not self.stopping:  # killed or crashed: exit so that Ray restarts this replica
            self.core.stop()  # its runtime dir and registry
            os._exit(1)


class RayReplicas:
    """The launcher's side: the actors, and the replicas file kept current."""

    def __init__(self, config: EngineConfig, size: int, ray_address: str | None, path: Path) -> None:
        config.check_model_path()  # here, not as an actor that fails and is restarted forever
        ray = self.ray = import_ray()
        self.started_ray = ray_address is None  # then it is ours to stop
        if ray_address is None:  # a local instance, its files in our runtime dir (gone with it)
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _temp_dir=str(path.parent / "ray"))
        else:
            ray.init(address=ray_address, log_to_driver=False, configure_logging=False)
        public, secret = curve_keypair()
        self.path, self.secret = path, secret
        actor = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=config.num_threads or 1)(CoreActor)
        blob = msgspec.msgpack.encode(config)
        self.actors = [actor.options(scheduling_strategy="SPREAD").remote(blob, i, public)
                       for i in range(size)]
        self.where: list[ReplicaAddress | None] = [None] * size
        self.model_path: str | None = None  # once the weights were updated: the path they serve
        self.serving: list[str | None] = [None] * size  # each replica's, as last seen
        self.stale: dict[int, int] = {}  # replica -> the core pid that could not load them
        self.update_timeout = config.startup_timeout
        self.last_error: str | None = None  # why a replica did not answer, last time
        self._stop = threading.Event()
        deadline = time.monotonic() + config.startup_timeout
        while None in self.where:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.where.count(None)} replica(s) did not start within "
                                   f"{config.startup_timeout:.0f} s; last error: {self.last_error}")
            self.refresh(timeout=5)
        self._watch = threading.Thread(target=self._watch_actors, daemon=True, name="unison-replicas")
        self._watch.start()

    def refresh(self, timeout: float = 1.0) -> bool:
        """Ask each actor where its core is; rewrite the file when one moved. True: all answered."""
        ray, changed, answered = self.ray, False, True
        for i, actor in enumerate(self.actors):
            try:
                state = msgspec.msgpack.decode(ray.get(actor.state.remote(), timeout=timeout),
                                               type=ReplicaState)
            except Exception as e:  # restarting (Ray retries its creation), or not up yet
                answered, self.last_error = False, f"replica {i}: {type(e).__name__}: {e}"[:2000]
                continue
            if state.where == self.where[i]:
                if state.model_path != self.serving[i]:  # updated (an HTTP worker's control)
                    self.serving[i] = self.model_path = state.model_path
                continue
            if not self.caught_up(i, actor, state):
                continue
            if self.where[i] is not None:
                log.warning("replica %d is back: core pid %d on %s", i, state.where.core_pid,
                            state.where.host)
            self.where[i], changed = state.where, True
        ready = [w for w in self.where if w is not None]
        if changed and len(ready) == len(self.where):
            write_replica_set(self.path, ReplicaSet(ready, self.secret))
        return answered

    def caught_up(self, i: int, actor: Any, state: ReplicaState) -> bool:  # Any: Ray's handles are untyped
        """Whether a replica's new core serves the weights its siblings do, after loading them if
        the weights were updated since the server started. One that cannot stays out of service
        (logged), rather than serve other weights than the rest."""
        pid = state.where.core_pid
        if self.model_path is None or state.model_path == self.model_path:
            self.serving[i] = state.model_path
            return True
        if self.stale.get(i) == pid:
            return False
        try:
            ok, message = self.ray.get(actor.update_weights.remote(self.model_path),
                                       timeout=self.update_timeout)
        except Exception as e:  # its core died again meanwhile, or the call timed out
            ok, message = False, f"{type(e).__name__}: {e}"
        if not ok:
            log.error("replica %d (core pid %d) restarted and could not load %s, which the others "
                      "serve: %s; it stays out of service until its core restarts", i, pid,
                      self.model_path, message)
            self.stale[i] = pid
            return False
        log.warning("replica %d restarted on the original weights; it serves %s now, as the others: "
                    "%s", i, self.model_path, message)
        self.serving[i] = self.model_path
        return True

    def _watch_actors(self) -> None:
        while not self._stop.wait(WATCH_S):
            self.refresh()

    def stop(self) -> None:
        """Stop the cores and the actors; and Ray itself when the server started it."""
        self._stop.set()
        ray = self.ray
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=10)
        except Exception:  # a replica mid-restart: killing its actor ends its core too
            pass
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.started_ray:
            ray.shutdown()
