"""Released PRMs load and score as their authors score them.

For each convention in `mmprm.models.spec.RELEASED_CONVENTIONS` a tiny random-init checkpoint of
the released model's shape is built (`released_checkpoints`), and mmprm's scores are compared with
the authors' documented scoring procedure written out there, step for step, within 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch
from released_checkpoints import (
    QUESTION,
    QWEN_MATH_SYSTEM,
    SOLUTIONS,
    build_internlm2_internvl_prm,
    build_internvl_prm,
    build_math_shepherd,
    build_qwen_math_prm,
    build_rlhflow,
    examples,
    image_examples,
    math_shepherd_authors,
    mm_prm_authors,
    qwen_math_authors,
    rlhflow_authors,
    visualprm_authors,
)

from mmprm import load_prm
from mmprm.models.spec import RELEASED_CONVENTIONS
from mmprm.steps import StepTokenError


def assert_scores_equal(ours: list[list[float]], theirs: list[list[float]]) -> None:
    assert [len(s) for s in ours] == [len(s) for s in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), (a, b)


@pytest.fixture(scope="module")
def math_shepherd_dir(tmp_path_factory):
    return build_math_shepherd(tmp_path_factory.mktemp("math_shepherd"))


@pytest.fixture(scope="module")
def qwen_math_prm(tmp_path_factory):
    return build_qwen_math_prm(tmp_path_factory.mktemp("qwen_math_prm"))


@pytest.fixture(scope="module")
def rlhflow_dir(tmp_path_factory):
    return build_rlhflow(tmp_path_factory.mktemp("rlhflow"))


@pytest.fixture(scope="module")
def internvl_prm_dir(tmp_path_factory):
    return build_internvl_prm(tmp_path_factory.mktemp("internvl_prm"))


@pytest.fixture(scope="module")
def internlm2_prm_dir(tmp_path_factory):
    return build_internlm2_internvl_prm(tmp_path_factory.mktemp("internlm2_prm"))


def test_math_shepherd_tokenizer_has_the_released_shape(math_shepherd_dir):
    """What the model card relies on holds for the tiny one too: "+ -" is BOS and two tokens,
    "ки" one token, the same one as after a step."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(math_shepherd_dir)
    assert len(tok.encode("+ -")) == 3 and tok.encode("+ -")[0] == tok.bos_token_id
    assert len(tok.encode("ки", add_special_tokens=False)) == 1
    assert tok.encode("2 = 2. ки", add_special_tokens=False)[-1] == tok.encode("ки")[-1]


