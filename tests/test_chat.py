"""mmprm.chat.ChatClient against a scripted OpenAI-compatible server on 127.0.0.1: retries, backoff,
the reply cache, unreadable replies, concurrency and the outage error."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from chat_server import ChatServer, free_port_url

from mmprm.chat import (
    ChatClient,
    ChatConfig,
    ChatReply,
    ChatRequestError,
    EndpointUnavailable,
    ReplyCache,
    messages_for,
    request_key,
)

pytest.importorskip("openai")


def client_for(url: str, sleeps: list | None = None, **kw) -> ChatClient:
    cache_path = kw.pop("cache_path", None)
    cfg = ChatConfig(url=url, model="m", **{"backoff_s": 0.5, **kw})
    return ChatClient(
        cfg,
        config_key="scorer.judge",
        cache_path=cache_path,
        sleep=(sleeps.append if sleeps is not None else lambda s: None),
    )


def test_one_request_speaks_the_protocol(monkeypatch):
    with ChatServer(lambda body: "hello") as server:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        reply = client_for(server.url).chat(messages_for("hi", system="be brief"), max_tokens=5)
        assert reply.text == "hello" and not reply.cached and reply.completion_tokens == 1
        assert server.paths == ["/v1/chat/completions"]
        body = server.requests[0]
        assert body["model"] == "m" and body["temperature"] == 0.0 and body["max_tokens"] == 5
        assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert server.headers[0]["authorization"] == "Bearer EMPTY"  # no key: a placeholder local servers ignore
        client_for(server.url, max_tokens=300).chat(messages_for("hi"), max_tokens=5)
        assert server.requests[-1]["max_tokens"] == 300  # the configured cap wins over the caller's default
        monkeypatch.setenv("MY_KEY", "sk-1")
        client_for(server.url, api_key_env="MY_KEY").chat(messages_for("hi"))
        assert server.headers[-1]["authorization"] == "Bearer sk-1"


def test_server_errors_are_retried_with_exponential_backoff():
    script = iter([(500, {"error": "boom"}), (429, {"error": "slow down"}), (503, {"error": "busy"}), "ok"])
    sleeps: list[float] = []
    with ChatServer(lambda body: next(script)) as server:
        client = client_for(server.url, sleeps, max_retries=3, max_backoff_s=1.5)
        assert client.chat(messages_for("x")).text == "ok"
        assert len(server.requests) == 4 and sleeps == [0.5, 1.0, 1.5]  # 0.5, 1.0, then capped at 1.5
        assert client.stats.retries == 3 and client.stats.requests == 4


def test_client_errors_fail_at_once_and_name_the_fix():
    sleeps: list[float] = []
    with ChatServer(lambda body: (404, {"error": {"message": "model 'm' not found"}})) as server:
        with pytest.raises(ChatRequestError, match="HTTP 404.*not found.*check scorer.judge.model") as e:
            client_for(server.url, sleeps).chat(messages_for("x"))
        assert e.value.status == 404 and len(server.requests) == 1 and sleeps == []
        server.script = lambda body: (401, {"error": "bad key"})
        with pytest.raises(ChatRequestError, match=r"HTTP 401.*set \$JUDGE_KEY \(scorer.judge.api_key_env"):
            client_for(server.url, api_key_env="JUDGE_KEY").chat(messages_for("x"))


def test_a_dead_endpoint_raises_a_clear_error_after_the_retries():
    url = free_port_url()
    sleeps: list[float] = []
    with pytest.raises(EndpointUnavailable) as e:
        client_for(url, sleeps, max_retries=2).chat(messages_for("x"))
    msg = str(e.value)
    assert url in msg and "failed 3 times" in msg and "APIConnectionError" in msg
    assert "scorer.judge.url" in msg and "vllm serve" in msg
    assert sleeps == [0.5, 1.0]


def test_malformed_replies_and_timeouts_are_retried():
    script = iter([(200, {"unexpected": True}), "fine"])
    with ChatServer(lambda body: next(script)) as server:
        assert client_for(server.url).chat(messages_for("x")).text == "fine" and len(server.requests) == 2
        server.script = lambda body: (200, {"unexpected": True})
        with pytest.raises(EndpointUnavailable, match="malformed reply"):
            client_for(server.url, max_retries=1).chat(messages_for("x"))

    calls = []

    def slow_then_fast(body):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.5)
        return "late but fine"

    with ChatServer(slow_then_fast) as server:
        client = client_for(server.url, timeout_s=0.5)
        assert client.chat(messages_for("x")).text == "late but fine" and client.stats.retries == 1


def test_the_reply_cache_makes_a_rerun_free(tmp_path):
    cache = tmp_path / "cache.jsonl"
    with ChatServer(lambda body: f"reply to {body['messages'][-1]['content']}") as server:
        client = client_for(server.url, cache_path=cache)
        first = client.chat(messages_for("a"))
        again = client.chat(messages_for("a"))
        assert again.text == first.text == "reply to a" and again.cached and len(server.requests) == 1
        client.chat(messages_for("a"), temperature=0.5)  # another request, another key
        assert len(server.requests) == 2
        # a new process (new client) reads the file: nothing is asked again
        rerun = client_for(server.url, cache_path=cache)
        assert rerun.chat(messages_for("a")).cached and rerun.stats.cache_hits == 1 and len(server.requests) == 2
    # a line torn by a kill is ignored, the others survive
    with open(cache, "a") as f:
        f.write('{"key": "abc", "te')
    assert len(ReplyCache(cache)) == 2
    key = request_key({"model": "m", "messages": messages_for("a"), "temperature": 0.0})
    assert ReplyCache(cache).get(key).text == "reply to a"
    assert client_for(free_port_url(), cache_path=cache, cache=False).cache is None


def test_a_reply_written_after_a_torn_line_survives_the_next_start(tmp_path):
    """A kill tore reply b; the restart cuts it off, so reply c gets a line of its own and is
    still there (with its text and token counts) on the start after."""
    cache = tmp_path / "cache.jsonl"
    ReplyCache(cache).put("a", ChatReply("text a", 3, 4))
    with open(cache, "a", encoding="utf-8") as f:
        f.write('{"key": "b", "text": "ha')
    restarted = ReplyCache(cache)
    assert len(restarted) == 1
    restarted.put("c", ChatReply("text c \u00e9", 5, 6))
    again = ReplyCache(cache)
    assert len(again) == 2 and again.get("b") is None
    assert (again.get("a").text, again.get("c").text) == ("text a", "text c \u00e9")
    assert (again.get("c").prompt_tokens, again.get("c").completion_tokens, again.get("c").cached) == (5, 6, True)
    # a cache written before torn lines were cut holds a spliced line mid-file: skipped, asked again
    cache.write_text(
        '{"key": "a", "text": "A"}\n{"key": "b", "te{"key": "c", "text": "C"}\n{"key": "d", "text": "D"}\n'
    )
    old = ReplyCache(cache)
    assert len(old) == 2 and old.get("c") is None and old.get("d").text == "D"


def test_ask_retries_unreadable_replies_with_fresh_seeds(tmp_path):
    def script(body):
        return "42" if body.get("seed") == 2 else "I am not sure"

    def parse(text):
        return int(text) if text.isdigit() else None

    with ChatServer(script) as server:
        client = client_for(server.url, cache_path=tmp_path / "c.jsonl")
        value, replies = client.ask(messages_for("q"), parse, parse_retries=2)
        assert value == 42 and len(replies) == 3 and client.stats.unparsed == 2
        assert [(b["temperature"], b.get("seed")) for b in server.requests] == [(0.0, None), (0.7, 1), (0.7, 2)]
        value, replies = client.ask(messages_for("other"), parse, parse_retries=1)
        assert value is None and [r.text for r in replies] == ["I am not sure"] * 2
        n = len(server.requests)
        assert client.ask(messages_for("q"), parse, parse_retries=2)[0] == 42 and len(server.requests) == n  # cached


def test_map_keeps_order_and_runs_concurrently():
    in_flight, peak, lock = [0], [0], threading.Lock()

    def script(body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.3)
        with lock:
            in_flight[0] -= 1
        return body["messages"][-1]["content"].upper()

    with ChatServer(script) as server:
        client = client_for(server.url, concurrency=4)
        client.chat(messages_for("warm up"))  # the first call imports openai and opens the connection pool
        start = time.perf_counter()
        out = client.map(lambda w: client.chat(messages_for(w)).text, [f"w{i}" for i in range(8)])
        wall = time.perf_counter() - start
        assert out == [f"W{i}" for i in range(8)]
        assert peak[0] == 4 and wall < 8 * 0.3 * 0.6  # 2 waves of 4, not 8 calls in a row

        def boom(w):
            raise ValueError(f"bad {w}")

        with pytest.raises(ValueError, match="bad"):
            client.map(boom, ["a", "b", "c"])


def test_openai_is_imported_lazily_and_missing_openai_says_what_to_install(monkeypatch):
    code = "import mmprm.chat, mmprm.treeval, mmprm.annotate.judge, mmprm.data.sft, sys; print('openai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r"pip install 'mmprm\[openai\]'"):
        client_for(free_port_url()).chat(messages_for("x"))


def test_config_is_checked():
    with pytest.raises(ValueError, match="scorer.judge.url and scorer.judge.model"):
        ChatClient(ChatConfig(model=""), config_key="scorer.judge")
    with pytest.raises(ValueError, match="concurrency"):
        ChatClient(ChatConfig(model="m", concurrency=0))
    assert json.dumps(client_for(free_port_url()).stats.to_json())  # the report can hold it
