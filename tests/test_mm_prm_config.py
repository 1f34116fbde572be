"""recipes/configs/mm_prm/ holds the MM-PRM paper's settings (docs/mm-prm.md maps each to its
source): each config is loaded through its recipe's own Config class and checked value by value,
and every key the docs table names exists in the config it points at."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from test_recipe_configs import CONFIGS, REPO, config_class

from mmprm.config import load_config
from mmprm.training.run import resolve_grad_accum

MM_PRM = CONFIGS / "mm_prm"
DOC = REPO / "docs" / "mm-prm.md"


def load(name: str):
    return load_config(config_class(name), MM_PRM / f"{name}.yaml")


def test_the_set_is_the_three_stages_of_the_paper_and_its_best_of_n():
    assert sorted(p.name for p in MM_PRM.glob("*.yaml")) == [
        "bon_rerank.yaml",
        "mcts_annotate.yaml",
        "policy_sft.yaml",
        "prm_train.yaml",
    ]


def test_policy_sft_holds_the_papers_values():
    cfg = load("policy_sft")
    assert cfg.train.lr == 4e-5 and cfg.train.global_batch_size == 128
    assert cfg.model.freeze_vision_tower
    assert "InternVL" in cfg.model.name_or_path  # MM-PRM's policy is InternVL-based (docs: Backbone)


def test_mcts_annotate_holds_the_papers_and_mm_prm_scripts_values():
    cfg = load("mcts_annotate")
    s, p = cfg.search, cfg.policy.sampling
    # paper
    assert (s.c_puct, s.max_searches, s.max_rollouts) == (0.125, 200, 1000)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 50, 0.9)
    # MM-PRM's data_pipeline scripts (run_data_pipeline.sh, llm_utils.py, traverse.py)
    assert p.max_new_tokens == 4096 and p.repetition_penalty == 1.05 and p.prefix_temperature is None
    assert (s.rollouts_per_estimate, s.alpha, s.beta, s.length_scale) == (16, 0.5, 0.9, 2000.0)
    assert s.keep_correct_rollouts and not s.keep_failed_rollouts
    e = cfg.export
    assert (e.edges, e.negative_threshold, e.negatives, e.balance, e.min_words) == ("node", 0.0, "cut", 1.0, 10)
    assert e.format == "mm_prm"  # traverse.py's "\n\n" joins, plain answer step and word count
    # the SFT'd policy is what the search samples
    assert cfg.policy.path == load("policy_sft").output_dir


def test_prm_train_holds_the_papers_values_and_starts_from_the_sft_policy():
    cfg = load("prm_train")
    assert cfg.train.lr == 4e-6 and cfg.train.global_batch_size == 512
    assert cfg.model.name_or_path == load("policy_sft").output_dir
    assert cfg.data.train_file == str(Path(load("mcts_annotate").output_dir) / "prm_data.jsonl")
    assert cfg.data.label_mode == "soft" and cfg.model.freeze_vision_tower
    # MM-PRM's input layout, read as Yes/No at each <prm> (tests/test_mm_prm_layout.py)
    assert cfg.prm.layout == "mm_prm" and cfg.prm.reward_tokens == ["Yes", "No"] and cfg.prm.system_prompt is None
    # one epoch: the comment's example is ceil(256,000 rows / 512) optimizer steps
    assert cfg.train.max_steps == -(-256_000 // 512)
    for processes in (8, 32):  # the global batch holds on one node and on four
        accum = resolve_grad_accum(dataclasses.replace(cfg.train), processes)
        assert cfg.train.batch_size * accum * processes == 512


def test_the_papers_hard_labels_are_a_named_mode():
    cfg = load_config(config_class("prm_train"), MM_PRM / "prm_train.yaml", ["data.label_mode=hard_any_correct"])
    assert cfg.data.label_mode == "hard_any_correct"


def table_rows() -> list[list[str]]:
    """The settings table of docs/mm-prm.md: one list of cells per row, header and rule left out."""
    text = DOC.read_text(encoding="utf-8")
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")
    ]
    return [r for r in rows[2:] if len(r) == 4]


def test_bon_rerank_scores_under_mm_prm_edge_rules_with_the_trained_prm():
    cfg = load("bon_rerank")
    # eval/prm/extract_calculate.py: an empty candidate scores 0, p = 0 and 1 give -/+9999
    assert cfg.report.edge_rules == "mm_prm"
    assert cfg.prm.path == load("prm_train").output_dir and cfg.policy.path == load("policy_sft").output_dir
    assert cfg.prm.convention is None and cfg.prm.max_length == load("prm_train").data.max_length
    assert cfg.generate.n == 16 and cfg.policy.step_mode == "tags"


def test_the_docs_table_covers_the_paper_settings():
    rows = table_rows()
    keys = " ".join(r[2] for r in rows)
    for key in (
        "train.lr",
        "train.global_batch_size",
        "model.freeze_vision_tower",
        "search.c_puct",
        "search.max_searches",
        "search.max_rollouts",
        "sampling.temperature",
        "sampling.top_k",
        "sampling.top_p",
        "sampling.max_new_tokens",
        "data.label_mode",
        "train.max_steps",
        "model.name_or_path",
    ):
        assert key in keys, f"docs/mm-prm.md: no table row names {key}"
    assert all(r[3] for r in rows), "every row names its source (paper, or an MM-PRM script path)"


@pytest.mark.parametrize("name", ["policy_sft", "mcts_annotate", "prm_train", "bon_rerank"])
def test_every_key_the_table_names_is_in_its_config(name):
    """A key written `<recipe>.yaml: a.b` in the table resolves in that config."""
    cfg = load(name)
    named = [key for row in table_rows() for key in re.findall(rf"`{name}\.yaml: ([\w.]+)`", row[2])]
    assert named, f"docs/mm-prm.md names no key of {name}.yaml"
    for key in named:
        obj = cfg
        for part in key.split("."):
            assert hasattr(obj, part), f"docs/mm-prm.md: {name}.yaml has no key {key}"
            obj = getattr(obj, part)
