"""PRM data importers: real openr samples with hand-checked steps/labels, hand-written TRL and MM-PRM rows."""

import json
from pathlib import Path

import pytest
from PIL import Image
from real_data import DATA as REAL_DATA

from mmprm.cli import main
from mmprm.data.convert import (
    RowError,
    convert_file,
    convert_math_shepherd,
    convert_mmprm_prm,
    convert_openr_flat,
    convert_prm800k,
    convert_trl,
    split_math_shepherd,
)
from mmprm.data.schema import check_row, load_examples

DATA = REAL_DATA / "openr_samples"  # unchanged copies in the repo subset


def _all_valid(result):
    """Every example passes the schema check and ids are unique."""
    for e in result.examples:
        assert check_row(e.to_json(), Path("/"), require_labels=True)[0] == []
    assert len({e.id for e in result.examples}) == len(result.examples)


# --- Math-Shepherd ---------------------------------------------------------------------------


def test_math_shepherd_real_sample():
    r = convert_file("math_shepherd", DATA / "samples_math-shepherd.jsonl")
    assert (r.rows, len(r.examples), r.skipped) == (7, 7, [])
    e = r.examples[0]
    assert e.question.startswith("Janet pays $40/hour")
    assert e.question.endswith("How much more does she spend on piano lessons than clarinet lessons in a year?")
    assert e.steps[0] == "Janet spends 3 hours + 5 hours = <<3+5=8>>8 hours per week on music lessons."
    assert e.steps[4] == (
        "She spends 260 * 52 = <<260*52=13520>>13520 on music lessons in a year. The answer is: 13520"
    )
    assert e.labels == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert e.answer is None and e.meta == {"source": "math_shepherd", "task": "GSM8K"}
    buzz = r.examples[4]  # "+" then four "-"
    assert buzz.labels == [1.0, 0.0, 0.0, 0.0, 0.0] and buzz.steps[1].startswith("The waiter ate 13 x 8 / 13")
    assert [len(x.steps) for x in r.examples] == [5, 3, 2, 5, 5, 2, 3]
    _all_valid(r)


def test_math_shepherd_split_and_bad_rows():
    q, steps, ys = split_math_shepherd(
        "Q has Step 1: in it? Step 1: a ки\nStep 2: b ки", "Q has Step 1: in it? Step 1: a -\nStep 2: b +"
    )
    assert (q, steps, ys) == ("Q has Step 1: in it?", ["a", "b"], [0.0, 1.0])
    bad = {
        "label differs": ("Q? Step 1: a ки", "Q? Step 1: b +"),
        "tag not +/-": ("Q? Step 1: a ки", "Q? Step 1: a ?"),
        "trailing text": ("Q? Step 1: a ки\nStep 2: b", "Q? Step 1: a +\nStep 2: b"),
        "no step 1": ("Q? a ки", "Q? a +"),
        "no tags": ("Q? Step 1: a", "Q? Step 1: a"),
    }
    for _name, (text, label) in bad.items():
        with pytest.raises(RowError):
            split_math_shepherd(text, label)
    rows = [{"input": t, "label": lab} for t, lab in bad.values()]
    r = convert_math_shepherd(rows + [{"input": "Q? Step 1: a ки", "label": "Q? Step 1: a +"}], source="ms.jsonl")
    assert len(r.examples) == 1 and r.examples[0].id == "math_shepherd-6" and len(r.skipped) == 5
    assert r.skipped[0].startswith("ms.jsonl:1: id=math_shepherd-1: label: ")


# --- PRM800K ---------------------------------------------------------------------------------


def test_prm800k_real_sample_followed_path():
    r = convert_file("prm800k", DATA / "samples_prm800k.jsonl")
    assert (len(r.examples), r.skipped) == (6, [])
    first = r.examples[0]
    assert first.question.startswith("Three pencils and a jumbo eraser cost") and first.answer == "29"
    # step 1 had no chosen completion: the human-written step is followed (rating null -> 1.0)
    assert first.steps[1] == "We have $3p+e=1.24$ and $5p+e=1.82$."
    assert first.steps[5] == "That means a pencil costs 29 cents.\n\n# Answer\n\n29"  # chosen_completion 4
    assert first.labels == [1.0] * 6
    err = r.examples[1]  # found_error: 6 rated steps (step 1 neutral) then the -1 pre-generated step
    assert err.labels == [1.0] * 6 + [0.0] and err.meta["finish_reason"] == "found_error"
    assert err.steps[-1].startswith("For the Democrats, there are 5! ways to order them in a line, but only half")
    gave_up = r.examples[4]  # give_up: stops at the step with null completions
    assert len(gave_up.steps) == 8 and gave_up.steps[-1].startswith("By symmetry, we have that")
    assert [len(e.steps) for e in r.examples] == [6, 7, 5, 7, 8, 12]
    neutral0 = convert_file("prm800k", DATA / "samples_prm800k.jsonl", neutral=0.0)
    assert neutral0.examples[1].labels == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    alts = convert_file("prm800k", DATA / "samples_prm800k.jsonl", alternatives=True)
    rejected = [e for e in alts.examples if e.id.startswith("prm800k-1-alt1-")]
    assert len(rejected) == 5 and all(e.labels == [1.0, 0.0] for e in rejected)
    assert rejected[0].steps[1] == "The first equation is 3p + e = 124, and the second equation is 5p + e = 182."
    _all_valid(alts)


