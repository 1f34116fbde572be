"""recipes/reasoning_eval.py end to end against a scripted judge on 127.0.0.1: RPTS premise answers
with the correction pass, Think360 extraction on MATH-V-style CoT files, failures counted, the
reply cache on a rerun, a dead endpoint; and a tiny HF model answering (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from chat_server import ChatServer, free_port_url
from test_tree_protocols import ANSWER, BAD_TREE, RECORD, RESPONSE, rpts_script, think360_script

pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "reasoning_eval.py"
CONFIG = REPO / "recipes" / "configs" / "tiny" / "reasoning_eval.yaml"


def recipe():
    spec = importlib.util.spec_from_file_location("reasoning_eval_recipe", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rpts_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """Three RPTS records: one answered in premise lines, one answered in prose, one not answered."""
    records = [RECORD, {**RECORD, "id": 8, "answer": "disagree"}, {**RECORD, "id": 9}]
    texts = tmp_path / "texts_en.json"
    texts.write_text(json.dumps(records), encoding="utf-8")
    answers = write_jsonl(
        tmp_path / "answers.jsonl", [{"id": "7", "response": ANSWER}, {"id": "8", "response": "I think they agree."}]
    )
    return texts, answers


def run_rpts(tmp_path: Path, url: str, *overrides: str) -> int:
    texts, answers = rpts_inputs(tmp_path)
    return recipe().main(
        [
            "--config",
            str(CONFIG),
            f"problems.path={texts}",
            "problems.limit=null",
            "answers.source=file",
            f"answers.path={answers}",
            f"scorer.judge.url={url}",
            "scorer.judge.backoff_s=0",
            "scorer.judge.max_retries=1",
            f"output.dir={tmp_path / 'out'}",
            *overrides,
        ]
    )


def test_rpts_answers_judged_with_the_correction_pass(tmp_path):
    with ChatServer(rpts_script) as server:
        assert run_rpts(tmp_path, server.url) == 0
        report = json.loads((tmp_path / "out" / "report.json").read_text())
        s, items = report["summary"], {r["id"]: r for r in report["items"]}
        assert s["problems"] == 3 and s["answered"] == 2 and report["unanswered"] == ["9"]
        # 7 says "agree" (right), 8 says "agree" to a "disagree" record (wrong)
        assert s["accuracy"] == 0.5 and items["7"]["prediction"] == "agree" and not items["8"]["correct"]
        assert items["8"]["status"] == "no_tree" and s["trees_missing"] == 1
        assert s["tree_failures"] == {"unparseable: no 'premises -> conclusion' lines": 1}
        # the hand-computed tree of test_tree_protocols: (0.81*0.4 + 0.7 + 0.9 + 0.9) / 3.71 at (0.9, 1)
        assert s["trees_scored"] == 1 and s["rpts"]["0.9,1"] == pytest.approx(2.824 / 3.71)
        # (0.5, 2): heights C0 1, C3 2, C4 1, C5 3 -> weights 0.5, 1, 0.5, 0.5
        assert s["rpts"]["0.5,2"] == pytest.approx((0.5 * 0.9 + 1.0 + 0.5 * 0.7 + 0.5 * 0.4) / 2.5)
        assert s["filtered_accuracy"]["0.9,1"] == 1.0 and s["accuracy_of_scored"] == 1.0
        assert s["chat"]["judge"]["requests"] == 6 and len(server.requests) == 6
        tree = next(json.loads(line) for line in (tmp_path / "out" / "trees.jsonl").read_text().splitlines())
        assert tree["meta"]["judge"]["corrected"] == ["C4", "C5"]
        assert {n["id"]: n["score"] for n in tree["nodes"] if n["kind"] == "conclusion"} == {
            "C0": 0.9,
            "C1": 1.0,
            "C2": 0.0,
            "C3": 1.0,
            "C4": 0.7,
            "C5": 0.4,
        }
        md = (tmp_path / "out" / "report.md").read_text()
        assert "| 0.9,1 | 0.7612 | 1.0000 |" in md and "unparseable: no 'premises -> conclusion' lines | 1" in md
        assert (tmp_path / "out" / "trees" / "7.png").read_bytes()[:4] == b"\x89PNG"
        # a rerun with another metric grid pays nothing: every reply comes from the cache
        assert run_rpts(tmp_path, server.url, "metrics.rpts_lambdas=[1.0]") == 0
        assert len(server.requests) == 6
        s = json.loads((tmp_path / "out" / "report.json").read_text())["summary"]
        assert s["chat"]["judge"]["cache_hits"] == 6 and s["rpts"]["1.0,1"] == pytest.approx((0.4 + 0.7 + 1 + 0.9) / 4)


def test_a_dead_judge_stops_the_run_with_the_url_and_the_key(tmp_path, capsys):
    url = free_port_url()
    assert run_rpts(tmp_path, url) == 1
    err = capsys.readouterr().err
    assert url in err and "scorer.judge.url" in err


def test_think360_on_mathv_cot_files(tmp_path):
    from PIL import Image

    folder = tmp_path / "mathv"
    (folder / "images").mkdir(parents=True)
    for pid in ("1", "2"):
        Image.new("RGB", (32, 32), "white").save(folder / "images" / f"{pid}.jpg")
    write_jsonl(
        folder / "testmini.jsonl",
        [
            {
                "id": pid,
                "question": "<image1> Perimeter of the triangle?",
                "options": [],
                "answer": "12",
                "solution": None,
                "level": 1,
                "subject": "metric geometry - length",
                "image": f"images/{pid}.jpg",
            }
            for pid in ("1", "2")
        ],
    )
    cot = write_jsonl(
        tmp_path / "cot.jsonl",
        [
            {"id": "1", "model": "m", "response": RESPONSE, "model_answer": "12", "correct": True},
            {"id": "2", "model": "m", "response": "The perimeter is 11.", "model_answer": "11", "correct": False},
        ],
    )

    def script(body):
        if "The perimeter is 11." in body["messages"][-1]["content"]:
            return BAD_TREE  # never a valid tree: counted, not averaged
        return think360_script(body)

    with ChatServer(script) as server:
        argv = [
            "--config",
            str(CONFIG),
            "problems.format=mathvision",
            f"problems.path={folder}",
            "answers.source=file",
            f"answers.path={cot}",
            "tree.kind=think360",
            f"tree.extractor.url={server.url}",
            "tree.extractor.model=extractor",
            f"scorer.judge.url={server.url}",
            "output.plots=false",
            f"output.dir={tmp_path / 'out'}",
        ]
        assert recipe().main(argv) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    s, items = report["summary"], {r["id"]: r for r in report["items"]}
    assert s["accuracy"] == 0.5  # MATH-V's own verdicts
    assert items["2"]["status"] == "no_tree" and items["2"]["why"] == (
        "invalid tree: node 2.1 has a parent that is not a node"
    )
    # the hand-computed tree: width 2/3, depth 3/4; the invalid tree is not averaged in
    assert s["trees_scored"] == 1 and s["width"] == pytest.approx(2 / 3) and s["depth"] == pytest.approx(0.75)
    # extraction: 2 tries for 1 (invalid, then valid), 3 for 2 (all invalid); judging: 6 nodes of 1
    assert s["chat"]["extractor"]["requests"] == 5 and s["chat"]["extractor"]["unparsed"] == 4
    assert s["chat"]["judge"]["requests"] == 6 and s["answer_tokens"]["total"] > 0


def test_bad_config_is_reported(tmp_path, capsys):
    mod = recipe()
    assert mod.main(["--config", str(CONFIG), "scorer.judge.model=", f"output.dir={tmp_path}"]) == 2
    assert "scorer.judge.model" in capsys.readouterr().err
    assert mod.main(["--config", str(CONFIG), "tree.kind=think360", f"output.dir={tmp_path}"]) == 2
    assert "tree.extractor.model" in capsys.readouterr().err
    assert mod.main(["--config", str(CONFIG), "answers.source=file", f"output.dir={tmp_path}"]) == 2


@pytest.mark.slow
def test_tiny_hf_model_answers_and_mc_scores(tmp_path, tiny_model_dir):
    """The model under test answers with the HF backend and rolls out from every node (MC scorer)."""
    problems = write_jsonl(
        tmp_path / "problems.jsonl",
        [{"id": f"p{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)],
    )
    model = tiny_model_dir("qwen2")
    argv = [
        "--config",
        str(CONFIG),
        "problems.format=problems",
        f"problems.path={problems}",
        "answers.source=hf",
        f"policy.path={model}",
        "policy.sampling.max_new_tokens=24",
        "tree.kind=steps",
        "scorer.kind=mc",
        "scorer.mc_rollouts=2",
        f"output.dir={tmp_path / 'out'}",
        "output.plots=false",
    ]
    assert recipe().main(argv) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    s = report["summary"]
    assert s["answered"] == 3 and s["answer_tokens"]["counted_by"] == "tokenizer"
    assert s["trees_scored"] + s["trees_missing"] == 3
    assert all(r["answer_tokens"] > 0 for r in report["items"])  # the decoded text, tokenized again
    answers = (tmp_path / "out" / "answers.jsonl").read_text()
    assert len(answers.splitlines()) == 3
    assert recipe().main(argv) == 0  # the rerun reuses answers.jsonl: nothing is generated again
    assert (tmp_path / "out" / "answers.jsonl").read_text() == answers
    # a run killed after the first answer, mid-way through the second line, resumes with the other two
    (tmp_path / "out" / "answers.jsonl").write_text(answers.splitlines()[0] + "\n" + answers.splitlines()[1][:9])
    assert recipe().main(argv) == 0
    lines = (tmp_path / "out" / "answers.jsonl").read_text().splitlines()
    assert len(lines) == 3 and lines[0] == answers.splitlines()[0]


def test_prm_scorer_gives_each_node_the_prms_score_of_its_step(tmp_path, tiny_model_dir):
    """scorer.kind=prm: every node of a steps tree carries the score the PRM gives that step when the
    whole answer is scored directly with mmprm.load_prm (a random-init PRM: distinct scores)."""
    from mmprm import load_prm
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    backbone, processor = load_backbone(tiny_model_dir("qwen2"))
    prm_dir = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    questions = {f"p{i}": f"What is {i} + 2?" for i in range(3)}
    steps = {
        "p0": ["Start from 0.", "0 + 2 = 2."],
        "p1": ["Start from 1.", "1 + 1 = 2.", "2 + 1 = 3."],
        "p2": ["2 + 2 = 5."],
    }
    problems = write_jsonl(
        tmp_path / "problems.jsonl",
        [{"id": i, "question": q, "answer": str(int(i[1]) + 2)} for i, q in questions.items()],
    )
    answers = write_jsonl(
        tmp_path / "answers.jsonl",
        [
            {"id": i, "response": "".join(f"<step>{s}</step>" for s in ss) + f"<answer>{int(i[1]) + 2}</answer>"}
            for i, ss in steps.items()
        ],
    )
    out = tmp_path / "out"
    argv = [
        "--config",
        str(CONFIG),
        "problems.format=problems",
        f"problems.path={problems}",
        "answers.source=file",
        f"answers.path={answers}",
        "tree.kind=steps",
        "scorer.kind=prm",
        f"prm.path={prm_dir}",
        "prm.batch_size=2",
        "prm.device=cpu",
        f"output.dir={out}",
        "output.plots=false",
    ]
    assert recipe().main(argv) == 0
    trees = {t["id"]: t for t in map(json.loads, (out / "trees.jsonl").read_text().splitlines())}
    assert sorted(trees) == sorted(steps)
    prm = load_prm(prm_dir, device="cpu")
    for i, ss in steps.items():
        expected = prm.score([{"question": questions[i], "steps": ss}])[0]
        nodes = {n["id"]: n for n in trees[i]["nodes"]}
        assert [nodes[f"S{k}"]["text"] for k in range(len(ss))] == ss
        assert [nodes[f"S{k}"]["score"] for k in range(len(ss))] == pytest.approx(expected, abs=1e-5)
    assert len({round(p, 6) for ss in trees.values() for p in (n["score"] for n in ss["nodes"])}) > 1


def test_problems_format_is_a_reader_name_and_gold_needs_shipped_reasoning(tmp_path):
    """problems.format names an answer_benchmark reader (a wrong name is refused with the known
    ones); answers.source=gold on problems without reasoning stops, naming the file."""
    from mmprm.config import ConfigError, load_config

    mod = recipe()
    with pytest.raises(ConfigError, match="problems.format: answer_benchmark reader 'rpt': unknown; the known names"):
        load_config(mod.ReasoningEvalConfig, str(CONFIG), ["problems.format=rpt"])
    problems = write_jsonl(tmp_path / "problems.jsonl", [{"id": "p0", "question": "1 + 1?", "answer": "2"}])
    argv = ["problems.format=problems", f"problems.path={problems}", "answers.source=gold", "tree.kind=steps"]
    cfg = load_config(mod.ReasoningEvalConfig, str(CONFIG), [*argv, f"output.dir={tmp_path / 'out'}"])
    with pytest.raises(SystemExit, match=rf"answers.source=gold: {problems} \(problems\) ships no reasoning"):
        mod.run(cfg)
