"""The Isaac Lab server: one batched task in Isaac Lab's own Python, driven over ``wire``.

Role: Isaac Lab 3.0 needs Python 3.12 and its own torch; the env workers run this project's
interpreter. ``envs.isaaclab.client`` starts this module in the Isaac Lab environment
(``python -m envs.isaaclab.server CONFIG_JSON``, this package on ``PYTHONPATH``), which builds
the task inside the runtime its config needs (``isaaclab.app.launch_simulation``: nothing to
start for Newton kit-less, Isaac Sim for the kit path) and then serves commands until
``close`` or the end of its stdin.

Input: the config JSON (``task``, ``options``, ``chunk_len``, ``kit``, ``seed``); commands
on stdin. Output: answers on a duplicate of the original stdout; fd 1 itself is pointed at
stderr before anything is imported, because Isaac Lab, Warp and their C libraries print there.
A command that raises answers ``{"error": traceback}`` and the server stays up (the worker
decides what a failed step means); a failure while building answers the same and exits 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import Any


def _reply_channel() -> Any:
    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    return channel


def _launch(cfg: Any, config: dict[str, Any], standalone: bool) -> Any:
    """The runtime the task's config needs, as a context manager."""
    if standalone:
        return contextlib.nullcontext()
    from isaaclab.app import launch_simulation

    options = config["options"]
    args = {"headless": True, "device": options["device"], "require_kit": bool(config["kit"]),
            "enable_cameras": bool(options["cameras"])}
    return launch_simulation(cfg, args)


def _describe(config: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {"python": sys.version.split()[0], "device": config["options"]["device"],
                           "kit": bool(config["kit"]), "task": config["task"]}
    for package in ("isaaclab", "newton", "warp-lang", "torch", "mujoco-warp"):
        with contextlib.suppress(PackageNotFoundError):
            out[package] = version(package)
    return out


def serve(config: dict[str, Any], reply: Any) -> int:
    from multiprocessing import resource_tracker, shared_memory

    from envs.isaaclab.batched import BatchedSlots, spec_of
    from envs.isaaclab.tasks import definition
    from envs.isaaclab.wire import Layout, decode, encode

    def send(message: dict[str, Any]) -> None:
        reply.write(encode(message))

    try:
        import torch

        torch.manual_seed(int(config["seed"]))
        task_def = definition(config["task"])
        cfg = task_def.configure(config["options"])
        runtime = _launch(cfg, config, task_def.standalone)
        runtime.__enter__()
        task = task_def.build(cfg)
        spec = spec_of(task, int(config["chunk_len"]))
    except BaseException:
        send({"error": traceback.format_exc()})
        return 1
    send({"ready": spec.to_json()})
    batched: BatchedSlots | None = None
    for line in sys.stdin.buffer:
        message = decode(line)
        command = message["cmd"]
        if command == "close":
            break
        try:
            if command == "attach":
                shm = shared_memory.SharedMemory(name=message["shm"])
                # the worker owns it
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
                batched = BatchedSlots(task, spec.chunk_len, Layout(spec, shm.buf))
                send({"ok": True})
            elif command == "reset":
                if batched is None:
                    raise AttributeError("reset before attach")
                batched.reset(message["ids"], message["variants"], message["layouts"])
                send({"ok": True})
            elif command == "step":
                if batched is None:
                    raise AttributeError("step before attach")
                batched.step(message["ids"])
                send({"ok": True})
            elif command == "describe":
                send({"ok": _describe(config)})
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception:
            send({"error": traceback.format_exc()})
    with contextlib.suppress(Exception):  # closing is best effort: the process ends anyway
        task.close()
        runtime.__exit__(None, None, None)
    return 0


def main(argv: list[str] | None = None) -> int:
    reply = _reply_channel()
    argv = sys.argv[1:] if argv is None else argv
    return serve(json.loads(argv[0]), reply)


if __name__ == "__main__":
    sys.exit(main())
