"""A scripted OpenAI-compatible chat server on 127.0.0.1 for tests (stdlib http.server in a thread).

    with ChatServer(lambda body: "yes") as server:      # reply text from the request body
        client = ChatClient(ChatConfig(url=server.url, model="m"))
        server.requests                                    # every request body, in order

`script(body)` returns the reply text, or a `(status, payload)` pair to answer with an HTTP error
or a raw JSON payload (a dict is sent as is, so malformed replies can be scripted too).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ports import free_port

Script = Callable[[dict[str, Any]], "str | tuple[int, Any]"]


class ChatServer:
    def __init__(self, script: Script, port: int = 0):
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
                    status, payload = (
                        200,
                        {
                            "id": "chatcmpl-test",
                            "object": "chat.completion",
                            "created": 0,
                            "model": body["model"],
                            "choices": [
                                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": out}}
                            ],
                            "usage": {
                                "prompt_tokens": len(json.dumps(body["messages"])) // 4,
                                "completion_tokens": max(1, len(out) // 4),
                                "total_tokens": len(json.dumps(body["messages"])) // 4 + max(1, len(out) // 4),
                            },
                        },
                    )
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ChatServer:
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
    return f"http://127.0.0.1:{free_port()}/v1"


# ---------------------------------------------------------------- a stand-in judge for demos

_WORD = re.compile(r"[a-z0-9]{3,}")


def _overlap(text: str, evidence: str) -> float:
    """Share of the words of `text` (3+ letters) that occur in `evidence`."""
    words = set(_WORD.findall(text.lower()))
    return len(words & set(_WORD.findall(evidence.lower()))) / len(words) if words else 0.0


def overlap_judge(body: dict[str, Any]) -> str:
    """A deterministic stand-in for a judge LLM, speaking our prompts' formats (NOT a real judge).

    Think360 extraction: the solution's sentences as a chain of blocks (copied verbatim). RPTS:
    the word overlap of the conclusion with its premises (or descriptions), rounded to 0.1.
    Think360 judging: "True" when at least 30% of the step's words occur in the problem and the
    steps before it.
    """
    from mmprm.data.sft import split_solution

    system = body["messages"][0]["content"] if body["messages"][0]["role"] == "system" else ""
    content = body["messages"][-1]["content"]
    prompt = content if isinstance(content, str) else next(p["text"] for p in content if p["type"] == "text")
    if system.startswith("You turn a worked solution"):
        solution = prompt.split("do not rewrite them):\n", 1)[1].split("\n\nExample of the output", 1)[0]
        steps = split_solution(solution)[0][:8]
        return "\n".join(
            f"[NODE:{k + 1}.1]\n[PARENT:{f'{k}.1' if k else 'None'}]\n[ORIGINAL:{s}]\n[TYPE:deduction]"
            for k, s in enumerate(steps)
        )
    if "Reference descriptions:" in prompt:
        facts, sentence = prompt.split("Reference descriptions:", 1)[1].split("Sentence:", 1)
        return f"{round(_overlap(sentence.replace('Score:', ''), facts), 1):.1f}"
    if "Premises:" in prompt:
        premises, conclusion = prompt.split("Premises:", 1)[1].split("Conclusion:", 1)
        context = prompt.split("Context:", 1)[1].split("Premises:", 1)[0]
        return f"{round(_overlap(conclusion.replace('Score:', ''), premises + context), 1):.1f}"
    if "Step to check:" in prompt:
        before, step = prompt.split("Step to check:", 1)
        return "True" if _overlap(step.split("Is this step correct")[0], before) >= 0.3 else "False"
    return "I only speak mmprm's judge prompts."


if __name__ == "__main__":
    # python tests/chat_server.py --port 8011: the stand-in judge above, at http://127.0.0.1:8011/v1
    import argparse
    import time

    ap = argparse.ArgumentParser(description="A scripted OpenAI-compatible judge for demos (word overlap).")
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()
    with ChatServer(overlap_judge, port=args.port) as server:
        print(f"stand-in judge at {server.url} (Ctrl-C stops it)", flush=True)
        while True:
            time.sleep(3600)
