"""The one client for OpenAI-compatible chat endpoints (`vllm serve`, llama.cpp, hosted APIs).

    client = ChatClient(ChatConfig(url="http://127.0.0.1:8000/v1", model="Qwen2.5-VL-72B"),
                        config_key="scorer.judge", cache_path="runs/eval/chat_cache.jsonl")
    reply = client.chat([{"role": "user", "content": "Is 2 + 2 = 4? yes or no"}])
    reply.text, reply.completion_tokens, reply.cached
    verdicts = client.map(lambda q: client.ask(q, parse_yes_no), questions)  # `concurrency` at once

Every part of mmprm that asks a chat model (the tree judge and extractor, the answer-equivalence
judge of annotation, the SFT rewriter) goes through this class, so all share one policy:

* retries: connection errors, timeouts, 408/409/429 and 5xx are retried `max_retries` times with
  exponential backoff (`backoff_s`, doubling, capped at `max_backoff_s`); other 4xx are the
  request's fault and fail at once as `ChatRequestError`.
* outage: when the retries run out the call raises `EndpointUnavailable`, naming the URL and the
  config key to fix, instead of counting a dead server as wrong answers.
* cache: replies are appended to a JSONL file keyed by a hash of the request (model, messages,
  sampling), so a rerun after a crash or with a new metric pays nothing for what it already asked.
  The URL is not in the key: moving the same model to another host keeps the cache.
* unreadable replies: `ask(messages, parse)` asks again (with a fresh sampling seed, so neither a
  deterministic server nor the cache returns the same reply) and returns None after
  `parse_retries`; the caller counts it.

`openai` is an optional dependency (`pip install 'mmprm[openai]'`), imported on first use.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mimetypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Messages = list[dict[str, Any]]

# Status codes worth another try: timeouts, conflicts, rate limits and server errors.
RETRYABLE_STATUS = frozenset({408, 409, 429})


class ChatError(RuntimeError):
    """A chat request failed; the message names the endpoint and the config key to fix."""


class EndpointUnavailable(ChatError):
    """The endpoint could not be reached (or kept failing) after every retry."""


class ChatRequestError(ChatError):
    """The endpoint refused this request (4xx other than 408/409/429): retrying will not help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class ChatConfig:
    """Where and how to ask a chat model; a section of every recipe config that calls one.

    Attributes:
        url: base URL ending before /chat/completions (http://127.0.0.1:8000/v1 for vllm serve)
        model: the served model name
        api_key_env: environment variable with the key; unset sends a placeholder (local servers
            ignore it, a hosted API answers 401 and the error says which variable to set)
        timeout_s: seconds per request
        max_retries: retries of a failed request (connection errors, timeouts, 408/409/429, 5xx)
        backoff_s: first wait between retries; doubles each retry
        max_backoff_s: longest wait between retries
        concurrency: requests in flight at once (ChatClient.map)
        max_tokens: reply cap for every request; null leaves each caller's own (judges ask for a few
            tokens, extraction for the server's default); raise it for judges that reason first
        cache: keep replies on disk (the recipe puts the file in its output folder)
    """

    url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    concurrency: int = 8
    max_tokens: int | None = None
    cache: bool = True

    def validate(self) -> None:
        if self.max_retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0 or self.concurrency < 1:
            raise ValueError("chat: need max_retries >= 0, backoff_s >= 0, timeout_s > 0, concurrency >= 1")


@dataclass
class ChatReply:
    """One completion: its text, token usage as the server reported it, and whether it came from disk."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False


@dataclass
class ChatStats:
    """Running totals, for progress lines and the report."""

    requests: int = 0  # sent over the network (retries included)
    cache_hits: int = 0
    retries: int = 0
    unparsed: int = 0  # replies `ask` could not read
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def chat_content(text: str, images: Sequence[str] = ()) -> Any:
    """User-message content: the text alone, or text plus images as base64 data URLs (vision models)."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for p in images:
        mime = mimetypes.guess_type(str(p))[0] or "image/png"
        data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
        parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
    return parts


