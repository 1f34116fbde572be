"""SFT data: the rule-based step splitter, converters on real GSM8K / MATH-V, loader, LLM rewriter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_data import DATA, full_or_subset

from mmprm.data.schema import DataError, StepExample, write_jsonl
from mmprm.data.sft import (
    clean_solution,
    cli_convert_sft,
    load_sft,
    parse_rewrite_reply,
    rewrite_messages,
    rewrite_with_llm,
    sft_from_gsm8k,
    sft_from_mathv,
    sft_target,
    split_sentences,
    split_solution,
)
from mmprm.steps import parse_solution, render_solution

# ------------------------------------------------------------------ splitter


def test_clean_solution():
    assert clean_solution("3 * 2 = <<3*2=6>>6 and 1/3 = <<1/3=0.3333") == "3 * 2 = 6 and 1/3 = 0.3333"
    assert (
        clean_solution("See ![](https://x/y.jpg?h=2) here. [asy]draw((0,0)--(1,1));[/asy] Done.") == "See  here.  Done."
    )


def test_split_solution_rules():
    # our tags win
    assert split_solution(render_solution(["a = 1.", "b = 2."], "3")) == (["a = 1.", "b = 2."], "3")
    # blank-line paragraphs, a display-math block stays with the sentence introducing it
    text = "We compute:\n\n\\[\n1 + 1 = 2\n\\]\n\nSo the answer is $\\boxed{2}$."
    assert split_solution(text) == (["We compute:\n\\[\n1 + 1 = 2\n\\]", "So the answer is $\\boxed{2}$."], "2")
    # lines, with a display block spread over lines kept whole
    text = "Let x = 2.\n$$\nx^2 = 4\n$$\nThus 4.\n#### 4"
    assert split_solution(text) == (["Let x = 2.\n$$\nx^2 = 4\n$$", "Thus 4."], "4")
    # sentences, never inside math; no final-answer marker -> extracted from the text
    text = "Let $x=3.$ Then $y = 2$.  So $x+y=5$. The answer is 5."
    assert split_solution(text) == (["Let $x=3.$", "Then $y = 2$.", "So $x+y=5$.", "The answer is 5."], "5")


def test_split_sentences_keeps_math_whole():
    assert split_sentences("By symmetry \\[a = b.\\] Hence $c = 1.5$. Done") == [
        "By symmetry \\[a = b.\\]",
        "Hence $c = 1.5$.",
        "Done",
    ]
    assert split_sentences("It is 3.5 m. Mr. X left.") == ["It is 3.5 m.", "Mr.", "X left."]  # no abbreviation list


# ------------------------------------------------------------------ converters on real data


def test_sft_from_gsm8k_real_answers():
    path = DATA / "gsm8k" / "test.jsonl"
    examples = sft_from_gsm8k(path)
    assert len(examples) == full_or_subset(full=1319, subset=40)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for ex, row in zip(examples, rows):
        lines = [ln for ln in row["answer"].splitlines() if ln.strip()]
        # GSM8K's solutions are one step per line, then "#### N"
        assert len(ex.steps) == len(lines) - 1, ex.id
        assert ex.answer == lines[-1].removeprefix("####").strip().replace(",", "")
        assert not any("<<" in s or ">>" in s or "####" in s for s in ex.steps)
    assert examples[0].steps == [
        "Janet sells 16 - 3 - 4 = 9 duck eggs a day.",
        "She makes 9 * 2 = $18 every day at the farmer’s market.",
    ]
    # the example-solutions file's ground_truth ("A: N") gives the same examples
    alt = sft_from_gsm8k(DATA / "gsm8k" / "example_model_solutions.jsonl")
    assert [(e.steps, e.answer) for e in alt] == [(e.steps, e.answer) for e in examples]
    # the target an SFT'd policy learns parses back to the same steps and answer
    parsed = parse_solution(sft_target(examples[5]))
    assert (parsed.steps, parsed.answer) == (examples[5].steps, examples[5].answer)


def test_sft_from_mathv_real_solutions(tmp_path):
    examples = sft_from_mathv(DATA / "mathv")
    assert len(examples) == full_or_subset(full=25, subset=17)  # the problems with a worked solution
    assert all(Path(e.images[0]).exists() for e in examples)
    assert not any("![](" in s or "[asy]" in s for e in examples for s in e.steps)
    by_id = {e.id: e for e in examples}
    assert by_id["mathv-1546"].answer == "D" and by_id["mathv-1546"].steps[-1].endswith("=40^{\\circ}$.")
    assert by_id["mathv-2955"].steps == [
        "After reflecting the point $(3,4)$ in the $x$-axis, the $x$-coordinate of the image will be the same "
        "as the $x$-coordinate of the original point, $x=3.$",
        "The original point is a distance of $4$ from the $x$-axis.",
        "The image will be the same distance from the $x$-axis, but below the $x$-axis.",
        "Thus, the image has $y$-coordinate $-4.$",
        "The coordinates of the image point are $\\boxed{(3,-4)}.$",
    ]
    out = tmp_path / "sft.jsonl"
    write_jsonl(out, examples)
    assert [e.to_json() for e in load_sft(out)] == [e.to_json() for e in examples]


def test_cli_convert_sft(tmp_path, capsys):
    out = tmp_path / "gsm8k_sft.jsonl"
    assert cli_convert_sft(["--from", "gsm8k", "--input", str(DATA / "gsm8k" / "test.jsonl"), "--out", str(out)]) == 0
    n = full_or_subset(full=1319, subset=40)
    assert f"wrote {n}" in capsys.readouterr().out
    assert len(load_sft(out)) == n


# ------------------------------------------------------------------ loader errors


def test_load_sft_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [
        {"id": "a", "question": "Q", "steps": ["s"], "answer": "1"},
        {"id": "a", "question": "Q", "steps": ["s"], "answer": "1"},
        {"id": "b", "question": "Q", "steps": ["<step>s</step>"], "answer": " "},
        {"id": "c", "question": "Q", "steps": []},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_sft(path)
    assert e.value.problems == [
        f"{path}:2: id=a: id: duplicated (first on line 1; make ids unique)",
        f"{path}:3: id=b: answer: missing or empty (SFT targets end in <answer>...</answer>; add the final answer)",
        f"{path}:3: id=b: steps: a step contains '<step>'/'</step>' (give plain step texts)",
        f"{path}:4: id=c: steps: empty list (a solution needs at least one step; drop the row)",
        f"{path}:4: id=c: answer: missing or empty (SFT targets end in <answer>...</answer>; add the final answer)",
    ]


# ------------------------------------------------------------------ LLM rewriter against a local fake server


def test_rewrite_messages_and_reply_parsing():
    msgs = rewrite_messages("What is 2+3?", "2+3=5")
    assert msgs[0]["role"] == "system" and msgs[1]["content"] == "Problem:\nWhat is 2+3?\n\nWorked solution:\n2+3=5"
    reply = "<step>Add.</step>\n<step>2+3=5.</step>\n<answer>5</answer>"
    assert parse_rewrite_reply(reply) == (["Add.", "2+3=5."], "5")
    with pytest.raises(ValueError, match="no <step> blocks"):
        parse_rewrite_reply("The answer is 5.")


def test_rewrite_with_llm(monkeypatch):
    from chat_server import ChatServer

    from mmprm.chat import ChatClient, ChatConfig, ChatRequestError, EndpointUnavailable

    replies = {"text": ""}
    with ChatServer(lambda body: replies["text"]) as server:
        monkeypatch.setenv("MMPRM_TEST_KEY", "sk-test")
        client = ChatClient(
            ChatConfig(url=server.url, model="tiny", api_key_env="MMPRM_TEST_KEY", backoff_s=0, max_retries=1),
            config_key="--rewrite",
        )
        ex = StepExample(id="g1", question="What is 2+3?", steps=["2+3=5."], answer="5", meta={"source": "t"})
        replies["text"] = "<step>Add the numbers.</step>\n<step>2 + 3 = 5.</step>\n<answer>5</answer>"
        out = rewrite_with_llm(ex, client)
        assert out.steps == ["Add the numbers.", "2 + 3 = 5."] and out.answer == "5"
        assert out.meta == {"source": "t", "rewritten_by": "tiny"}
        assert server.headers[-1]["authorization"] == "Bearer sk-test" and server.requests[-1]["model"] == "tiny"
        assert "2+3=5.\nFinal answer: 5" in server.requests[-1]["messages"][1]["content"]
        # a rewrite that changes the answer is refused
        replies["text"] = "<step>2 + 3 = 6.</step>\n<answer>6</answer>"
        with pytest.raises(ValueError, match="changed the answer"):
            rewrite_with_llm(ex, client)
        server.script = lambda body: (500, {"error": "overloaded"})
        with pytest.raises(EndpointUnavailable, match="failed 2 times, last: HTTP 500"):
            rewrite_with_llm(ex, client)
        server.script = lambda body: (400, {"error": "context too long"})
        with pytest.raises(ChatRequestError, match="HTTP 400"):
            rewrite_with_llm(ex, client)


def test_convert_sft_cli_rewrites_concurrently_and_caches(tmp_path, capsys):
    from chat_server import ChatServer

    rows = [
        {"question": f"What is {i}+1?", "answer": f"{i}+1=<<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"} for i in range(4)
    ]
    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def script(body):
        q = body["messages"][1]["content"]
        i = int(q.split("What is ")[1].split("+")[0])
        return "no steps here" if i == 2 else f"<step>Add one to {i}.</step>\n<answer>{i + 1}</answer>"

    with ChatServer(script) as server:
        argv = [
            "--from",
            "gsm8k",
            "--input",
            str(src),
            "--out",
            str(tmp_path / "sft.jsonl"),
            "--rewrite-url",
            server.url,
            "--rewrite-model",
            "m",
            "--concurrency",
            "3",
        ]
        assert cli_convert_sft(argv) == 0
        assert len(server.requests) == 4
        out = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
        assert [r["steps"] for r in out] == [["Add one to 0."], ["Add one to 1."], ["2+1=3"], ["Add one to 3."]]
        assert "rewrote 3/4 examples" in capsys.readouterr().out
        assert cli_convert_sft(argv) == 0  # the rerun is served from the reply cache
        assert len(server.requests) == 4 and "4 replies from the cache" in capsys.readouterr().out
