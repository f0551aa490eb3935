"""A warm process for the mutants' pytest runs: it imports the heavy libraries once, then forks one child per run.

A fresh ``python -m pytest`` spends most of a mutant's seconds importing torch, transformers and their kin before
the first test; the mutated code is none of those. The server imports only third-party libraries (never ``rpb``
nor the suite's own modules, which is checked), so each forked child imports the scratch copy's ``rpb`` -- with that
run's mutation -- afresh, exactly as a new process would, and nothing one run does reaches the next.

Protocol, one JSON line each way: the harness sends ``{"args": [...], "log": path}``; the server answers
``{"pid": n}`` when the child starts and ``{"rc": code}`` when it ends (a negative code: killed by that signal).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

#: what every mutant's run imports before its first test (the conftest's and the trainer's libraries)
PRELOAD = ("torch", "numpy", "safetensors.torch", "tokenizers", "transformers", "transformers.modeling_utils",
           "transformers.trainer", "pytest", "hypothesis")  # fmt: skip


def _own(name: str) -> bool:
    return name.split(".")[0] in ("rpb", "tests") and name not in ("tests", "tests.mutants")  # -m imports these


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if _own(m))
    if loaded:  # a child would inherit them instead of importing the mutated copy
        raise RuntimeError(f"the fork server imported the code under test: {loaded}")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: its output to the log, one pytest run, gone without running the server's exit
            code = 70
            try:
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                import pytest

                code = int(pytest.main(request["args"]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class WarmPytest:
    """``run(args, timeout)``: ``pytest ARGS`` in a child of a warm server started in ``cwd`` with ``env``."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        cmd = [sys.executable, "-m", "tests.mutants.forks"]
        self.cwd = cwd
        self.server = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # the answers are read by a thread into a queue, so that waiting for one can time out
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.server.stdout:
            self.answers.put(json.loads(line))
        self.answers.put(None)  # the server ended

    def _answer(self, timeout: float) -> dict | None:
        """The server's next answer, or None after ``timeout`` seconds."""
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            return None
        if answer is None:
            raise RuntimeError(f"the fork server in {self.cwd} ended (exit status {self.server.wait()})")
        return answer

    def run(self, args: list[str], log: Path, timeout: float) -> tuple[int | None, str]:
        """(pytest's exit status, or None after ``timeout`` seconds, the child killed; the run's output)."""
        self.server.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
        self.server.stdin.flush()
        started = self._answer(600)  # the first request waits out the server's imports
        if started is None:
            raise RuntimeError(f"the fork server in {self.cwd} started no run in 600 s")
        answer = self._answer(timeout)
        if answer is None:
            os.kill(started["pid"], signal.SIGKILL)
            self._answer(60)
        output = log.read_text(errors="replace") if log.is_file() else ""
        return (None if answer is None else answer["rc"]), output

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


if __name__ == "__main__":
    serve()
