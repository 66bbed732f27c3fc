"""Core process entry: `python -m unison.core`, CoreArgs as msgpack on stdin.

Started with subprocess, not multiprocessing's spawn, which would re-import the user's __main__.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec

from unison.wire import registry
from unison.wire.messages import CoreArgs

PR_SET_PDEATHSIG = 1


def main() -> int:
    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreArgs)
    # Ctrl-C reaches the whole process group: the owner decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.pdeathsig:  # a backup for the owner pidfd the server polls
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != args.owner_pid:
        return 1  # the owner died before we could watch it
    logging.basicConfig(level=args.config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s unison.core[%(process)d] %(levelname)s %(message)s")
    try:
        from unison.core.engine_core import EngineCore
        from unison.core.loop import CoreLoop
        from unison.model.weights.loader import resolve_model_dir

        # The model is resolved here (a GGUF converted into the cache once), not in the owner:
        # frontends learn the directory from Welcome and never import torch or transformers.
        model_dir = str(resolve_model_dir(args.config.model_path))
        core = EngineCore(args.config, model_dir)
        core.runner.warmup()
        loop = CoreLoop(args, core)
    except BaseException as e:
        # The owner shows this text: tell what failed, not only that something did.
        error_file = os.path.join(args.runtime_dir, "startup_error")
        with open(error_file, "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        logging.getLogger("unison.core").exception("the core failed to start")
        registry.unlink(args.registry_path)
        return 1
    loop.publish()
    loop.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
