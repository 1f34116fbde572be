"""Reasoning-tree evaluation: build trees, score their nodes, compute Think360 width/depth and RPTS.

    from mmprm.treeval import from_rpts_lines, constant_scores, set_scores, rpts
    tree = from_rpts_lines(["Image0 -> A red car.", "Conclusion0 + Text0 -> It brakes."], ["Red = brake."], 1)
    set_scores(tree, constant_scores(tree, 1.0))
    rpts(tree)  # 1.0

Node scores live on the tree (`node.score`, None until set); scorers return `{node_id: score}` and
`set_scores` writes them. See `tree.py` for the edge direction and `metrics.py` for the definitions;
`extract.py` turns free answers into trees (Think360 extraction, RPTS lines) and `rpts_judge.py`
is the RPTS judge protocol.
`render_tree` (networkx + matplotlib) is imported lazily.
"""

from mmprm.treeval.builders import (
    from_annotation_tree,
    from_rpts_lines,
    from_rpts_record,
    from_steps,
    from_think360_blocks,
    rpts_question,
)
from mmprm.treeval.extract import extract_think360, rpts_answer_prompt, rpts_lines, rpts_verdict, think360_valid
from mmprm.treeval.metrics import filtered_accuracy, path_scores, rpts, think360_depth, think360_width
from mmprm.treeval.rpts_judge import RPTSJudge, RPTSJudgeConfig, corrected_score, image_facts
from mmprm.treeval.scorers import (
    JudgedTree,
    JudgeScorer,
    constant_scores,
    mc_scores,
    node_paths,
    prm_scores,
    rollout_mc_scores,
)
from mmprm.treeval.tree import Node, Tree, set_scores


def render_tree(*args, **kwargs):
    """Draw a scored tree to PNG (see `mmprm.treeval.render.render_tree`)."""
    from mmprm.treeval.render import render_tree as _render

    return _render(*args, **kwargs)


__all__ = [
    "Node",
    "Tree",
    "set_scores",
    "from_rpts_lines",
    "from_rpts_record",
    "rpts_question",
    "from_think360_blocks",
    "from_steps",
    "from_annotation_tree",
    "rpts",
    "think360_width",
    "think360_depth",
    "filtered_accuracy",
    "path_scores",
    "constant_scores",
    "mc_scores",
    "rollout_mc_scores",
    "prm_scores",
    "node_paths",
    "JudgeScorer",
    "JudgedTree",
    "RPTSJudge",
    "RPTSJudgeConfig",
    "corrected_score",
    "image_facts",
    "extract_think360",
    "think360_valid",
    "rpts_answer_prompt",
    "rpts_lines",
    "rpts_verdict",
    "render_tree",
]