def test_math_shepherd_scores_equal_the_authors_procedure(math_shepherd_dir):
    scorer = load_prm(math_shepherd_dir, convention="math_shepherd")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [math_shepherd_authors(math_shepherd_dir, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)
    assert_scores_equal(scorer.score(rows, share_prefix=False), theirs)  # grouping changes nothing


def test_qwen_math_prm_scores_equal_the_authors_procedure(qwen_math_prm):
    path, model = qwen_math_prm
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForProcessRewardModel"]
    scorer = load_prm(path, convention="qwen2_5_math_prm")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [qwen_math_authors(model, path, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)
    assert scorer.model.spec.system_prompt == QWEN_MATH_SYSTEM


def test_rlhflow_scores_equal_the_authors_procedure(rlhflow_dir):
    scorer = load_prm(rlhflow_dir, convention="rlhflow")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [rlhflow_authors(rlhflow_dir, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)


def test_rlhflow_input_carries_the_templates_default_system_prompt(rlhflow_dir):
    """Llama 3.1's template writes its own system header; the steps are read after it."""
    scorer = load_prm(rlhflow_dir, convention="rlhflow")
    tok = scorer.tokenize({"question": QUESTION, "steps": SOLUTIONS[0]})
    text = scorer.tokenizer.decode(tok.input_ids)
    assert "Cutting Knowledge Date" in text
    assert len(tok.step_positions) == 3
    plus = scorer.tokenizer.encode("+", add_special_tokens=False)[-1]
    assert all(tok.input_ids[p + 1] == plus for p in tok.step_positions[:-1])


@pytest.mark.parametrize("shape", ["qwen2", "internlm2"])
@pytest.mark.parametrize(("convention", "authors"), [("mm_prm", mm_prm_authors), ("visualprm", visualprm_authors)])
def test_internvl_prms_score_as_their_remote_code_does(internvl_prm_dir, internlm2_prm_dir, shape, convention, authors):
    """MM-PRM's and VisualPRM's prompts, with and without a figure, candidates grouped or alone;
    on InternVL3's shape (VisualPRM-8B-v1_1) and InternLM2's (MM-PRM-8B, VisualPRM-8B: its
    tokenizer puts BOS in front, as the authors' `tokenizer(query)` does)."""
    path = internvl_prm_dir if shape == "qwen2" else internlm2_prm_dir
    scorer = load_prm(path, convention=convention)
    rows = image_examples()
    theirs = [authors(path, r["question"], r["steps"], r.get("images", [])) for r in rows]
    assert_scores_equal(scorer.score(rows), theirs)
    assert_scores_equal(scorer.score(rows, share_prefix=False), theirs)


def test_mm_prm_prompt_is_its_own_not_the_chat_template(internvl_prm_dir):
    """The empty user turn stays open and the steps sit in the assistant turn, as MM-PRM writes it."""
    scorer = load_prm(internvl_prm_dir, convention="mm_prm")
    rows = image_examples()
    tok = scorer.tokenize(rows[0])
    text = scorer.tokenizer.decode(tok.input_ids)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\n<|im_start|>assistant\n<img><IMG_CONTEXT>" in text
    assert text.endswith("</img>\nQuestion: " + QUESTION + "\nProcess: " + "<prm>".join(SOLUTIONS[0]) + "<prm>")


def test_a_released_checkpoint_without_convention_is_refused_naming_the_conventions(rlhflow_dir):
    with pytest.raises(FileNotFoundError, match="convention") as err:
        load_prm(rlhflow_dir)
    assert all(name in str(err.value) for name in RELEASED_CONVENTIONS)


def test_a_wrong_convention_is_refused_before_scoring(rlhflow_dir, math_shepherd_dir):
    with pytest.raises(StepTokenError, match="not one token"):
        load_prm(rlhflow_dir, convention="math_shepherd")  # Llama 3's vocabulary has no "ки" token
    with pytest.raises(ValueError, match="classifier head"):
        load_prm(math_shepherd_dir, convention="qwen2_5_math_prm")  # no score.* weights
    with pytest.raises(ValueError, match="convention: 'visualprm_v2'"):
        load_prm(math_shepherd_dir, convention="visualprm_v2")
    with pytest.raises(StepTokenError, match="not one token"):
        load_prm(math_shepherd_dir, convention="mm_prm")  # no <prm> token


def test_bon_rerank_scores_candidates_with_a_released_prm(qwen_math_prm, tmp_path):
    """`scoring.convention` reaches the recipe's scorer: the step scores it writes are the authors'."""

    from recipe_runs import REPO, load_recipe

    from mmprm.data.schema import read_jsonl
    from mmprm.rerank.candidates import Candidate, ProblemWithCandidates, write_candidates

    path, model = qwen_math_prm
    problems = [
        ProblemWithCandidates(
            id="p0",
            question=QUESTION,
            answer="8",
            candidates=[
                Candidate(text=None, steps=SOLUTIONS[0], answer="8", correct=True),
                Candidate(text=None, steps=SOLUTIONS[1], answer="9", correct=False),
            ],
        )
    ]
    write_candidates(tmp_path / "c.jsonl", problems)
    load_recipe("bon_rerank").main(
        [
            "--config",
            str(REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml"),
            f"prm.path={path}",
            "prm.convention=qwen2_5_math_prm",
            f"candidates_file={tmp_path / 'c.jsonl'}",
            f"output_dir={tmp_path / 'out'}",
            "report.resamples=10",
        ]
    )
    (row,) = read_jsonl(tmp_path / "out" / "scored.jsonl")
    ours = [c["step_probs"] for c in row["candidates"]]
    theirs = [qwen_math_authors(model, path, QUESTION, c.steps) for c in problems[0].candidates]
    assert_scores_equal(ours, theirs)
