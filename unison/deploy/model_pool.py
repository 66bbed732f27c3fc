"""ModelPool: the launcher's engine cores when `unison serve` serves several models.

Every model (`--model NAME=PATH`, or each GGUF file and model folder in `--models-dir`) gets its own
core process, started on first use and stopped when idle or to make room. The HTTP workers ask
for a model over one ZMQ socket (wire/pool.py) and attach to its core as frontends, as they
attach to a single core. The pool runs in one thread of the launcher; loads and stops run in
threads of their own, so that a model loading holds up no other model's calls.

Policy:
- at most `models_max` cores loaded or loading; past it the least recently used core that no
  worker holds is stopped, and if every one is held the call gets a 503 naming the limit;
- a core idle (held by no worker) for `idle_unload_s` is stopped;
- concurrent calls for a model that is loading wait for that one load;
- a load that fails marks the model failed until its file changes; a core that exits (crash, kill)
  marks its model unloaded, and the next call starts it again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from unison.api.core_process import CoreProcess
from unison.api.hub import is_repo_id, locate_config
from unison.config import EngineConfig
from unison.model.pooling.encoder_config import model_task
from unison.wire import pool as pp
from unison.wire import registry

log = logging.getLogger("unison.server")

# A model's name is a URL path segment and a file name: no '/', and no leading '.' (no '..').
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+@-]{0,127}")
TICK_S = 0.1  # how often the pool looks at its cores (exits, idle time) while no call comes

Reply = Callable[[pp.ModelRow | None, int, str], None]  # (row, or None and an error's status, message)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str
    path: str


def check_name(name: str, where: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"{where}: model name {name!r} must be letters, digits and _ . : + @ - "
                         "(no '/', not starting with '.')")
    return name


def find_models(models_dir: str | None, named: list[str]) -> list[ModelSource]:
    """The models to serve: each `NAME=PATH`, then each GGUF file (named by its stem) and model
    folder (one with a config.json, named by the folder) in `models_dir`, sorted by name."""
    sources = []
    for item in named:
        name, _, path = item.partition("=")
        sources.append(ModelSource(check_name(name, f"--model {item}"), path))
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"--models-dir {models_dir!r} is not a directory")
        found = [ModelSource(p.stem if p.is_file() else p.name, str(p)) for p in sorted(root.iterdir())
                 if (p.is_file() and p.suffix == ".gguf") or (p / "config.json").is_file()]
        if not found:
            raise ValueError(f"--models-dir {models_dir!r} holds no model (a .gguf file or a folder with "
                             "a config.json)")
        sources += [ModelSource(check_name(s.name, f"--models-dir {models_dir}"), s.path) for s in found]
    names = [s.name for s in sources]
    if (twice := sorted({n for n in names if names.count(n) > 1})):
        raise ValueError(f"model names given twice: {twice}")
    for s in sources:
        if not Path(s.path).expanduser().exists() and not is_repo_id(s.path):
            raise FileNotFoundError(f"model {s.name!r}: path {s.path!r} does not exist")
    return sources


def file_signature(path: str) -> tuple[tuple[str, int, int], ...]:
    """What changes when a model's files do: (name, size, mtime) of the file, or of a folder's files."""
    p = Path(path).expanduser()
    try:
        files = sorted(p.iterdir()) if p.is_dir() else [p]
        return tuple((f.name, (s := f.stat()).st_size, s.st_mtime_ns) for f in files if f.is_file())
    except OSError:  # gone (a load then says so)
        return ()


def guess_task(path: str) -> str:
    """What a model serves, before its core says (a GGUF file: a decoder that generates)."""
    folder = Path(path).expanduser()
    return model_task(folder) if (folder / "config.json").is_file() else "generate"


def unknown_model(name: str, names: list[str]) -> str:
    return f"model {name!r} does not exist; this server serves {names}"


@dataclasses.dataclass
class _Slot:
    source: ModelSource
    index: int
    task: str
    state: str = "unloaded"  # wire/pool.py's MODEL_STATES
    core: CoreProcess | None = None
    holders: set[int] = dataclasses.field(default_factory=set)  # pids of workers with requests here
    last_used: float = 0.0
    error: str | None = None
    failed_signature: tuple | None = None  # the files as they were when the load failed
    progress: float | None = None  # loading a Hugging Face id: its download's share done (a thread writes it)
    waiters: list[tuple[Reply, int | None]] = dataclasses.field(default_factory=list)  # (reply, holder)

    def row(self) -> pp.ModelRow:
        core = self.core if self.state == "loaded" else None
        return pp.ModelRow(self.source.name, self.source.path, self.state, self.task,
                           core.pid if core else None,
                           str(core.registry_path) if core and core.registry_path else None,
                           len(self.holders), self.last_used, self.error,
                           self.progress if self.state == "loading" else None)

    def live_holders(self) -> set[int]:
        self.holders = {pid for pid in self.holders if registry.pid_alive(pid)}
        return self.holders


class ModelPool:
    def __init__(self, config: EngineConfig, sources: list[ModelSource], *, frontends: int,
                 models_max: int, idle_unload_s: float | None, load_timeout: float) -> None:
        self.config, self.frontends = config, frontends
        self.models_max, self.idle_unload_s, self.load_timeout = models_max, idle_unload_s, load_timeout
        self.slots = {s.name: _Slot(s, i, guess_task(s.path)) for i, s in enumerate(sources)}
        self.runtime_dir = tempfile.mkdtemp(prefix=f"unison-{os.getpid()}-pool-")  # 0700
        self.endpoint = f"ipc://{self.runtime_dir}/pool.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # run on the pool's thread
        self.suffixes = itertools.count(1)  # registry names: the launcher's own (suffix 0) stays unused
        self.stopping = threading.Event()
        self.background: list[threading.Thread] = []  # loads and stops
        self.starting: set[CoreProcess] = set()  # cores loading: close() stops them too
        self.lock = threading.Lock()  # (starting: the load threads' and close's)
        self.thread = threading.Thread(target=self._run, name="unison-model-pool", daemon=True)
        self.thread.start()

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    # ---- the launcher's own calls (from its main thread) -----------------------------------

    def load_now(self, name: str) -> pp.ModelRow:
        """Load `name` and wait (--preload); raises RuntimeError saying why it failed."""
        done: queue.SimpleQueue[tuple[pp.ModelRow | None, int, str]] = queue.SimpleQueue()
        self.calls.put(lambda: self._want(name, lambda *r: done.put(r), None))
        row, _, message = done.get()
        if row is None:
            raise RuntimeError(message)
        return row

    def close(self) -> None:
        """Stop every core (in parallel) and the pool's thread; remove the socket's directory."""
        self.stopping.set()
        self.thread.join(5)
        with self.lock:
            cores = [*self.starting, *(s.core for s in self.slots.values() if s.core is not None)]
        for core in cores:
            self._stop_in_background(core)
        self._join_background()
        while not self.calls.empty():  # loads that ended meanwhile: their cores are stopped now
            self.calls.get()()
        self._join_background()
        self.sock.close()
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _join_background(self) -> None:
        while self.background:
            self.background.pop().join()

    # ---- the pool's thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._turn()
            except Exception:  # a bug here must not stop every model's loads: log it, go on
                log.exception("model pool")

    def _turn(self) -> None:
        if self.sock.poll(int(TICK_S * 1000)):
            while self.sock.poll(0):
                identity, frame = self.sock.recv_multipart()
                self._handle(identity, frame)
        while not self.calls.empty():
            self.calls.get()()
        self._watch()

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = pp.decode_to_pool(frame)
        except Exception as e:  # a worker of another version: say so in the log, answer nothing
            log.error("model pool: an undecodable message: %s", e)
            return
        if isinstance(msg, pp.Release):
            if (slot := self.slots.get(msg.model)) is not None:
                slot.holders.discard(msg.pid)
                slot.last_used = time.time()
            return
        reply = self._replier(identity, msg.call_id)
        if isinstance(msg, pp.ListModels):
            self._send(identity, pp.Rows(msg.call_id, [s.row() for s in self.slots.values()]))
        elif isinstance(msg, pp.Unload):
            self._unload(msg.model, identity, msg.call_id)
        elif isinstance(msg, pp.Load) and msg.if_loaded and self._state(msg.model) != "loaded":
            reply(None, 409, f"model {msg.model!r} is not loaded")
        else:
            self._want(msg.model, reply, msg.pid if isinstance(msg, pp.Acquire) else None)

    def _state(self, name: str) -> str | None:
        if (slot := self.slots.get(name)) is not None and slot.state == "loaded":
            self._notice_exit(slot)
        return slot.state if slot is not None else None

    def _send(self, identity: bytes, msg: pp.FromPool) -> None:
        try:
            self.sock.send_multipart([identity, pp.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the worker is gone: nobody waits for this answer
            log.info("model pool: a reply was not delivered: %s", e)

    def _replier(self, identity: bytes, call_id: int) -> Reply:
        def reply(row: pp.ModelRow | None, status: int, message: str) -> None:
            self._send(identity, pp.Ready(call_id, row) if row is not None
                       else pp.PoolError(call_id, status, message))
        return reply

    def _want(self, name: str, reply: Reply, holder: int | None) -> None:
        """Answer `reply` once `name` is loaded (holding it for `holder`, a worker's pid)."""
        slot = self.slots.get(name)
        if slot is None:
            return reply(None, 404, unknown_model(name, self.names))
        if slot.state == "loaded":
            self._notice_exit(slot)
        if slot.state == "loaded":
            return self._give(slot, reply, holder)
        if slot.state == "loading":
            slot.waiters.append((reply, holder))
            return None
        if slot.state == "failed" and slot.failed_signature == file_signature(slot.source.path):
            return reply(None, 500, f"model {name!r} failed to load: {slot.error} (it is tried again once "
                                    "its file changes)")
        victim = None
        if sum(s.state in ("loaded", "loading") for s in self.slots.values()) >= self.models_max:
            idle = [s for s in self.slots.values() if s.state == "loaded" and not s.live_holders()]
            if not idle:
                return reply(None, 503, f"model {name!r} is not loaded, and --models-max {self.models_max} "
                                        "models are loaded or loading, none idle (each has requests in "
                                        "flight): try again later")
            victim = min(idle, key=lambda s: s.last_used)
            log.warning("unloading model %r (least recently used) to load %r", victim.source.name, name)
            self._stop_in_background(self._take_core(victim))
        slot.waiters.append((reply, holder))
        self._start_load(slot)
        return None

    def _give(self, slot: _Slot, reply: Reply, holder: int | None) -> None:
        if holder is not None:
            slot.holders.add(holder)
        slot.last_used = time.time()
        reply(slot.row(), 200, "")

    def _start_load(self, slot: _Slot) -> None:
        slot.state, slot.error, slot.progress = "loading", None, None
        # data_parallel_rank: a numbered KV-events port is offset by it, as among replicas
        config = dataclasses.replace(self.config, model_path=slot.source.path,
                                     tokenizer_worker_num=self.frontends, data_parallel_rank=slot.index)
        if slot.task != "generate" and config.enable_lora:  # adapters are a decoder's that generates
            config = dataclasses.replace(config, enable_lora=False, lora_paths=())
        path = registry.registry_path(os.getpid(), next(self.suffixes))
        t = threading.Thread(target=self._load, args=(slot, config, path), daemon=True,
                             name=f"unison-load-{slot.source.name}")
        self.background.append(t)
        t.start()

    def _load(self, slot: _Slot, config: EngineConfig, path: Path) -> None:
        """In a thread: start the core and wait for it; the outcome is handed to the pool's thread."""
        t0, name = time.monotonic(), slot.source.name
        log.warning("loading model %r from %s", name, slot.source.path)
        core = None
        try:
            # A Hugging Face id: downloaded on first use, its progress on the web page
            config = locate_config(config, quiet=True, progress=lambda done, total: setattr(
                slot, "progress", done / total if total else None))
            with self.lock:  # close() stops what is starting: nothing starts after it looked
                if self.stopping.is_set():
                    raise RuntimeError("the server is stopping")
                core = CoreProcess(config, publish=True, registry_path=path)
                self.starting.add(core)
            core.wait_published(self.load_timeout)
            task = registry.read(path).info.task
        except TimeoutError:
            status, message = 504, f"model {name!r} did not load within {self.load_timeout:g} s " \
                                   "(--model-load-timeout)"
        except Exception as e:
            status, message = 500, f"model {name!r} failed to load: {e}"
        else:
            log.warning("model %r loaded in %.1f s (core pid %d)", name, time.monotonic() - t0, core.pid)
            self.calls.put(lambda: self._loaded(slot, core, task))
            return
        finally:
            with self.lock:
                self.starting -= {core}
        self.calls.put(lambda: self._load_failed(slot, core, status, message))

    def _loaded(self, slot: _Slot, core: CoreProcess, task: str) -> None:
        if self.stopping.is_set():
            return self._stop_in_background(core)
        slot.state, slot.core, slot.task = "loaded", core, task
        waiters, slot.waiters = slot.waiters, []
        for reply, holder in waiters:
            self._give(slot, reply, holder)
        return None

    def _load_failed(self, slot: _Slot, core: CoreProcess | None, status: int, message: str) -> None:
        log.error("%s", message)
        if core is not None:
            self._stop_in_background(core)
        slot.error = message.partition(": ")[2] if status == 500 else message
        # A timeout may pass (a busy machine): the next call tries again. A failure waits for new files.
        slot.state = "failed" if status == 500 else "unloaded"
        slot.failed_signature = file_signature(slot.source.path) if status == 500 else None
        waiters, slot.waiters = slot.waiters, []
        for reply, _ in waiters:
            reply(None, status, message)

    def _unload(self, name: str, identity: bytes, call_id: int) -> None:
        slot = self.slots.get(name)
        if slot is None:
            return self._send(identity, pp.PoolError(call_id, 404, unknown_model(name, self.names)))
        if slot.state == "loading":
            return self._send(identity, pp.PoolError(call_id, 409, f"model {name!r} is loading"))
        if slot.state == "loaded" and slot.live_holders():
            return self._send(identity, pp.PoolError(
                call_id, 409, f"model {name!r} has requests in flight (in {len(slot.holders)} worker(s))"))
        if slot.state == "loaded":
            log.warning("unloading model %r (asked to)", name)
            self._stop_in_background(self._take_core(slot))
        return self._send(identity, pp.Done(call_id, slot.row()))

    def _watch(self) -> None:
        """Cores that exited on their own; cores idle past --idle-unload-s."""
        now = time.time()
        for slot in self.slots.values():
            if slot.state != "loaded":
                continue
            self._notice_exit(slot)
            if (slot.state == "loaded" and self.idle_unload_s is not None and not slot.live_holders()
                    and now - slot.last_used >= self.idle_unload_s):
                log.warning("unloading model %r (idle for %.0f s)", slot.source.name, now - slot.last_used)
                self._stop_in_background(self._take_core(slot))

    def _notice_exit(self, slot: _Slot) -> None:
        assert slot.core is not None  # (loaded)
        code = slot.core.proc.poll()
        if code is not None:
            slot.error = f"its core (pid {slot.core.pid}) exited with code {code}"
            log.error("model %r: %s; the next request starts it again", slot.source.name, slot.error)
            self._stop_in_background(self._take_core(slot))

    def _take_core(self, slot: _Slot) -> CoreProcess:
        core = slot.core
        assert core is not None  # (loaded)
        slot.state, slot.core, slot.holders = "unloaded", None, set()
        return core

    def _stop_in_background(self, core: CoreProcess) -> None:
        t = threading.Thread(target=core.stop, daemon=True, name=f"unison-stop-{core.pid}")
        self.background = [b for b in self.background if b.is_alive()] + [t]
        t.start()
