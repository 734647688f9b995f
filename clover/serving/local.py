"""An in-process server: the HTTP app on a free loopback port, run by uvicorn in a background thread.

This is how in-process callers (`clover eval tasks`, tests) reach a model through the same HTTP path as
every other client: the evaluation layer never holds a model, it gets a URL. `serve_subprocess` starts
`clover serve` itself in a child process on a free port (benchmarks, `scripts/lm_eval_local.py`).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, timeout_s: float = 30.0) -> Iterator[str]:
    """Run `app` on 127.0.0.1 (a port the OS picks) until the block ends; yields the base URL
    (`http://127.0.0.1:PORT`, without `/v1`). The server shuts down gracefully on exit."""
    # IPPROTO_TCP named explicitly: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto
    # is TCP, and socket.socket() leaves it 0; with Nagle on, each response waited ~40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="clover-local-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s + 30)
        sock.close()


@contextlib.contextmanager
def serve_subprocess(args: list[str], timeout_s: float = 120.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """`clover serve ARGS...` in a child process on a free loopback port, until the block ends; yields its
    base URL (`http://127.0.0.1:PORT`, without `/v1`) once /health answers, and the process. For benchmarks
    and scripts that measure a server as users run it."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "clover", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"clover serve {' '.join(args)} did not start")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)
