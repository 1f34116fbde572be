"""A PRM trained in MM-PRM's input layout (`prm.layout=mm_prm`, recipes/configs/mm_prm/prm_train.yaml)
reads its steps as MM-PRM's own code does: InternVL's system message, an empty user turn, then in
the assistant turn the image and "Question: q\\nProcess: s1<prm>s2<prm>", Yes/No at each <prm>.

Official code: github:ModalMinds/MM-PRM@b914fd66c8efb3d6667610fba1f8fd1e55cde095:
internvl/model/internvl_chat/modeling_internvl_chat.py (`batch_prm`) and
eval/prm/evaluate_mathvista_prm.py (the prompt); `mm_prm_authors` in released_checkpoints.py
writes that procedure out on transformers' InternVL classes.
"""

from __future__ import annotations

import json

import pytest
from recipe_runs import run_recipe
from released_checkpoints import QUESTION, SOLUTIONS, build_internvl_prm, image_examples, mm_prm_authors
from test_released_prms import assert_scores_equal
from toy_data import write_toy_prm_data

from mmprm.models.prm import load_prm
from mmprm.models.spec import RELEASED_CONVENTIONS, train_step_format, trained_spec


def test_the_mm_prm_layout_is_the_released_conventions_input():
    spec = trained_spec("token_pair", ["Yes", "No"], None, "mm_prm")
    assert spec.step_format == RELEASED_CONVENTIONS["mm_prm"].step_format == train_step_format("mm_prm")
    assert spec.convention == "mmprm" and spec.reward_tokens == ["Yes", "No"] and spec.step_token == "<prm>"
    assert train_step_format("mmprm") is None  # mmprm's own layout, unchanged
    with pytest.raises(ValueError, match="system_prompt"):
        trained_spec("token_pair", ["Yes", "No"], "You are a PRM.", "mm_prm")
    with pytest.raises(ValueError, match="prm.layout"):
        train_step_format("visualprm")


@pytest.mark.slow
def test_a_prm_trained_in_the_mm_prm_layout_scores_as_mm_prms_code(tmp_path):
    base = build_internvl_prm(tmp_path / "base")  # InternVL3-shaped, <prm> in its vocabulary
    train = write_toy_prm_data(tmp_path / "data", 8, 0)
    out = tmp_path / "prm"
    run_recipe(
        "prm_train",
        f"model.name_or_path={base}",
        f"data.train_file={train}",
        f"output_dir={out}",
        "prm.layout=mm_prm",
        'prm.reward_tokens=["Yes","No"]',
        "train.max_steps=2",
        "train.batch_size=4",
        "train.lr=1e-3",
        "train.save_every=2",
        "data.max_length=512",
        "train.report_to=none",
    )
    saved = json.loads((out / "mmprm_prm.json").read_text())
    assert saved["layout"] == "plain" and saved["step_token"] == "<prm>" and saved["reward_tokens"] == ["Yes", "No"]
    scorer = load_prm(out)  # no convention: the trained PRM carries its layout
    rows = image_examples()
    text = scorer.tokenizer.decode(scorer.tokenize(rows[0]).input_ids)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\n<|im_start|>assistant\n<img><IMG_CONTEXT>" in text
    assert text.endswith("</img>\nQuestion: " + QUESTION + "\nProcess: " + "<prm>".join(SOLUTIONS[0]) + "<prm>")
    theirs = [mm_prm_authors(out, r["question"], r["steps"], r.get("images", [])) for r in rows]
    assert_scores_equal(scorer.score(rows), theirs)
