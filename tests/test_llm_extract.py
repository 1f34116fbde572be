"""LLM answer extraction as MathVista and MathVerse run it, against a scripted OpenAI-compatible
endpoint on 127.0.0.1: the exact prompts sent (few-shot demos included) and the verdicts.

Official code: github:lupantech/MathVista@53d525874bdde205128e6b160b7357a88277d479:
evaluation/extract_answer.py and evaluation/prompts/ext_ans.py; github:ZrrSkywalker/MathVerse@
937b090597aeafb8e82b35d310a4bc5b9e2ea29d:evaluation/extract_answer_s1.py, score_answer_s2.py and
prompts.py. The hashes below are of the prompt strings as Python evaluates those files.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from chat_server import ChatServer
from recipe_runs import REPO, load_recipe

from mmprm.chat import ChatClient, ChatConfig
from mmprm.data.eval_sets import read_eval_set
from mmprm.data.eval_sets.llm_extract import (
    MATHVERSE_EXTRACT_PROMPT,
    MATHVERSE_SCORE_PROMPT,
    MATHVISTA_DEMO_PROMPT,
    llm_answer_correct,
)

FIX = REPO / "tests" / "fixtures" / "eval_sets"
MATHVERSE_SOURCE = FIX / "mathverse" / "output_templates" / "output_testmini.json"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_prompt_texts_are_the_benchmarks_own():
    assert sha(MATHVISTA_DEMO_PROMPT) == "a231722ced09cbd1f3fd16630ab58bf487f12e2f46ea0b26d1f2f6b5c50fb17c"
    assert sha(MATHVERSE_EXTRACT_PROMPT) == "e7b0086e2821ee7e9f591041447c0a1c93039a6627ecca508562ed9996abeb95"
    assert sha(MATHVERSE_SCORE_PROMPT) == "ce52e96ea6f99eede127414b261c61457a3b92fe8bb779916b7065d533a4230d"


def client_for(server: ChatServer, tmp_path) -> ChatClient:
    cfg = ChatConfig(url=server.url, model="judge", concurrency=1, max_retries=0)
    return ChatClient(cfg, config_key="generate.judge", cache_path=tmp_path / "cache.jsonl")


def mathvista_rows() -> dict[str, dict]:
    return {p["id"]: p for p in read_eval_set("mathvista", FIX / "mathvista")}


def test_mathvista_sends_its_demos_query_and_response_and_scores_the_extraction(tmp_path):
    rows = mathvista_rows()
    mc, flt = rows["3"], rows["1"]  # multi_choice 145° (option C); float 1.2 at precision 1
    replies = {"So the angle is 145 degrees, option (C).": "(C) 145°", "The value is about 1.23 cm.": "1.23"}
    with ChatServer(lambda body: replies[body["messages"][0]["content"].split("\n\n")[-2]]) as server:
        client = client_for(server, tmp_path)
        v_mc = llm_answer_correct(client, "So the angle is 145 degrees, option (C).", mc)
        v_flt = llm_answer_correct(client, "The value is about 1.23 cm.", flt)
        # MathVista's rules before the LLM: a reply that is a choice, or a number of the answer's type.
        v_choice = llm_answer_correct(client, "140°", mc)
        v_int = llm_answer_correct(client, "1000", rows["2"])
        v_empty = llm_answer_correct(client, "", rows["2"])
    assert (v_mc.correct, v_mc.extraction) == (True, "(C) 145°")
    assert (v_flt.correct, v_flt.extraction) == (True, "1.23")  # round(1.23, 1) == 1.2
    assert (v_choice.correct, v_choice.requests) == (False, 0)
    assert (v_int.correct, v_int.extraction, v_int.requests) == (True, "1000", 0)
    assert (v_empty.correct, v_empty.extraction, v_empty.requests) == (False, "", 0)
    assert len(server.requests) == 2
    body = server.requests[0]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 1024 and len(body["messages"]) == 1
    assert body["messages"][0]["role"] == "user"
    prompt = body["messages"][0]["content"]
    # The demos first, then the problem's query (hint, question, choices), the reply, the cue.
    assert prompt == (
        MATHVISTA_DEMO_PROMPT.strip()
        + "\n\n"
        + mc["question"]
        + "\n\nSo the angle is 145 degrees, option (C).\n\nExtracted answer: "
    )
    assert prompt.startswith("Please read the following example. Then extract the answer from the model response")
    assert "Question: What fraction of the shape is blue?\nChoices:\n(A) 3/11\n(B) 8/11" in prompt
    assert (
        "Model response: The line graph saw its maximum peak between 2007 and 2008.\n\nExtracted answer: [2007, 2008]"
        in prompt
    )
    assert mc["question"].startswith("Hint: Please answer the question and provide the correct option letter")


def mathverse_script(extracted: dict[str, str], judged: dict[str, str]):
    """Step 1: the reply's extraction (with the prefix GPT sometimes repeats); step 2: a judgement."""

    def script(body):
        prompt = body["messages"][0]["content"]
        if prompt.endswith("Judgement:"):  # the template is stripped before .format()
            model_answer = prompt.rsplit("[Model_answer] : ", 1)[1].split("\n", 1)[0]
            return judged[model_answer]
        response = prompt.rsplit("Model response: '", 1)[1].rsplit("'\nExtracted Answer: ", 1)[0]
        return "Extracted Answer: " + extracted[response]

    return script


