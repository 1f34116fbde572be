"""Evaluate a model's own reasoning end to end: problems -> its answers -> reasoning trees -> node
scores -> accuracy, Think360 width/depth, RPTS and RPTS-filtered accuracy.

    # MATH-V CoT responses already written by a model, Think360 trees extracted and judged by an LLM
    python recipes/reasoning_eval.py --config recipes/configs/tiny/reasoning_eval.yaml \\
        problems.format=mathvision problems.path=../shared/data/mathv \\
        answers.source=file answers.path=../shared/data/mathv/cot_testmini/Gemini-Pro-CoT.jsonl \\
        tree.kind=think360 tree.extractor.url=http://127.0.0.1:8000/v1 tree.extractor.model=JUDGE \\
        scorer.kind=judge scorer.judge.url=http://127.0.0.1:8000/v1 scorer.judge.model=JUDGE
    # RPTS-Eval: the model under test writes premise -> conclusion lines (HF here; vllm on GPUs),
    # the RPTS judge protocol scores them
    python recipes/reasoning_eval.py --config recipes/configs/tiny/reasoning_eval.yaml \\
        answers.source=vllm policy.path=Qwen/Qwen2.5-VL-7B-Instruct scorer.judge.model=JUDGE

Stages (each a step of `run`):
    problems  an answer_benchmark reader (mmprm.data.readers): rpts (RPTS-Eval texts JSON),
              mathvision (MATH-V folder), problems (mmprm problems file), mathvista, ...
    answers   file (JSONL {id, response, [correct]}, e.g. MATH-V's CoT files), gold (the benchmark's
              own reasoning, a sanity check of the judge), hf or vllm (the model answers now;
              written to answers.jsonl and reused on a rerun)
    tree      think360 (an LLM extracts the steps verbatim as a tree), rpts (the answer's own
              ``Image0 + Text1 -> Conclusion0: ...`` lines), steps (the answer's paragraphs, a chain)
    scorer    judge (Think360 yes/no, graded, or the RPTS protocol with its correction pass), prm,
              mc (rollouts of the policy from every node), constant
    report    report.json, report.md, trees.jsonl (scored trees + judge details), trees/<id>.png

Nothing is silently dropped: problems without an answer, answers whose tree cannot be extracted
(after tree.retries) or is invalid, and trees the judge could not fully score are counted and
listed in the report, and left out of the averages they would distort. Replies of every chat
endpoint are cached in the output folder, so a rerun pays only for what is new.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmprm.answers import answers_match, extract_answer
from mmprm.chat import ChatClient, ChatConfig, ChatError
from mmprm.config import ConfigError, load_config, parse_cli, to_dict
from mmprm.config_sections import ModelLoadConfig, PolicyConfig, PRMScorerConfig
from mmprm.data.readers import UnknownReaderError, get_reader
from mmprm.data.schema import read_jsonl, write_jsonl
from mmprm.data.sft import split_solution
from mmprm.generation.base import RolloutRequest, SamplingConfig
from mmprm.treeval import (
    JudgeScorer,
    RPTSJudge,
    RPTSJudgeConfig,
    Tree,
    constant_scores,
    extract_think360,
    filtered_accuracy,
    from_rpts_lines,
    from_steps,
    prm_scores,
    render_tree,
    rollout_mc_scores,
    rpts,
    rpts_lines,
    rpts_question,
    rpts_verdict,
    set_scores,
    think360_depth,
    think360_width,
)
from mmprm.treeval.report import reasoning_report_md


@dataclass
class ProblemsConfig:
    """The problems the model under test answers.

    Attributes:
        format: the answer_benchmark reader (mmprm.data.readers): rpts (RPTS-Eval texts JSON) |
            mathvision (MATH-V folder) | problems (our problems file) | mathvista | ... (mathv and
            jsonl: deprecated names of mathvision and problems)
        path: rpts: the texts JSON; mathvision: the folder; problems: the problems file
        image_dir: where the images start (the reader's image_root): rpts: folder of the
            visual_clue files; null: the reader's default (rpts: <path folder>/images)
        limit: first N problems only; null takes all
    """

    format: str = "rpts"
    path: str = "data/rpts_eval/texts_en.json"
    image_dir: str | None = None
    limit: int | None = None


@dataclass
class AnswersConfig:
    """Where the answers come from.

    Attributes:
        source: file (a JSONL of responses) | gold (the benchmark's own reasoning) | hf | vllm (the
            policy, the model under test, answers with that backend, whatever policy.backend says)
        path: file: JSONL of {id, response, [correct], [model_answer]}
        response_field: file: the field holding the response text
        tokenizer: count answer tokens with this tokenizer; null: the model's, else approximate
    """

    source: Literal["file", "gold", "hf", "vllm"] = "gold"
    path: str = ""
    response_field: str = "response"
    tokenizer: str | None = None


@dataclass
class AnswerPolicyConfig(PolicyConfig):
    """The model under test (answers.source=hf or vllm; also the policy of scorer.kind=mc), sent
    its prompts as they are: no saved spec is read.

    Attributes:
        path: the model under test: a model directory or hub id
        batch_size: hf: sequences per generate call (answers)
        step_mode: how the mc scorer's rollouts read steps; null: blank_lines
        system_prompt: system message of every prompt; null sends none
    """

    batch_size: int = 16
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.7, max_new_tokens=1024))


@dataclass
class TreeConfig:
    """How an answer becomes a reasoning tree.

    Attributes:
        kind: think360 (an LLM extracts the tree) | rpts (premise + premise -> conclusion lines) | steps (a
            chain of the answer's steps)
        extractor: think360: the extracting LLM's endpoint (section)
        retries: extra tries for an answer whose tree is unparseable or invalid
        retry_temperature: sampling temperature of those extra tries
        send_images: show the extractor the problem's images
    """

    kind: Literal["think360", "rpts", "steps"] = "rpts"
    extractor: ChatConfig = field(default_factory=ChatConfig)
    retries: int = 2
    retry_temperature: float = 0.7
    send_images: bool = False


@dataclass
class JudgeConfig(ChatConfig):
    """The judge endpoint (keys as in mmprm.chat.ChatConfig) and its protocol.

    Attributes:
        protocol: auto (rpts for rpts trees, else think360) | think360 | graded | rpts
        send_images: send the problem's images with each question
        parse_retries: extra asks for a reply that holds no verdict
    """

    protocol: Literal["auto", "think360", "graded", "rpts"] = "auto"
    send_images: bool = False
    parse_retries: int = 2


@dataclass
class ScorerConfig:
    """What scores each node.

    Attributes:
        kind: judge (an LLM judge) | prm (our PRM) | mc (Monte Carlo rollouts of the policy) | constant
        judge: kind=judge: the judge (section)
        rpts: the RPTS judge protocol's switches (section)
        mc_rollouts: kind=mc: rollouts per node
        constant: kind=constant: the score of every node
    """

    kind: Literal["judge", "prm", "mc", "constant"] = "judge"
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rpts: RPTSJudgeConfig = field(default_factory=RPTSJudgeConfig)
    mc_rollouts: int = 8
    constant: float = 1.0


@dataclass
class MetricsConfig:
    """Tree metrics.

    Attributes:
        threshold: a node is correct when its score >= threshold (width/depth)
        rpts_lambdas: RPTS height-decay values to report
        rpts_h_fs: RPTS full-weight heights to report
        filter_threshold: filtered accuracy counts a right answer only when its RPTS >= this
    """

    threshold: float = 0.5
    rpts_lambdas: list[float] = field(default_factory=lambda: [0.9, 0.5])
    rpts_h_fs: list[int] = field(default_factory=lambda: [1, 2])
    filter_threshold: float = 0.5


@dataclass
class OutputConfig:
    """Where results go.

    Attributes:
        dir: output folder (report.json, report.md, trees.jsonl, answers)
        plots: one PNG per problem under trees/
    """

    dir: str = "runs/reasoning_eval"
    plots: bool = False


@dataclass
class ReasoningEvalConfig:
    """Evaluate a model's own reasoning: problems -> answers -> trees -> node scores -> report.

    Attributes:
        problems: the problems (section)
        answers: where the answers come from (section)
        policy: the model under test, when it answers now or scorer.kind=mc rolls it out (section)
        tree: how answers become trees (section)
        scorer: what scores each node (section)
        prm: scorer.kind=prm: the PRM (section); batch_size: trees scored per forward batch
        model: model loading (section)
        metrics: tree metrics (section)
        output: where results go (section)
    """

    problems: ProblemsConfig = field(default_factory=ProblemsConfig)
    answers: AnswersConfig = field(default_factory=AnswersConfig)
    policy: AnswerPolicyConfig = field(default_factory=AnswerPolicyConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    prm: PRMScorerConfig = field(default_factory=PRMScorerConfig)
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # Keys read under their old names for one release (mmprm.config), with a warning.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "answers.model": "policy.path",
        **{f"answers.{k}": f"policy.{k}" for k in ("system_prompt", "sampling", "batch_size", "dtype")},
        "answers.vllm_gpu_memory_utilization": "policy.vllm.gpu_memory_utilization",
        "answers.vllm_max_model_len": "policy.vllm.max_model_len",
        "answers.vllm_kwargs": "policy.vllm.kwargs",
        "scorer.prm_path": "prm.path",
        **{f"scorer.{k}": f"prm.{k}" for k in ("batch_size", "backend", "convention", "device")},
        "scorer.vllm_kwargs": "prm.vllm.kwargs",
    }

    def validate(self) -> None:
        a, t, s = self.answers, self.tree, self.scorer
        if a.source == "file" and not a.path:
            raise ValueError("answers.path: set the JSONL of responses when answers.source=file")
        if a.source in ("hf", "vllm") and not self.policy.path:
            raise ValueError(f"policy.path: set the model under test when answers.source={a.source}")
        try:
            get_reader("answer_benchmark", self.problems.format)
        except UnknownReaderError as e:
            raise ValueError(f"problems.format: {e}") from None
        if t.kind == "think360" and not t.extractor.model:
            raise ValueError("tree.extractor.model: tree.kind=think360 needs an extracting LLM (and its url)")
        if t.kind == "rpts" and self.problems.format != "rpts":
            raise ValueError("tree.kind=rpts needs problems.format=rpts (premises cite the record's clues)")
        if s.kind == "judge" and not s.judge.model:
            raise ValueError("scorer.judge.model: set the judge's model name (and url) when scorer.kind=judge")
        if s.kind == "judge" and s.judge.protocol == "rpts" and t.kind != "rpts":
            raise ValueError("scorer.judge.protocol=rpts judges premise trees: use it with tree.kind=rpts")
        if s.kind == "prm" and not self.prm.path:
            raise ValueError("prm.path: set it to a PRM directory when scorer.kind=prm")
        if s.kind == "mc" and not self.policy.path:
            raise ValueError("scorer.kind=mc rolls out the policy from every node: set policy.path")
        if len(self.metrics.rpts_lambdas) == 0 or len(self.metrics.rpts_h_fs) == 0:
            raise ValueError("metrics.rpts_lambdas and metrics.rpts_h_fs need at least one value each")
        if a.source == "hf" or s.kind in ("prm", "mc"):
            from mmprm.models.loading import resolve_attn_implementation

            resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads


def load_reasoning_problems(cfg: ProblemsConfig) -> list[dict[str, Any]]:
    """[{id, question (what the model is asked), images, answer, choices, record, gold_reasoning}],
    read by the answer_benchmark reader `problems.format` (`mmprm.data.readers`)."""
    path = Path(cfg.path)
    if not path.exists():
        raise SystemExit(f"{path}: not found (set problems.path)")
    options = {"image_root": cfg.image_dir} if cfg.image_dir else {}
    rows = get_reader("answer_benchmark", cfg.format)(path, **options)
    out = [{**p, "record": (p.get("meta") or {}).get("record"), "gold": p.get("solution")} for p in rows]
    return out[: cfg.limit] if cfg.limit is not None else out


def count_tokens(texts: list[str], tokenizer: Any | None) -> tuple[list[int], str]:
    """Tokens per text with `tokenizer`, else a word-piece estimate (words and punctuation)."""
    if tokenizer is not None:
        return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts], "tokenizer"
    return [len(re.findall(r"\w+|[^\w\s]", t)) for t in texts], "approx (words + punctuation)"


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def main(argv: list[str]) -> int:
    try:
        config_path, overrides = parse_cli(argv, ReasoningEvalConfig)
        cfg = load_config(ReasoningEvalConfig, config_path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        return run(cfg)
    except ChatError as e:  # a dead endpoint: say which and where to fix it; the cache keeps what was paid for
        print(f"reasoning_eval: {e}", file=sys.stderr)
        return 1


def run(cfg: ReasoningEvalConfig) -> int:
    """The evaluation in its order: problems, answers, trees, node scores, report."""
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()

    # ---- problems
    problems = load_reasoning_problems(cfg.problems)
    if not problems:
        raise SystemExit(f"{cfg.problems.path}: no problems")
    by_id = {p["id"]: p for p in problems}
    print(f"{len(problems)} problems from {cfg.problems.path} ({cfg.problems.format})")

    # ---- answers, their length and correctness
    answers, backend, tokenizer = collect_answers(cfg, problems, by_id, out_dir)
    try:
        ids = [p["id"] for p in problems if p["id"] in answers]
        unanswered = [p["id"] for p in problems if p["id"] not in answers]
        token_counts, token_method = count_tokens([answers[i]["response"] for i in ids], tokenizer)
        grade_answers(ids, by_id, answers)

        # ---- trees
        chat_clients: dict[str, ChatClient] = {}
        trees, tree_failures = build_trees(cfg.tree, ids, by_id, answers, out_dir, chat_clients)
        print(f"{len(ids)} answers, {len(trees)} trees, {len(tree_failures)} without a usable tree")

        # ---- node scores
        if backend is not None and cfg.scorer.kind != "mc":  # its last use: a PRM may load next on the same GPU
            backend.close()
        scored = [i for i in ids if i in trees and i not in tree_failures]
        unjudged = score_nodes(cfg, trees, scored, by_id, backend, out_dir, chat_clients)
    finally:
        if backend is not None:  # a vLLM engine stops now, not in the interpreter's exit (its threads can abort there)
            backend.close()

    # ---- metrics and report
    rows = item_rows(ids, answers, trees, tree_failures, unjudged, token_counts, cfg.metrics)
    summary = summarize(
        cfg.metrics, len(problems), unanswered, rows, tree_failures, unjudged, token_method, chat_clients, start
    )
    write_report(cfg, out_dir, summary, rows, unanswered, trees)
    return 0


def collect_answers(
    cfg: ReasoningEvalConfig, problems: list[dict[str, Any]], by_id: dict[str, dict[str, Any]], out_dir: Path
) -> tuple[dict[str, dict[str, Any]], Any, Any]:
    """({id: {"response", ["correct"]}}, the rollout backend or None, the tokenizer that counts
    answer tokens or None): answers read from a file or the benchmark, or written by the model now.
    The backend stays open when the mc scorer rolls it out later."""
    answers_cfg = cfg.answers
    answers: dict[str, dict[str, Any]] = {}
    backend = tokenizer = None
    if answers_cfg.source == "file":
        answers = read_answer_file(answers_cfg, by_id)
    elif answers_cfg.source == "gold":
        # the benchmark's own reasoning reaches its own answer
        answers = {p["id"]: {"response": p["gold"], "correct": True} for p in problems if p["gold"]}
        if not answers:
            raise SystemExit(
                f"answers.source=gold: {cfg.problems.path} ({cfg.problems.format}) ships no reasoning; use a "
                "benchmark that does (rpts, mathvision) or answers.source=file|hf|vllm"
            )
    if answers_cfg.source in ("hf", "vllm") or cfg.scorer.kind == "mc":
        policy = cfg.policy
        if answers_cfg.source in ("hf", "vllm"):  # the backend the policy answers with
            policy = replace(cfg.policy, backend=answers_cfg.source)
        backend = policy.build(cfg.model.attn_implementation, saved_prompt=False)
        proc = getattr(backend, "processor", None)  # vLLM keeps the processor, HF the tokenizer too
        tokenizer = getattr(backend, "tokenizer", None) or getattr(proc, "tokenizer", proc)
    if answers_cfg.source in ("hf", "vllm"):
        answers = generate_answers(cfg.policy.batch_size, cfg.tree, backend, problems, by_id, out_dir)
    if answers_cfg.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(answers_cfg.tokenizer)
    return answers, backend, tokenizer


def read_answer_file(answers_cfg: AnswersConfig, by_id: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{id: {"response", ["correct"]}} of the problems in `by_id`, from answers.path; a row without
    response text stops the run with its line number."""
    answers: dict[str, dict[str, Any]] = {}
    field_name = answers_cfg.response_field
    for i, r in enumerate(read_jsonl(answers_cfg.path)):
        if not isinstance(r.get(field_name), str):
            raise SystemExit(
                f"{answers_cfg.path}:{i + 1}: id={r.get('id')}: {field_name}: missing or not text "
                "(set answers.response_field)"
            )
        if str(r.get("id")) in by_id:
            answers[str(r["id"])] = {
                "response": r[field_name],
                **({"correct": bool(r["correct"])} if "correct" in r else {}),
            }
    return answers


def generate_answers(
    batch_size: int,
    tree_cfg: TreeConfig,
    backend: Any,
    problems: list[dict[str, Any]],
    by_id: dict[str, dict[str, Any]],
    out_dir: Path,
) -> dict[str, dict[str, Any]]:
    """{id: {"response"}} written by the model under test. Each chunk is appended to answers.jsonl as
    it is generated (the last line of an id wins), so a rerun after a crash only generates what is
    missing."""
    from mmprm.data import store

    answers_file = out_dir / "answers.jsonl"
    # A line torn by a crash is cut off here, so the next chunk's lines start clean.
    answers = {
        r["id"]: {"response": r["response"]} for _, _, r in store.scan(answers_file, repair=True) if r["id"] in by_id
    }
    todo = [p for p in problems if p["id"] not in answers and all(Path(i).exists() for i in p["images"])]
    no_images = sorted(set(by_id) - set(answers) - {p["id"] for p in todo})
    for attempt in range(tree_cfg.retries + 1 if tree_cfg.kind == "rpts" else 1):
        # An RPTS answer with no premise lines has no tree: ask the model again (tree.retries).
        if attempt:
            todo = [by_id[i] for i, r in answers.items() if not rpts_lines(r["response"])]
        for lo in range(0, len(todo), batch_size):
            chunk = todo[lo : lo + batch_size]
            texts = backend.generate([RolloutRequest(p["id"], p["question"], p["images"], [], 1) for p in chunk])
            with store.open_append(answers_file) as f:
                for p, t in zip(chunk, texts):
                    answers[p["id"]] = {"response": t[0]}
                    store.append_row(f, {"id": p["id"], "response": t[0]})
            print(f"  answered {min(lo + batch_size, len(todo))}/{len(todo)} (try {attempt + 1})")
    if no_images:
        print(f"  {len(no_images)} problems skipped: their images are missing (e.g. id {no_images[0]})")
    return answers


def grade_answers(ids: list[str], by_id: dict[str, dict[str, Any]], answers: dict[str, dict[str, Any]]) -> None:
    """Set each answer's "prediction" and "correct"; a response file's own verdict wins (MATH-V
    ships one)."""
    for i in ids:
        p, r = by_id[i], answers[i]
        if "correct" in r:
            continue
        if p["record"] is not None:  # RPTS: agree or disagree
            r["prediction"] = rpts_verdict(r["response"])
            r["correct"] = r["prediction"] == p["answer"].strip().lower()
        else:
            r["prediction"] = extract_answer(r["response"])
            r["correct"] = answers_match(r["prediction"], p["answer"], p["choices"])


def build_trees(
    tree_cfg: TreeConfig,
    ids: list[str],
    by_id: dict[str, dict[str, Any]],
    answers: dict[str, dict[str, Any]],
    out_dir: Path,
    chat_clients: dict[str, ChatClient],
) -> tuple[dict[str, Tree], dict[str, str]]:
    """({id: tree}, {id: why it has no usable tree}) of the answers, as tree.kind says. An invalid
    Think360 extraction keeps its tree (it is saved) and is listed as a failure."""
    trees: dict[str, Tree] = {}
    tree_failures: dict[str, str] = {}
    if tree_cfg.kind == "think360":
        extractor = chat_clients["extractor"] = ChatClient(
            tree_cfg.extractor, "tree.extractor", out_dir / "chat_cache.jsonl"
        )
        trees, tree_failures = extract_trees(extractor, tree_cfg, ids, by_id, answers)
    elif tree_cfg.kind == "rpts":
        for i in ids:
            r = by_id[i]["record"]
            lines = rpts_lines(answers[i]["response"])
            if not lines:
                tree_failures[i] = "unparseable: no 'premises -> conclusion' lines"
                continue
            trees[i] = from_rpts_lines(
                lines,
                r["textual_clue"],
                len(r["visual_clue"]),
                r.get("context"),
                question=rpts_question(r),
                images=by_id[i]["images"],
                source=f"id={i}",
            )
    else:
        for i in ids:
            steps = split_solution(answers[i]["response"])[0]
            if not steps:
                tree_failures[i] = "unparseable: no steps"
                continue
            trees[i] = from_steps(steps, question=by_id[i]["question"], images=by_id[i]["images"])
    for _i, t in trees.items():
        t.images = [im for im in t.images if Path(im).exists()]  # RPTS-Eval ships only some images
    return trees, tree_failures


def extract_trees(
    extractor: ChatClient,
    tree_cfg: TreeConfig,
    ids: list[str],
    by_id: dict[str, dict[str, Any]],
    answers: dict[str, dict[str, Any]],
) -> tuple[dict[str, Tree], dict[str, str]]:
    """({id: tree}, {id: why invalid}): the Think360 trees an LLM extracts from the answers, each
    with its extraction's attempts and tokens in its meta."""
    trees: dict[str, Tree] = {}
    tree_failures: dict[str, str] = {}
    extractions = extractor.map(
        lambda i: extract_think360(
            extractor,
            by_id[i]["question"],
            answers[i]["response"],
            by_id[i]["answer"],
            by_id[i]["images"],
            tree_cfg.send_images,
            tree_cfg.retries,
            tree_cfg.retry_temperature,
            source=f"id={i}",
        ),
        ids,
        desc="extract trees",
    )
    for i, ex in zip(ids, extractions):
        trees[i] = ex.tree
        ex.tree.meta["extraction"] = {"attempts": ex.attempts, **ex.tokens}
        if not ex.valid:
            tree_failures[i] = f"invalid tree: {ex.reason}"
    return trees, tree_failures


def score_nodes(
    cfg: ReasoningEvalConfig,
    trees: dict[str, Tree],
    scored: list[str],
    by_id: dict[str, dict[str, Any]],
    backend: Any,
    out_dir: Path,
    chat_clients: dict[str, ChatClient],
) -> dict[str, list[str]]:
    """Score every node of the `scored` trees with scorer.kind; returns {id: nodes the judge gave no
    verdict for} (those trees keep no scores). The mc scorer closes `backend` once it is done."""
    scorer_cfg = cfg.scorer
    unjudged: dict[str, list[str]] = {}
    if scorer_cfg.kind == "judge":
        client = chat_clients["judge"] = ChatClient(scorer_cfg.judge, "scorer.judge", out_dir / "chat_cache.jsonl")
        unjudged = judge_trees(client, scorer_cfg, cfg.tree.kind, trees, scored, by_id)
    elif scorer_cfg.kind == "prm":
        from mmprm.data.score_cache import CachedScorer

        # each tree's scores are saved once scored: a killed run resumes, a rerun scores nothing twice
        prm = CachedScorer(
            out_dir / "score_cache.jsonl",
            lambda: cfg.prm.build(cfg.model.attn_implementation),
            prm=cfg.prm.path,
            convention=cfg.prm.convention,
        )
        try:
            for i in scored:
                set_scores(trees[i], prm_scores(trees[i], prm))
        finally:
            prm.close()  # a vLLM engine stops now, not in the interpreter's exit (its threads can abort there)
    elif scorer_cfg.kind == "mc":
        for i in scored:
            p = by_id[i]
            verify = (
                (lambda text, p=p: rpts_verdict(text) == p["answer"])
                if p["record"] is not None
                else (lambda text, p=p: answers_match(extract_answer(text), p["answer"], p["choices"]))
            )
            set_scores(trees[i], rollout_mc_scores(trees[i], backend, verify, scorer_cfg.mc_rollouts, problem_id=i))
    else:
        for i in scored:
            set_scores(trees[i], constant_scores(trees[i], scorer_cfg.constant))
    return unjudged


def judge_trees(
    client: ChatClient,
    scorer_cfg: ScorerConfig,
    tree_kind: str,
    trees: dict[str, Tree],
    scored: list[str],
    by_id: dict[str, dict[str, Any]],
) -> dict[str, list[str]]:
    """Node scores from the LLM judge (the RPTS protocol for premise trees, else Think360 binary or
    graded); returns {id: nodes without a verdict}. Every tree keeps the judge's details."""
    judge_cfg = scorer_cfg.judge
    if (judge_cfg.protocol == "auto" and tree_kind == "rpts") or judge_cfg.protocol == "rpts":
        judge: Any = RPTSJudge(client, scorer_cfg.rpts)
        results = client.map(lambda i: judge.judge(trees[i], by_id[i]["record"]), scored, desc="judge")
    else:
        mode = "graded" if judge_cfg.protocol == "graded" else "binary"
        judge = JudgeScorer(client, mode, judge_cfg.send_images, judge_cfg.parse_retries)
        results = client.map(lambda i: judge.judge(trees[i], by_id[i]["answer"]), scored, desc="judge")
    unjudged: dict[str, list[str]] = {}
    for i, res in zip(scored, results):
        trees[i].meta["judge"] = {"details": res.details, "corrected": res.corrected, **res.tokens}
        if res.unparsed:
            unjudged[i] = res.unparsed
        else:
            set_scores(trees[i], res.scores)
    return unjudged


def rpts_keys(metrics: MetricsConfig) -> list[str]:
    """The "lambda,h_f" keys of every RPTS setting reported, lambdas outermost."""
    return [f"{lam},{h_f}" for lam in metrics.rpts_lambdas for h_f in metrics.rpts_h_fs]


def item_rows(
    ids: list[str],
    answers: dict[str, dict[str, Any]],
    trees: dict[str, Tree],
    tree_failures: dict[str, str],
    unjudged: dict[str, list[str]],
    token_counts: list[int],
    metrics: MetricsConfig,
) -> list[dict[str, Any]]:
    """One report row per answer: its correctness and length, and its tree metrics when the tree was
    fully scored, else its status and why."""
    grid = [(lam, h_f) for lam in metrics.rpts_lambdas for h_f in metrics.rpts_h_fs]
    rows = []
    for k, i in enumerate(ids):
        t = trees.get(i)
        row: dict[str, Any] = {
            "id": i,
            "correct": answers[i]["correct"],
            "prediction": answers[i].get("prediction"),
            "answer_tokens": token_counts[k],
            "nodes": len(t.conclusions()) if t else 0,
            "status": "scored",
        }
        if i in tree_failures:
            row["status"], row["why"] = "no_tree", tree_failures[i]
        elif i in unjudged:
            row["status"], row["why"] = "unjudged", f"no verdict for nodes {', '.join(unjudged[i])}"
        else:
            row.update(
                {
                    "width": think360_width(t, metrics.threshold),
                    "depth": think360_depth(t, metrics.threshold),
                    "width_soft": think360_width(t, soft=True),
                    "depth_soft": think360_depth(t, soft=True),
                    "rpts": {f"{lam},{h_f}": rpts(t, lam, h_f) for lam, h_f in grid},
                }
            )
        rows.append(row)
    return rows


def summarize(
    metrics: MetricsConfig,
    n_problems: int,
    unanswered: list[str],
    rows: list[dict[str, Any]],
    tree_failures: dict[str, str],
    unjudged: dict[str, list[str]],
    token_method: str,
    chat_clients: dict[str, ChatClient],
    start: float,
) -> dict[str, Any]:
    """The report's summary: counts of what was left out and why, accuracy, and the tree metrics
    averaged over the fully scored trees only."""
    ok = [r for r in rows if r["status"] == "scored"]
    tok = [r["answer_tokens"] for r in rows]
    return {
        "problems": n_problems,
        "answered": len(rows),
        "unanswered": len(unanswered),
        "accuracy": mean([float(r["correct"]) for r in rows]),
        "trees_scored": len(ok),
        "trees_missing": len(tree_failures),
        "trees_unjudged": len(unjudged),
        "tree_failures": dict(Counter(tree_failures.values())),
        "accuracy_of_scored": mean([float(r["correct"]) for r in ok]),
        "width": mean([r["width"] for r in ok]),
        "depth": mean([r["depth"] for r in ok]),
        "width_soft": mean([r["width_soft"] for r in ok]),
        "depth_soft": mean([r["depth_soft"] for r in ok]),
        "rpts": {key: mean([r["rpts"][key] for r in ok]) for key in rpts_keys(metrics)},
        "filtered_accuracy": {
            key: filtered_accuracy(
                [bool(r["correct"]) for r in ok], [r["rpts"][key] for r in ok], metrics.filter_threshold
            )
            if ok
            else None
            for key in rpts_keys(metrics)
        },
        "answer_tokens": {"mean": mean(tok), "total": sum(tok), "counted_by": token_method},
        "chat": {name: c.stats.to_json() for name, c in chat_clients.items()},
        "seconds": round(time.time() - start, 1),
    }


def write_report(
    cfg: ReasoningEvalConfig,
    out_dir: Path,
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    unanswered: list[str],
    trees: dict[str, Tree],
) -> None:
    """report.json, trees.jsonl, the tree PNGs (output.plots) and report.md; prints the headline
    numbers and what was written."""
    report = {"config": to_dict(cfg), "summary": summary, "unanswered": unanswered, "items": rows}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_jsonl(out_dir / "trees.jsonl", ({"id": i, **t.to_json()} for i, t in trees.items()))
    pngs = render_trees(rows, trees, out_dir, cfg.metrics.threshold) if cfg.output.plots else []
    title = (
        f"Reasoning evaluation: {cfg.problems.format} problems, answers from {cfg.answers.source}, "
        f"{cfg.tree.kind} trees, {cfg.scorer.kind} scores"
    )
    (out_dir / "report.md").write_text(
        reasoning_report_md(title, summary, rows, cfg.metrics.filter_threshold, [p.relative_to(out_dir) for p in pngs]),
        encoding="utf-8",
    )
    headline = (
        "answered",
        "accuracy",
        "trees_scored",
        "trees_missing",
        "trees_unjudged",
        "width",
        "depth",
        "rpts",
        "filtered_accuracy",
    )
    print(json.dumps({k: summary[k] for k in headline}, indent=2))
    print(
        f"wrote {out_dir / 'report.json'}, {out_dir / 'report.md'}, {out_dir / 'trees.jsonl'}"
        + (f" and {len(pngs)} PNGs under {out_dir / 'trees'}" if pngs else "")
    )


def render_trees(rows: list[dict[str, Any]], trees: dict[str, Tree], out_dir: Path, threshold: float) -> list[Path]:
    """One PNG per tree under trees/, titled with its id, status and first RPTS; their paths."""
    pngs = []
    for r in rows:
        if r["id"] in trees:
            first = next(iter(r.get("rpts", {}).values()), None)
            title = f"{r['id']} - {r['status']} - RPTS {'n/a' if first is None else f'{first:.3f}'}"
            name = re.sub(r"[^\w.-]", "_", r["id"])
            pngs.append(
                render_tree(trees[r["id"]], out_dir / "trees" / f"{name}.png", title=title, threshold=threshold)
            )
    return pngs


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
