"""MathVista and MathVerse read and scored as their official code does, on their released rows.

The references below re-express, independently of mmprm, what each benchmark's own evaluation code
computes:

* MathVista: github:lupantech/MathVista@53d525874bdde205128e6b160b7357a88277d479:
  evaluation/calculate_score.py `normalize_extracted_answer` (run with its default
  `ignore_empty_extractions=False`) and `safe_equal`; the prompt fed to a model is the row's
  `query`, shipped as data/query.json beside data/testmini.json.
* MathVerse: github:ZrrSkywalker/MathVerse@937b090597aeafb8e82b35d310a4bc5b9e2ea29d:
  evaluation/prompts.py `demo_prompt_score`, whose five examples carry the judge's verdicts, and
  data/testmini_text_only.json, whose questions list options inline ("A. ... B. ...") or after
  "Choices:".
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from mmprm.data.eval_sets import answer_correct, read_mathvista
from mmprm.data.eval_sets.mathvista import edit_distance, mathvista_prediction

FIX = Path(__file__).parent / "fixtures" / "eval_sets"


# ---- the official procedures (no mmprm code in them)


def calculate_score_normalize(extraction, choices, question_type, answer_type, precision):
    """MathVista's normalize_extracted_answer (calculate_score.py, ignore_empty_extractions=False)."""
    if question_type == "multi_choice":
        extraction = extraction.strip() if isinstance(extraction, str) else str(extraction)
        letter = re.findall(r"\(([a-zA-Z])\)", extraction)
        if len(letter) > 0:
            extraction = letter[0].upper()
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in letters:
            return choices[letters.index(extraction)]
        distances = [edit_distance(extraction, c) for c in choices]  # Levenshtein.distance
        return choices[distances.index(min(distances))]
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))
        return str(extraction)
    except Exception:
        return None


# ---- MathVista


def test_mathvista_query_is_read_beside_the_data_not_the_images(tmp_path):
    """MathVista's `query` (with the hint line MM-PRM feeds) comes from data/query.json beside the
    rows, also when the images were unzipped somewhere else (`image_root`)."""
    queries = json.loads((FIX / "mathvista" / "query.json").read_text(encoding="utf-8"))
    images = tmp_path / "elsewhere"
    shutil.copytree(FIX / "mathvista" / "images", images / "images")
    rows = read_mathvista(FIX / "mathvista", image_root=images)
    assert [r["question"] for r in rows] == [queries[r["id"]] for r in rows]
    assert all(r["question"].startswith("Hint: ") for r in rows)
    assert all(Path(r["images"][0]).parent == images / "images" for r in rows)


def test_mathvista_normalisation_is_calculate_scores():
    """Our normalisation and verdict equal calculate_score.py's on every shipped row, for the released
    Bard extractions and for the cases the official code settles its own way: a letter in brackets
    only when it is an ASCII letter, an empty extraction mapped to the nearest choice, a float
    answer without a precision never scored."""
    rows = json.loads((FIX / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
    bard = json.loads((FIX / "mathvista" / "results" / "bard" / "output_bard.json").read_text(encoding="utf-8"))
    problems = {r["id"]: r for r in read_mathvista(FIX / "mathvista")}
    extra = ["", "(é) 145°", "(Б)", "(b)", "(B) 140°", "(α) 12cm", "1.24", "7.0", "abc", "[2014, 2016]"]
    cases = 0
    for pid, r in rows.items():
        for ext in [bard[pid]["extraction"], *extra]:
            args = (ext, r["choices"], r["question_type"], r["answer_type"], r["precision"])
            want = calculate_score_normalize(*args)
            assert mathvista_prediction(*args) == want, (pid, ext)
            assert answer_correct(ext or None, problems[pid]) is (want == r["answer"]), (pid, ext)
            cases += 1
    assert cases == 15 * 11
    # the three cases named above, on real rows: 3 (145°), 5 (97, the shortest choice), 1 (precision 1)
    assert mathvista_prediction("(é) 145°", rows["3"]["choices"], "multi_choice", "text", None) == "145°"
    assert answer_correct(None, problems["5"]) and answer_correct("", problems["6"])
    assert not answer_correct(None, problems["334"])  # "" is nearer "No" than "Yes"
    assert mathvista_prediction("1.24", None, "free_form", "float", None) is None
    no_precision = {**problems["1"], "meta": {**problems["1"]["meta"], "precision": None}}
    assert not answer_correct("1.2", no_precision)