def messages_for(text: str, system: str | None = None, images: Sequence[str] = ()) -> Messages:
    """A system turn (optional) and one user turn."""
    out: Messages = [{"role": "system", "content": system}] if system else []
    return out + [{"role": "user", "content": chat_content(text, images)}]


class ReplyCache:
    """Replies on disk: one JSON line per request, `{"key", "text", "prompt_tokens", "completion_tokens"}`.

    Each new reply is appended and flushed, so a kill loses at most the line being written; on the
    next start that torn line is cut off, so the next reply starts a line of its own. A line that
    does not parse elsewhere (a cache written before torn lines were cut) is skipped: its request
    is simply asked again. Memory holds each reply's place in the file, not its text: a judge
    cache grows with problems times distinct answers.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._where: dict[str, tuple[int, int]] = {}  # key -> (byte offset, byte length) of its line
        if self.path.exists():
            end = 0  # just past the last line that ends in a newline
            with open(self.path, "rb") as f:
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break  # torn by a kill: cut off below
                    try:
                        row = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        row = None
                    if isinstance(row, dict) and "key" in row and isinstance(row.get("text"), str):
                        self._where[str(row["key"])] = (end, len(raw))
                    end += len(raw)
            if end < self.path.stat().st_size:
                os.truncate(self.path, end)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self._where)

    def get(self, key: str) -> ChatReply | None:
        with self._lock:
            where = self._where.get(key)
            if where is None:
                return None
            with open(self.path, "rb") as f:
                f.seek(where[0])
                row = json.loads(f.read(where[1]))
        return ChatReply(row["text"], row.get("prompt_tokens", 0), row.get("completion_tokens", 0), cached=True)

    def put(self, key: str, reply: ChatReply) -> None:
        row = {
            "key": key,
            "text": reply.text,
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
        }
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock, open(self.path, "ab") as f:
            self._where[key] = (f.tell(), len(line))
            f.write(line)


def request_key(body: dict[str, Any]) -> str:
    """Cache key of a request body (model, messages, sampling); stable across runs and hosts."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ImportError(
            "talking to a chat endpoint needs the openai package: pip install 'mmprm[openai]' (or pip install openai)"
        ) from None
    return openai


