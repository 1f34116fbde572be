"""A scripted OpenAI-compatible chat server on 127.0.0.1 for tests (stdlib http.server in a thread).

    with ChatServer(lambda body: "yes") as server:      # reply text from the request body
        client = ChatClient(ChatConfig(url=server.url, model="m"))
        server.requests                                    # every request body, in order

`script(body)` returns the reply text, or a `(status, payload)` pair to answer with an HTTP error
or a raw JSON payload (a dict is sent as is, so malformed replies can be scripted too).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Script = Callable[[dict[str, Any]], "str | tuple[int, Any]"]


class ChatServer:
    def __init__(self, script: Script):
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # lower-cased names
        self.paths: list[str] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.requests.append(body)
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                    outer.paths.append(self.path)
                out = outer.script(body)
                if isinstance(out, tuple):
                    status, payload = out
                else:
                    status, payload = 200, {
                        "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": out}}],
                        "usage": {"prompt_tokens": len(json.dumps(body["messages"])) // 4,
                                  "completion_tokens": max(1, len(out) // 4),
                                  "total_tokens": len(json.dumps(body["messages"])) // 4 + max(1, len(out) // 4)},
                    }
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "ChatServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def prompts(self) -> list[str]:
        """The text of the last user turn of every request."""
        out = []
        for body in self.requests:
            content = body["messages"][-1]["content"]
            out.append(content if isinstance(content, str) else next(p["text"] for p in content if p["type"] == "text"))
        return out


def free_port_url() -> str:
    """A URL where nothing listens (the port was just released), for outage tests."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/v1"