def _prm800k_row(steps, finish="solution"):
    return {
        "question": {"problem": "1+1?", "ground_truth_answer": "2"},
        "label": {"steps": steps, "finish_reason": finish},
    }


def _step(*ratings, chosen=0, human=None):
    return {
        "completions": [{"text": f"s{r}", "rating": r} for r in ratings],
        "chosen_completion": chosen,
        "human_completion": human,
    }


def test_prm800k_hand_rows():
    rows = [
        _prm800k_row([_step(1), _step(-1), _step(1)]),  # a chosen -1 step ends the path
        _prm800k_row([_step(1)], finish="bad_problem"),
        _prm800k_row([_step(1, chosen=3)]),
        _prm800k_row([_step(1, 0, chosen=None)], finish="give_up"),
        _prm800k_row([_step(1), _step(1, chosen=None)], finish="found_error"),
        _prm800k_row([_step(2)]),
    ]
    r = convert_prm800k(rows, source="p.jsonl")
    assert [e.labels for e in r.examples] == [[1.0, 0.0]]
    assert r.examples[0].meta["ended"] == "stopped at -1"
    assert len(r.skipped) == 5
    assert r.skipped[0].startswith("p.jsonl:2: id=prm800k-2: label.finish_reason: 'bad_problem'")
    assert "chosen_completion: 3 is not an index into 1 completions" in r.skipped[1]
    assert r.reasons["no labelled steps"] == 1 and r.reasons["found_error without a -1 step"] == 1
    assert "rating 2 is not -1, 0 or 1" in r.skipped[4]
    with pytest.raises(ValueError, match="outside"):
        convert_prm800k(rows, neutral=2.0)


# --- openr trees and flat prefixes -----------------------------------------------------------


def test_openr_tree_real_sample():
    r = convert_file("openr_tree", DATA / "samples_math-aps-tree.jsonl")
    root = json.loads((DATA / "samples_math-aps-tree.jsonl").read_text().splitlines()[0])["reasoning_steps"]
    # 137 + 85 + 20 leaves, of which 59 + 82 + 19 distinct root-to-leaf paths
    assert len(r.examples) == 160 and r.notes["duplicate path merged (labels averaged)"] == 82
    first = r.examples[0]
    assert first.id == "0-0" and first.answer == "3" and first.question == root["text"]
    assert first.steps == [root["children"][0]["text"].strip()] and first.labels == [1.0]
    deep = next(e for e in r.examples if e.id == "0-53")
    assert deep.labels == [0.96875, 0.78125, 0.65625, 1.0]
    assert deep.steps[1].startswith("Combining like terms, we get:\n\\[ -322c + 966 = 0. \\]\n\nNext, we isolate")
    assert deep.steps[3] == "}\n\nTherefore, the value of \\( c \\) is \\(\\boxed{3}\\)."
    # question_id 1 appears on two lines with different questions: ids stay unique
    melinda = [e for e in r.examples if e.question.startswith("Melinda")]
    assert len(melinda) == 19 and melinda[0].id == "1-82"
    _all_valid(r)


def test_openr_flat_real_sample():
    path = DATA / "samples_math-aps.jsonl"
    r = convert_file("openr_flat", path)
    assert [sum(e.meta["question_id"] == q for e in r.examples) for q in "23"] == [81, 7 + 36]
    assert len(r.examples) == 124 and r.notes["duplicate prefix merged (values averaged)"] == 10
    e = next(x for x in r.examples if x.id == "2-77")
    # 0.046875 = mean of the two listed values (0.0, 0.09375) of the same prefix
    assert e.labels == [0.9375, 0.625, 0.046875, 1.0] and e.answer == "64"
    assert e.steps[0].startswith("Given the inequality")
    assert e.steps[3].startswith("However, since \\(c\\) is the root")
    # every step boundary is a listed prefix, labelled with that prefix's (mean) mc_value
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for ex in r.examples:
        row = next(x for x in rows if x["question"] == ex.question)
        values = {}
        for item in row["reasoning_steps"]:
            values.setdefault(" ".join(item["solution_prefix"].split()), []).append(item["mc_value"])
        for k in range(len(ex.steps)):
            key = " ".join((ex.question + " " + " ".join(ex.steps[: k + 1])).split())
            assert ex.labels[k] == pytest.approx(sum(values[key]) / len(values[key]))
    _all_valid(r)