class ChatClient:
    """Chat completions with retries, backoff, a disk cache and concurrency (see the module docstring).

    Args:
        config: url, model, key variable, timeout, retry and concurrency settings.
        config_key: where the user sets `config` ("scorer.judge"), named in every error.
        cache_path: JSONL reply cache; None keeps no cache.
        sleep: the backoff wait (tests pass a recorder).
    """

    def __init__(
        self,
        config: ChatConfig,
        config_key: str = "chat",
        cache_path: str | Path | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        config.validate()
        if not config.url or not config.model:
            raise ValueError(f"{config_key}.url and {config_key}.model must be set to use a chat endpoint")
        self.config = config
        self.config_key = config_key
        self.url = config.url.rstrip("/")
        self.cache = ReplyCache(cache_path) if cache_path is not None and config.cache else None
        self.stats = ChatStats()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._client: Any = None

    def _api(self) -> Any:
        with self._lock:  # the first calls of `map` arrive together; build one client
            return self._client or self._make_client()

    def _make_client(self) -> Any:
        if self._client is None:
            openai = _openai()
            key = os.environ.get(self.config.api_key_env) or "EMPTY"
            # Retries are ours (one policy, counted in stats), so the SDK's own are off.
            self._client = openai.OpenAI(base_url=self.url, api_key=key, timeout=self.config.timeout_s, max_retries=0)
        return self._client

    def _count(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def chat(
        self,
        messages: Messages,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        seed: int | None = None,
        **extra: Any,
    ) -> ChatReply:
        """One completion (from the cache when this exact request was answered before)."""
        body: dict[str, Any] = {"model": self.config.model, "messages": messages, "temperature": temperature}
        # The user's cap wins over a caller's short default (a reasoning judge needs room to think).
        cap = self.config.max_tokens if self.config.max_tokens is not None else max_tokens
        if cap is not None:
            body["max_tokens"] = cap
        if seed is not None:
            body["seed"] = seed
        body.update(extra)
        key = request_key(body)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self._count(cache_hits=1)
                return hit
        reply = self._send(body)
        if self.cache is not None:
            self.cache.put(key, reply)
        return reply

    def _send(self, body: dict[str, Any]) -> ChatReply:
        openai = _openai()
        where = f"{self.url}/chat/completions (model {self.config.model!r})"
        last = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count(retries=1)
                self._sleep(min(self.config.backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s))
            start = time.perf_counter()
            self._count(requests=1)
            try:
                resp = self._api().chat.completions.create(**body)
            except openai.APIConnectionError as e:  # refused, DNS, timeout
                last = f"{type(e).__name__}: {e}"
                continue
            except openai.APIStatusError as e:
                status = e.status_code
                if status in RETRYABLE_STATUS or status >= 500:
                    last = f"HTTP {status}: {_short(e)}"
                    continue
                hint = (
                    f"set ${self.config.api_key_env} ({self.config_key}.api_key_env names the variable)"
                    if status in (401, 403)
                    else f"check {self.config_key}.model and the request"
                )
                raise ChatRequestError(
                    f"{where} refused the request with HTTP {status}: {_short(e)}; {hint}", status
                ) from e
            finally:
                self._count(seconds=time.perf_counter() - start)
            try:
                text = resp.choices[0].message.content or ""
            except (AttributeError, IndexError, TypeError):
                last = f"malformed reply (no choices[0].message.content): {str(resp)[:200]}"
                continue
            usage = getattr(resp, "usage", None)
            reply = ChatReply(
                text, int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0)
            )
            self._count(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
            return reply
        key = self.config_key
        raise EndpointUnavailable(
            f"chat endpoint {where} failed {self.config.max_retries + 1} times, last: {last}. Is the server up "
            f"and speaking the OpenAI chat API? Start it (e.g. `vllm serve MODEL --port 8000`) or fix {key}.url / "
            f"{key}.model"
        )

    def ask(
        self,
        messages: Messages,
        parse: Callable[[str], R | None],
        parse_retries: int = 2,
        temperature: float = 0.0,
        retry_temperature: float = 0.7,
        **kw: Any,
    ) -> tuple[R | None, list[ChatReply]]:
        """Ask until `parse(reply.text)` is not None, at most 1 + `parse_retries` times.

        Returns (parsed value or None, every reply). Retries sample at `retry_temperature` with
        seed = attempt, so a server that is deterministic at temperature 0 can answer differently,
        and a rerun replays the same (cached) sequence.
        """
        replies: list[ChatReply] = []
        for attempt in range(parse_retries + 1):
            if attempt:
                reply = self.chat(messages, temperature=retry_temperature, seed=attempt, **kw)
            else:
                reply = self.chat(messages, temperature=temperature, **kw)
            replies.append(reply)
            value = parse(reply.text)
            if value is not None:
                return value, replies
            self._count(unparsed=1)
        return None, replies

    def map(self, fn: Callable[[T], R], items: Iterable[T], desc: str = "") -> list[R]:
        """`[fn(x) for x in items]` with `config.concurrency` calls in flight; order kept.

        The first exception (an outage, say) cancels what has not started and is raised.
        """
        items = list(items)
        if self.config.concurrency == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        from tqdm import tqdm

        out: list[Any] = [None] * len(items)
        with ThreadPoolExecutor(self.config.concurrency) as pool:
            futures = {pool.submit(fn, x): i for i, x in enumerate(items)}
            try:
                for fut in tqdm(
                    as_completed(futures),
                    total=len(futures),
                    desc=desc or "chat",
                    unit="item",
                    disable=not desc,
                    dynamic_ncols=True,
                ):
                    out[futures[fut]] = fut.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return out


def _short(e: Exception) -> str:
    body = getattr(e, "body", None)
    return (json.dumps(body) if isinstance(body, (dict, list)) else str(e))[:200]