def test_mathverse_extracts_then_judges_with_its_prompts(tmp_path):
    row = read_eval_set("mathverse", MATHVERSE_SOURCE, image_root=FIX / "mathverse")[0]
    raw_question = json.loads(MATHVERSE_SOURCE.read_text())[0]["question"]
    extracted = {"Thus x = 14.": "14", "Hence 15.": "15", "I cannot tell.": "null"}
    judged = {"14": "Judgement: 1", "15": "0", "null": "maybe"}
    with ChatServer(mathverse_script(extracted, judged)) as server:
        client = client_for(server, tmp_path)
        right = llm_answer_correct(client, "Thus x = 14.", row)
        wrong = llm_answer_correct(client, "Hence 15.", row)
        unreadable = llm_answer_correct(client, "I cannot tell.", row)
    assert (right.correct, right.extraction, right.judgement, right.requests) == (True, "14", "1", 2)
    assert (wrong.correct, wrong.judgement) == (False, "0")
    # An unreadable judgement is asked again (2 more times) and then counts as wrong.
    assert (unreadable.correct, unreadable.judgement, unreadable.requests) == (False, None, 4)
    step1, step2 = server.requests[0], server.requests[1]
    assert step1["max_tokens"] == step2["max_tokens"] == 256 and step1["temperature"] == 0.0
    assert step1["messages"] == [
        {
            "role": "user",
            "content": MATHVERSE_EXTRACT_PROMPT.strip() + "\n\nModel response: 'Thus x = 14.'\nExtracted Answer: ",
        }
    ]
    p1 = step1["messages"][0]["content"]
    assert "5.\nModel response: 'Given that AB = 17.6 meters" in p1 and "d = 17.6 / cos(38\u00b0)" in p1
    assert p1.startswith("I am providing you a response from a model to a math problem, termed 'Model Response'.")
    p2 = step2["messages"][0]["content"]
    # The judge reads the raw question (not the CoT query), the standard answer and the extraction.
    assert p2.endswith(f"[Question]: {raw_question}\n[Standard Answer]: 14\n[Model_answer] : 14\nJudgement:")
    assert row["question"] != raw_question
    # The score demos as .format() leaves them: "{{3}}" is "{3}", "\\(" is "\(".
    assert "[Model_answer] : B:2\u221a{3}\nJudgement: 0" in p2
    assert "[Model_answer] : Extracted Answer: \\((-2, 1)\\)\nJudgement: 0" in p2
    assert p2.count("Judgement:") == 6


def test_a_problem_without_an_llm_protocol_is_refused_by_id(tmp_path):
    with ChatServer(lambda body: "x") as server:
        client = client_for(server, tmp_path)
        with pytest.raises(ValueError, match=r"id=q1: .*mathverse and mathvista.*extraction=rules"):
            llm_answer_correct(client, "reply", {"id": "q1", "answer": "1", "meta": {"source": "mathvision"}})
    assert server.requests == []


def test_bon_rerank_refuses_llm_extraction_without_an_endpoint_or_for_other_benchmarks():
    from mmprm.config import ConfigError, load_config

    mod = load_recipe("bon_rerank")
    base = ["prm.path=p", "generate.enabled=true", "policy.path=x", "generate.extraction=llm"]
    with pytest.raises((ConfigError, ValueError), match="generate.judge.url and generate.judge.model"):
        load_config(mod.BonRerankConfig, None, [*base, "generate.benchmark.name=mathverse"])
    with pytest.raises((ConfigError, ValueError), match="mathvision has no LLM extraction"):
        load_config(mod.BonRerankConfig, None, [*base, "generate.benchmark.name=mathvision", "generate.judge.model=m"])


@pytest.mark.slow
def test_bon_rerank_judges_candidates_by_the_llm_and_its_report_says_so(tiny_models, tmp_path):
    """Best-of-2 on two MathVerse problems: the verdicts are the scripted judge's, the report names it."""
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm
    from mmprm.rerank.candidates import load_candidates

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    prm = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")

    def script(body):  # extraction: the reply's length; judged right when it is even
        prompt = body["messages"][0]["content"]
        if prompt.endswith("Judgement:"):
            return "1" if int(prompt.rsplit("[Model_answer] : ", 1)[1].split("\n", 1)[0]) % 2 == 0 else "0"
        return str(len(prompt.rsplit("Model response: '", 1)[1].rsplit("'\nExtracted Answer: ", 1)[0]))

    out = tmp_path / "bon"
    with ChatServer(script) as server:
        load_recipe("bon_rerank").main(
            [
                "--config",
                str(REPO / "recipes" / "configs" / "qwen2_5_vl_7b" / "benchmarks" / "bon_rerank.yaml"),
                f"prm.path={prm}",
                f"policy.path={tiny_models('qwen2_vl')}",
                "policy.backend=hf",
                "generate.benchmark.name=mathverse",
                f"generate.benchmark.source={MATHVERSE_SOURCE}",
                f"generate.benchmark.image_root={FIX / 'mathverse'}",
                "generate.benchmark.limit=2",
                "generate.n=2",
                "policy.sampling.max_new_tokens=8",
                "generate.extraction=llm",
                f"generate.judge.url={server.url}",
                "generate.judge.model=judge",
                "generate.judge.concurrency=1",
                "prm.max_length=null",
                "prm.device=cpu",
                "model.attn_implementation=sdpa",
                "report.resamples=20",
                f"output_dir={out}",
            ]
        )
    assert server.requests  # identical requests are answered from the cache
    cands = [c for p in load_candidates(out / "candidates.jsonl") for c in p.candidates]
    assert len(cands) == 4
    for c in cands:
        assert c.meta["extraction"] == str(len(c.text))
        assert c.correct == (len(c.text) % 2 == 0)
    report = json.loads((out / "report.json").read_text())
    assert report["extraction"].startswith("llm (judge at http://127.0.0.1:")
    assert "Answers extracted and judged by: llm (judge" in (out / "report.md").read_text()