def test_openr_flat_needs_a_whitespace_boundary():
    rows = [
        {
            "question": "Q?",
            "question_id": 7,
            "final_answer": "30",
            "reasoning_steps": [
                {"solution_prefix": "Q?", "mc_value": 0.5},
                {"solution_prefix": "Q?\n\nx = 3", "mc_value": 0.25},
                {"solution_prefix": "Q?\n\nx = 30", "mc_value": 1.0},  # not a child of "x = 3"
                {"solution_prefix": "Q?\n\nx = 3\n\nso 9", "mc_value": 0.0},
                {"solution_prefix": "elsewhere", "mc_value": 0.0},
            ],
        }
    ]
    r = convert_openr_flat(rows)
    assert [(e.id, e.steps, e.labels) for e in r.examples] == [
        ("7-0", ["x = 30"], [1.0]),
        ("7-1", ["x = 3", "so 9"], [0.25, 0.0]),
    ]
    assert r.notes["prefix without the question text dropped"] == 1


# --- TRL and MM-PRM, hand-written rows -------------------------------------------------------


@pytest.fixture
def image(tmp_path):
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "fig.png")
    return tmp_path


def test_trl_rows(image):
    rows = [
        {
            "prompt": "<image> Sum of bars?",
            "completions": ["A is 7.", "B is 5.", "7+5=12."],
            "labels": [True, True, False],
            "images": ["fig.png"],
        },
        {"prompt": "2+2?", "completions": ["2+2=4.", "  "], "labels": [True, False]},
        {"prompt": "x?", "completions": ["a"], "labels": [True, False]},
        {"prompt": [{"role": "user", "content": "hi"}], "completions": ["a"], "labels": [True]},
        {"prompt": "y?", "completions": ["a"], "labels": ["yes"]},
        {"prompt": "<image> z?", "completions": ["a"], "labels": [True], "images": ["missing.png"]},
    ]
    r = convert_trl(rows, source="trl.jsonl", image_root=image)
    assert [(e.id, e.labels) for e in r.examples] == [("trl-1", [1.0, 1.0, 0.0]), ("trl-2", [1.0])]
    assert r.examples[0].images == [str((image / "fig.png").resolve())]
    assert r.notes["empty step dropped (with its label)"] == 1
    assert r.skipped[0] == ("trl.jsonl:3: id=trl-3: labels: 2 labels for 1 completions (give one label per step)")
    assert "prompt: missing or not a string" in r.skipped[1]
    assert "labels[0]: 'yes' is not a bool" in r.skipped[2]
    assert r.skipped[3].startswith("trl.jsonl:6: id=trl-6: images[0]: image not found")
    unchecked = convert_trl(rows[5:], image_root=image, check_images=False)
    assert len(unchecked.examples) == 1


