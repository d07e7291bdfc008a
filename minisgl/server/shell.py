"""`python -m minisgl --model M --shell`: chat with the model in this terminal.

The shell starts the ordinary server as a child process (on a free local port) and talks to it over
HTTP, so it exercises exactly what clients use. /reset clears the history, /exit (or Ctrl-D) quits;
Ctrl-C stops a reply.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from minisgl.distributed import free_port
from minisgl.server.args import ServerArgs


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl", *argv, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)  # Ctrl-C is the shell's
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")


def stream_reply(url: str, model: str, history: list[dict]) -> str:
    """Print the assistant's reply as it streams; return it whole."""
    reply = ""
    body = {"model": model, "messages": history, "stream": True, "max_tokens": 512}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=None) as resp:
        if resp.status_code != 200:
            resp.read()
            print(f"[error {resp.status_code}] {resp.json()['error']['message']}")
            return ""
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                text = delta[0]["delta"].get("content") or "" if delta else ""
                print(text, end="", flush=True)
                reply += text
    print()
    return reply


def run_shell(args: ServerArgs) -> int:
    argv = [a for a in sys.argv[1:] if a != "--shell"]
    print("starting the server...", flush=True)
    proc, url = start_server(argv)
    model = args.served_model_name
    print(f"chatting with {model}; /reset clears the history, /exit quits", flush=True)
    history: list[dict] = []
    try:
        while True:
            try:
                line = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                break
            if line == "/exit":
                break
            if line == "/reset":
                history.clear()
                print("history cleared", flush=True)
            elif line:
                history.append({"role": "user", "content": line})
                try:
                    history.append({"role": "assistant", "content": stream_reply(url, model, history)})
                except KeyboardInterrupt:  # stop this reply (closing the stream aborts it), keep chatting
                    history.pop()
                    print("\n[interrupted]", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0