def test_trl_from_a_datasets_folder_extracts_embedded_images(image, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(
        [{"prompt": "q?", "completions": ["a", "b"], "labels": [True, False], "images": [str(image / "fig.png")]}]
    )
    ds.cast_column("images", datasets.List(datasets.Image())).save_to_disk(str(image / "ds"))  # embeds bytes
    kept = convert_file("trl", image / "ds")
    assert kept.examples == [] and kept.reasons["embedded image bytes"] == 1
    r = convert_file("trl", image / "ds", image_dir=tmp_path / "imgs")
    ((steps, labels, images),) = [(e.steps, e.labels, e.images) for e in r.examples]
    assert (steps, labels) == (["a", "b"], [1.0, 0.0])
    assert Path(images[0]).parent == (tmp_path / "imgs").resolve()
    assert Path(images[0]).read_bytes() == (image / "fig.png").read_bytes()


def test_mmprm_prm_rows(image):
    rows = [
        {
            "question": "<image>\nArea?",
            "image": "fig.png",
            "process": "w=2<prm>h=3<prm>A=6<prm>",
            "labels": [1.0, 0.75, 0.5],
        },
        {"prompt": "Sum?", "response": "a<prm><prm>b", "labels": [0.9, 0.1, 0.2]},
        {"question": "Q?", "process": "a<prm>b<prm>The answer is 3", "labels": [1.0, 0.0]},
        {
            "id": 9,
            "image": "fig.png",
            "conversations": [
                {"from": "human", "value": "<image>\nQuestion: What?\nProcess: s1<prm>s2<prm>"},
                {"from": "gpt", "value": [0.25, 0.0]},
            ],
        },
        {"question": "Q?", "process": "a<prm>", "labels": [1.5]},
    ]
    r = convert_mmprm_prm(rows, source="mm.json", image_root=image)
    got = [(e.id, e.question, e.steps, e.labels) for e in r.examples]
    assert got == [
        ("mmprm_prm-1", "<image>\nArea?", ["w=2", "h=3", "A=6"], [1.0, 0.75, 0.5]),
        ("mmprm_prm-2", "Sum?", ["a", "b"], [0.9, 0.2]),
        ("9", "What?", ["s1", "s2"], [0.25, 0.0]),
    ]
    assert r.skipped[0] == (
        "mm.json:3: id=mmprm_prm-3: labels: 2 labels for 3 steps split on '<prm>' "
        "(fix the separator with --separator or the label list)"
    )
    assert "labels[0]: 1.5 is not a bool or a number in [0,1]" in r.skipped[1]
    r2 = convert_mmprm_prm([{"question": "Q?", "process": "a\n\nb", "labels": [1, 0]}], separator="\n\n")
    assert r2.examples[0].steps == ["a", "b"] and r2.examples[0].labels == [1.0, 0.0]


# --- CLI -------------------------------------------------------------------------------------


def test_cli_round_trip(tmp_path, capsys):
    out = tmp_path / "out" / "shepherd.jsonl"
    rc = main(
        [
            "convert",
            "--from",
            "math_shepherd",
            "--input",
            str(DATA / "samples_math-shepherd.jsonl"),
            "--out",
            str(out),
            "--id-prefix",
            "ms-",
        ]
    )
    assert rc == 0
    assert "read 7 rows -> 7 examples (25 steps); skipped 0 rows" in capsys.readouterr().err
    loaded = load_examples(out, require_labels=True)
    assert [e.id for e in loaded][:2] == ["ms-math_shepherd-1", "ms-math_shepherd-2"]
    assert loaded[0].labels == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_cli_json_array_input_and_failures(tmp_path, capsys, image):
    src = image / "mm.json"  # MM-PRM ships one JSON array
    src.write_text(
        json.dumps(
            [
                {"question": "Q?", "image_path": "fig.png", "process": "a<prm>b<prm>", "labels": [1.0, 0.5]},
                {"question": "Q?", "process": "a<prm>b", "labels": [1.0]},
            ]
        )
    )
    out = tmp_path / "mm.jsonl"
    assert main(["convert", "--from", "mmprm_prm", "--input", str(src), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 rows" in err and "steps/labels count mismatch" in err and f"{src}:2: id=mmprm_prm-2" in err
    (ex,) = load_examples(out, require_labels=True)
    assert ex.images == [str((image / "fig.png").resolve())] and ex.labels == [1.0, 0.5]

    none = tmp_path / "none.jsonl"
    none.write_text(json.dumps({"prompt": "q", "completions": ["a"], "labels": [True]}) + "\n")
    assert main(["convert", "--from", "math_shepherd", "--input", str(none), "--out", str(tmp_path / "x.jsonl")]) == 1
    assert "no example could be converted" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "q"}\n{oops\n')
    assert main(["convert", "--from", "trl", "--input", str(broken), "--out", str(tmp_path / "y.jsonl")]) == 1
    assert f"{broken}:2: id=?: line: invalid JSON" in capsys.readouterr().err
    assert not (tmp_path / "y.jsonl").exists()  # a conversion that failed half-way leaves no file


def test_repeated_ids_get_the_next_free_suffix():
    from mmprm.data.convert import _Ids

    ids = _Ids("p-")
    assert [ids(b) for b in ["a", "a", "a~3", "a", "b", "a"]] == ["p-a", "p-a~2", "p-a~3", "p-a~4", "p-b", "p-a~5"]
    many = _Ids()
    assert [many("x") for _ in range(20_000)][-1] == "x~20000"  # each suffix found in one step, not k


def test_a_sink_takes_each_example_as_made_and_nothing_is_held():
    held = convert_file("openr_tree", DATA / "samples_math-aps-tree.jsonl")
    sent = []
    streamed = convert_file("openr_tree", DATA / "samples_math-aps-tree.jsonl", sink=sent.append)
    assert streamed.examples == [] and sent == held.examples
    assert (streamed.count, streamed.steps) == (len(held.examples), sum(len(e.steps) for e in held.examples))
    assert streamed.summary() == held.summary()
