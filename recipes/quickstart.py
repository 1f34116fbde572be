"""The whole mmprm pipeline on a tiny VLM and a synthetic multimodal task, on a laptop CPU.

    make demo
    python recipes/quickstart.py --config recipes/configs/tiny/quickstart.yaml [key=value ...]

Stages (each one the real recipe, run as a user would run it, with a tiny config):
  1. data      synthetic colour-tile problems: SFT train set, annotation set, held-out dev + test sets
  2. model     `mmprm tiny-model`: a random-init Qwen2-VL-architecture model, or the checkpoint
               named by model.name_or_path (its own tokenizer, processor and chat template)
  3. policy    recipes/policy_sft.py: learn to solve in tagged steps (`sft_ranks` DDP processes)
  4. annotate  recipes/mcts_annotate.py: OmegaPRM MCTS labels the policy's own steps (HF backend),
               as `annotate_ranks` processes side by side, each on its share of the problems
  5. prm       recipes/prm_train.py on the same rollouts: the PRM with soft MC labels, an outcome
               model (one label per solution, from its final answer, read at its last token), and
               with `hard_prm=true` the PRM with hard labels (MC > 0 -> 1)
  6. bon       recipes/bon_rerank.py: N samples per held-out problem, scored by each reward model
  7. search    recipes/prm_search.py: PRM-guided beam search with the soft PRM against Best-of-N
               with the same PRM at matched generated tokens (the first `search_problems` test problems)
  8. report    OUTPUT_DIR/report.md + report.json + bon_curve.png + search_vs_bon.png: the aggregator
               is chosen on dev and read on test; every model against the outcome model with paired
               intervals

Stages 5-7 run in two lanes, one per core (`in_lanes`); their output goes to OUTPUT_DIR/logs/.

With `publish=true` (what `make demo` passes) the report, its JSON and plots are copied to
docs/demo/, which the README links to; the README itself is never rewritten.

A finished stage is skipped when rerun (its output is there); `force=true` reruns everything.
The PRM is also judged against ground truth: the synthetic task lets us check every step of every
test candidate exactly (`mmprm.data.synthetic.check_steps`), so step-level AUROC is real.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TaskConfig:
    """The synthetic colour-tile task the demo trains on.

    Attributes:
        train: SFT problems
        annotate: problems MCTS labels
        dev: held-out problems that choose the aggregator and the first-error threshold
        test: held-out problems every reported number is read on
        min_tiles: fewest tiles per image
        max_tiles: most tiles per image
        ops: comma-separated operations the questions use: +, -, *, cmp
        max_ops: most arithmetic/comparison steps per solution
        max_digit: tiles show digits 0..max_digit
        templates: comma-separated template names; empty: the synthetic module's defaults
        marks: a colour in the top half of each cell names its slot (a tiny VLM then finds
            "tile 3" by what it looks like, not by where it is; `mmprm.data.synthetic.SLOT_MARKS`)
        slip_rate: share of the SFT solutions that miscopy one running total they carry over (a
            careless slip they then go on from, `mmprm.data.synthetic.add_slips`); the policy
            learns to make such slips
    """

    train: int = 3000
    annotate: int = 150
    dev: int = 100
    test: int = 300
    min_tiles: int = 2
    max_tiles: int = 3
    ops: str = "+"
    max_ops: int = 3
    max_digit: int = 9
    templates: str = ""
    marks: bool = False
    slip_rate: float = 0.0

    def validate(self) -> None:
        if not 0.0 <= self.slip_rate <= 1.0:  # before any stage runs, not when the data stage reaches it
            raise ValueError(f"task.slip_rate: {self.slip_rate} is not a probability (use 0 to 1)")


@dataclass
class DemoModelConfig:
    """The model every stage starts from, and how it is loaded.

    Attributes:
        name_or_path: a checkpoint (directory or hub id) the policy is fine-tuned from and the reward
            models start from, with its own tokenizer, processor and chat template; empty: build the
            tiny random-init model (`arch`, `hidden_size`, `num_layers`)
        attn_implementation: attention kernel of every model the demo loads (passed to each stage): sdpa | flash_attention_2
            (mmprm[flash], CUDA) | eager | auto (flash-attn when installed and a GPU is visible, else sdpa)
    """

    name_or_path: str = ""
    attn_implementation: str = "sdpa"


@dataclass
class QuickstartConfig:
    """quickstart settings: the whole pipeline on a tiny model, stage by stage.

    Attributes:
        seed: seed of every stage
        output_dir: where each stage's output goes (a finished stage is skipped on rerun)
        force: redo every stage even when its output exists
        arch: tiny model architecture (mmprm tiny-model --arch), when model.name_or_path is empty
        hidden_size: tiny model hidden size
        num_layers: tiny model layers
        tokenizer_corpus: train the tiny model's tokenizer on the task's SFT text too, so that the task's
            words are single tokens as a real tokenizer's common words are (shorter sequences, every
            stage faster); off by default, which keeps the published demo reproducible
        task: the synthetic task (section)
        model: model loading, passed to every stage (section)
        n: candidates per held-out problem
        threads: intra-op threads per stage: tiny models gain nothing from more, and lose to contention
        sft_ranks: policy SFT processes (torchrun, DDP: gloo on CPU), each on its share of every
            batch, so `train.batch_size` in `sft` is per rank: one per core here, one per GPU on a node
        annotate_ranks: annotation processes side by side, each on its share of the problems (the last
            to finish merges): one per core here, one per GPU on a node
        sft: settings of the policy_sft stage over recipes/configs/tiny/policy_sft.yaml: its config keys,
            nested (`train: {lr: 2e-3}`) or dotted (`train.lr: 2e-3`); on the command line
            `sft.train.lr=2e-3` sets one, `sft={...}` replaces them all. Checked against
            recipes/policy_sft.py's config before any stage runs, passed to it as key=value overrides
        annotate: settings of the mcts_annotate stage (as `sft`)
        prm: settings of prm_train, shared by every reward model (as `sft`)
        orm: settings of the outcome model only, after `prm` (its rows share only their prompt, so
            tree packing may cost it more than it saves)
        hard_prm: also train the PRM on hard labels (MC > 0 -> 1) and report it beside the soft one:
            MM-PRM's label ablation, at the cost of a third reward model's training
        bon: settings of the bon_rerank stage (as `sft`)
        search_problems: test problems (the first ones) that PRM-guided search and its Best-of-N baseline
            run on at equal generated tokens; 0 skips the search stage
        search: settings of the prm_search stage (as `sft`; e.g. its `searches` and `bon.n`)
        publish: copy the report, its JSON and plots to docs/demo/ (the README only links there)
    """

    seed: int = 0
    output_dir: str = "runs/demo"
    force: bool = False
    arch: str = "qwen2_vl"
    hidden_size: int = 128
    num_layers: int = 2
    tokenizer_corpus: bool = False
    task: TaskConfig = field(default_factory=TaskConfig)
    model: DemoModelConfig = field(default_factory=DemoModelConfig)
    n: int = 8
    threads: int = 1
    sft_ranks: int = 1
    annotate_ranks: int = 2
    sft: dict[str, Any] = field(default_factory=dict)
    annotate: dict[str, Any] = field(default_factory=dict)
    prm: dict[str, Any] = field(default_factory=dict)
    orm: dict[str, Any] = field(default_factory=dict)
    hard_prm: bool = False
    bon: dict[str, Any] = field(default_factory=dict)
    search_problems: int = 150
    search: dict[str, Any] = field(default_factory=dict)
    publish: bool = False

    def validate(self) -> None:
        for key in ("sft_ranks", "annotate_ranks"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be >= 1")


MODELS = {  # report key -> (training output, Best-of-N output, name in the report)
    "soft": ("prm", "bon", "PRM, soft MC labels"),
    "hard": ("prm_hard", "bon_hard", "PRM, hard labels (MC > 0 -> 1)"),
    "outcome": ("orm", "bon_orm", "outcome model (final answer only)"),
}


def reward_models(cfg: QuickstartConfig) -> dict[str, tuple[str, str, str]]:
    """The MODELS this run trains and reports: the hard-label PRM only with `hard_prm`."""
    return {m: v for m, v in MODELS.items() if m != "hard" or cfg.hard_prm}


# Each stage's settings: the recipe it configures, that recipe's config class, the tiny config the
# demo starts it from. The outcome model is prm_train again, with `prm` then `orm`.
STAGES = {
    "sft": ("policy_sft", "PolicySFTConfig", "recipes/configs/tiny/policy_sft.yaml"),
    "annotate": ("mcts_annotate", "AnnotateConfig", "recipes/configs/tiny/mcts_annotate.yaml"),
    "prm": ("prm_train", "PRMTrainConfig", "recipes/configs/tiny/prm_train.yaml"),
    "orm": ("prm_train", "PRMTrainConfig", "recipes/configs/tiny/prm_train.yaml"),
    "bon": ("bon_rerank", "BonRerankConfig", "recipes/configs/tiny/bon_rerank.yaml"),
    "search": ("prm_search", "PRMSearchConfig", "recipes/configs/tiny/prm_search.yaml"),
}


def stage_overrides(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """A stage's settings (nested or dotted keys) as the `key=value` overrides its command line gets.

    A value is written as YAML reads it back: `{train: {lr: 2e-3}}` -> `["train.lr=2e-3"]`,
    `{"bon.n": [4, 8]}` -> `["bon.n=[4, 8]"]`, in the order the settings list them.
    """
    overrides = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            overrides += stage_overrides(value, f"{prefix}{key}.")
            continue
        if isinstance(value, str) and yaml.safe_load(value) == value:
            text = value  # plain text reads back as itself: no quotes, as a user types it
        else:
            text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=float("inf"))
            text = text.removesuffix("\n...\n").strip()  # a scalar's document end marker
        overrides.append(f"{prefix}{key}={text}")
    return overrides


def stage_config_class(recipe: str, name: str) -> type:
    """The config dataclass of recipes/RECIPE.py (imported as a module, its `main` not run)."""
    module_name = f"quickstart_stage_{recipe}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "recipes" / f"{recipe}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses resolve their annotations through it
        spec.loader.exec_module(module)
    return getattr(sys.modules[module_name], name)


def check_stage_settings(cfg: QuickstartConfig) -> dict[str, list[str]]:
    """Each stage's settings as its overrides, each checked against the stage recipe's own config.

    The stage's tiny config plus its settings go through `load_config` as the recipe loads them,
    so a misspelt key or a wrong type fails here, before any stage runs, naming the stage.
    """
    overrides = {name: stage_overrides(getattr(cfg, name)) for name in STAGES}
    for name, (recipe, cls_name, tiny_config) in STAGES.items():
        checked = overrides["prm"] + overrides["orm"] if name == "orm" else overrides[name]
        try:
            load_config(stage_config_class(recipe, cls_name), REPO / tiny_config, checked)
        except ConfigError as e:
            raise ConfigError(f"{name} (settings of recipes/{recipe}.py): {e}") from None
    return overrides


@dataclass
class Lane:
    """Where one lane's stage commands write their output, and the CPU seconds they took.

    Attributes:
        log_dir: where each stage's log goes (OUTPUT_DIR/logs); None: commands write to the terminal
        log: the log of the stage running now (None: the terminal)
        cpu: CPU seconds of the lane's finished commands
    """

    log_dir: Path | None = None
    log: Path | None = None
    cpu: float = 0.0


@dataclass
class Demo:
    """What every stage reads: the settings, where outputs go, and the time each stage took.

    Attributes:
        cfg: the quickstart settings
        out: OUTPUT_DIR, absolute
        overrides: each stage's settings as the key=value overrides its command line gets
        started: when the run started (time.time())
        timings: (stage, wall seconds, CPU seconds, status) of every stage so far
        times_lock: held while a lane reads or writes OUTPUT_DIR/stage_times.json
    """

    cfg: QuickstartConfig
    out: Path
    overrides: dict[str, list[str]]
    started: float
    timings: list[tuple[str, float, float, str]] = field(default_factory=list)
    times_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def policy(self) -> Path:
        return self.out / "policy"

    @property
    def mcts(self) -> Path:
        return self.out / "mcts"

    @property
    def prm(self) -> Path:
        """The soft PRM: what Best-of-N and the search score with."""
        return self.out / "prm"

    @property
    def prm_done(self) -> Path:
        """The file the soft PRM's stage writes last: there once the PRM is saved whole."""
        return self.prm / "mmprm_prm.json"

    @property
    def bon(self) -> Path:
        return self.out / "bon"

    @property
    def model_dir(self) -> Path | str:
        return self.cfg.model.name_or_path or self.out / "tiny_model"

    @property
    def attn(self) -> str:
        """The override every stage loads its models with (one attention kernel for the whole demo)."""
        return f"model.attn_implementation={self.cfg.model.attn_implementation}"


def stage(demo: Demo, lane: Lane, name: str, done: Path, fn) -> None:
    """Run one stage unless its output exists; time it (wall and CPU); one line before and after.

    Each stage's times are kept in OUTPUT_DIR/stage_times.json, so a rerun that skips it still
    reports the time it took when it ran. CPU time counts this thread and the stage's own
    commands only, so it stays right when two lanes run side by side.
    """
    times_file = demo.out / "stage_times.json"
    with demo.times_lock:
        recorded = json.loads(times_file.read_text()) if times_file.exists() else {}
    if done.exists() and not demo.cfg.force:
        print(f"==> [{name}] already done ({done}), skipping", flush=True)
        prev = recorded.get(name, {})
        demo.timings.append(
            (name, prev.get("wall", float("nan")), prev.get("cpu", float("nan")), "done in an earlier run")
        )
        return
    lane.log = lane.log_dir / f"{name}.log" if lane.log_dir else None
    print(f"==> [{name}] ..." + (f" (output: {lane.log})" if lane.log else ""), flush=True)
    t0, c0, k0 = time.time(), time.thread_time(), lane.cpu
    fn()
    wall, cpu = time.time() - t0, time.thread_time() - c0 + lane.cpu - k0
    demo.timings.append((name, wall, cpu, "ran"))
    with demo.times_lock:
        recorded = json.loads(times_file.read_text()) if times_file.exists() else {}
        recorded[name] = {"wall": round(wall, 1), "cpu": round(cpu, 1)}
        times_file.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"==> [{name}] done in {wall:.1f}s (CPU {cpu:.1f}s)", flush=True)


def run(lane: Lane, *args: str, env_extra: dict[str, str] | None = None) -> None:
    """A recipe or CLI as a subprocess; failure stops the demo.

    In a lane its output goes to the stage's log (two lanes' progress bars would interleave), and
    a failure prints the log's tail; otherwise its progress bars show. Its CPU time is added to the lane.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("MMPRM_THREADS", "1"))
    log = lane.log
    sink = open(log, "a") if log else None  # closed below, after the child exits
    try:
        child = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=sink, stderr=sink)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if sink:
            sink.close()
    lane.cpu += usage.ru_utime + usage.ru_stime
    if child.returncode != 0:
        if log:
            tail = "".join(Path(log).read_text(errors="replace").splitlines(keepends=True)[-30:])
            print(f"---- last lines of {log} ----\n{tail}", file=sys.stderr)
        raise SystemExit(f"quickstart: stage command failed (exit {child.returncode}): python {' '.join(args)}")


def run_ddp(lane: Lane, ranks: int, script: str, *args: str) -> None:
    """A training recipe as `ranks` DDP processes under torchrun (one process: plain python).

    Without a GPU, ACCELERATE_USE_CPU makes accelerate join the processes over gloo; without it
    each process would find no GPU and train alone on the whole data."""
    if ranks == 1:
        run(lane, script, *args)
        return
    import torch

    # --standalone: a rendezvous on this machine at a port torchrun picks free itself
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    run(lane, *launcher, script, *args, env_extra=None if torch.cuda.is_available() else {"ACCELERATE_USE_CPU": "true"})


def run_ranks(lane: Lane, ranks: int, logs: Path, *args: str) -> None:
    """One command as `ranks` processes side by side (`rank=K world_size=ranks` appended), as a
    multi-GPU user runs it with one process per GPU. With more than one, rank K's output goes to
    `logs`.rankK.log (two progress bars would interleave). Their CPU time is added to LANE's."""

    if ranks == 1:  # in this lane, so the output goes where the stage's would
        run(lane, *args, "rank=0", "world_size=1")
        return

    def one(rank: int) -> float:
        rank_lane = Lane(log=logs.with_name(f"{logs.name}.rank{rank}.log"))
        run(rank_lane, *args, f"rank={rank}", f"world_size={ranks}")
        return rank_lane.cpu

    logs.parent.mkdir(parents=True, exist_ok=True)
    print(f"    {ranks} ranks side by side, output in {logs}.rank*.log", flush=True)
    with concurrent.futures.ThreadPoolExecutor(ranks) as pool:
        cpu = sum(pool.map(one, range(ranks)))  # re-raises a rank's failure
    lane.cpu += cpu


def in_lanes(out: Path, *lanes) -> None:
    """Run each lane (a function of its `Lane`, running stages one after another) in its own thread:
    on two cores, two one-thread stages side by side halve the wait. Stage output goes to
    OUTPUT_DIR/logs/. A failed lane stops the demo once the others finish."""

    def lane(fn) -> None:
        log_dir = out / "logs"
        log_dir.mkdir(exist_ok=True)
        fn(Lane(log_dir=log_dir))

    with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
        futures = [pool.submit(lane, fn) for fn in lanes]
    for f in futures:
        f.result()  # re-raises a lane's failure


def search_problems_file(data: Path, limit: int) -> Path:
    """The first `limit` test problems of the held-out file, beside it (same relative image paths)."""
    from mmprm.data.schema import read_jsonl, write_jsonl

    rows = [r for r in read_jsonl(data / "heldout_problems.jsonl") if r["id"].startswith("test-")][:limit]
    path = data / "search_problems.jsonl"
    write_jsonl(path, rows)
    return path


def write_outcome_data(prm_file: Path, out_file: Path) -> dict:
    """Outcome-model rows from the same rollouts: each distinct complete solution once, its steps
    joined into one step, labelled 1.0/0.0 by its final answer, so the head is read at its end only.
    Solutions without an answer (cut off) are left out."""
    from mmprm.answers import answers_match
    from mmprm.data.schema import read_jsonl, write_jsonl
    from mmprm.steps import parse_solution

    rows, seen = [], set()
    for r in read_jsonl(prm_file):
        answer = parse_solution(r["steps"][-1]).answer if r["steps"] else None
        key = (r["meta"].get("problem_id"), tuple(r["steps"]))
        if answer is None or key in seen:
            continue
        seen.add(key)
        label = 1.0 if answers_match(answer, r["meta"]["gold"]) else 0.0
        rows.append(
            {
                "id": r["id"],
                "images": r["images"],
                "question": r["question"],
                "steps": [" ".join(r["steps"])],
                "labels": [label],
                "meta": r["meta"],
            }
        )
    write_jsonl(out_file, rows)
    return {"solutions": len(rows), "correct": int(sum(x["labels"][0] for x in rows))}


def write_outcome_candidates(cand_file: Path, out_file: Path) -> None:
    """The same candidates with each solution's steps joined into one, as the outcome model reads them."""
    from mmprm.data.schema import read_jsonl, write_jsonl

    rows = read_jsonl(cand_file)
    for row in rows:
        for c in row["candidates"]:
            c["steps"] = [" ".join(c["steps"])] if c["steps"] else []
    write_jsonl(out_file, rows)


def setup(argv: list[str]) -> Demo:
    """Read and check every setting (the stages' too), then make OUTPUT_DIR: nothing runs before."""
    config_path, overrides = parse_cli(argv, QuickstartConfig)
    cfg = load_config(QuickstartConfig, config_path, overrides)
    if cfg.model.name_or_path:
        require_model_dir(cfg, "model.name_or_path")
    from mmprm.models.loading import resolve_attn_implementation

    resolve_attn_implementation(cfg.model.attn_implementation)  # fail before the first stage, not in it
    stage_settings = check_stage_settings(cfg)
    started = time.time()
    os.environ.setdefault("MMPRM_THREADS", str(cfg.threads))
    import torch

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    if not out.is_absolute():
        out = REPO / out
    out.mkdir(parents=True, exist_ok=True)
    return Demo(cfg, out, stage_settings, started)


# ---- 1. data ---------------------------------------------------------------------------------
def make_data(cfg: QuickstartConfig, data: Path) -> None:
    """The task's four disjoint splits: SFT train (with slips), annotation, and dev + test held out."""
    from mmprm.data.synthetic import (
        SyntheticConfig,
        add_slips,
        generate,
        problem_key,
        text_only_accuracy,
        write_split,
    )

    t = cfg.task
    common = dict(
        min_tiles=t.min_tiles,
        max_tiles=t.max_tiles,
        ops=tuple(t.ops.split(",")),
        max_ops=t.max_ops,
        digits=(0, t.max_digit),
        templates=tuple(t.templates.split(",")) if t.templates else None,
        marks=t.marks,
    )
    splits, seen = {}, set()
    # Disjoint splits: no (template, tiles) pair is in two of them.
    for k, (name, size) in enumerate((("train", t.train), ("annotate", t.annotate), ("dev", t.dev), ("test", t.test))):
        prefix = "ann" if name == "annotate" else name
        try:
            splits[name] = generate(
                SyntheticConfig(num_problems=size, seed=cfg.seed + k, id_prefix=prefix, **common), exclude=seen
            )
        except ValueError as e:  # too few distinct problems for the splits asked for
            raise SystemExit(f"quickstart: task.{name}={size}: {e}") from None
        seen |= {problem_key(p.meta["template"], p.meta["cells"]) for p in splits[name]}
    write_split(add_slips(splits["train"], t.slip_rate, seed=cfg.seed), data, "train")
    write_split(splits["annotate"], data, "annotate")
    write_split(splits["dev"] + splits["test"], data, "heldout")  # one Best-of-N run, split by id prefix
    (data / "task.json").write_text(
        json.dumps(
            {"text_only_accuracy": text_only_accuracy(splits["train"], splits["test"]), **to_dict(cfg.task)},
            indent=2,
        )
    )


# ---- 2. tiny model (unless the user names a checkpoint to start from) -------------------------
def make_model(demo: Demo, lane: Lane) -> None:
    """`mmprm tiny-model`, or nothing when model.name_or_path names the checkpoint to start from."""
    cfg = demo.cfg
    if cfg.model.name_or_path:
        print(f"==> [model] starting from {demo.model_dir}", flush=True)
        return
    tiny_model = [
        "-m", "mmprm.cli", "tiny-model", "--arch", cfg.arch, "--out", str(demo.model_dir), "--seed", str(cfg.seed),
        "--hidden-size", str(cfg.hidden_size), "--layers", str(cfg.num_layers),
        *(["--corpus", str(demo.data / "train_sft.jsonl")] if cfg.tokenizer_corpus else []),
    ]  # fmt: skip
    stage(demo, lane, "model", Path(demo.model_dir) / "config.json", lambda: run(lane, *tiny_model))


# ---- 3. policy SFT ---------------------------------------------------------------------------
def train_policy(demo: Demo, lane: Lane) -> None:
    """recipes/policy_sft.py as `sft_ranks` DDP processes, with the `sft` settings."""
    args = [
        "recipes/policy_sft.py",
        "--config",
        "recipes/configs/tiny/policy_sft.yaml",
        f"model.name_or_path={demo.model_dir}",
        f"data.train_file={demo.data / 'train_sft.jsonl'}",
        f"data.eval_file={demo.data / 'heldout_sft.jsonl'}",
        f"output_dir={demo.policy}",
        f"train.seed={demo.cfg.seed}",
        "train.report_to=none",
        "train.overwrite_output_dir=true",  # a stage that runs again starts over (see stage())
        demo.attn,
        *demo.overrides["sft"],
    ]
    stage(demo, lane, "policy", demo.policy / "model.safetensors", lambda: run_ddp(lane, demo.cfg.sft_ranks, *args))


# ---- 4. MCTS annotation ----------------------------------------------------------------------
def annotate(demo: Demo, lane: Lane) -> None:
    """recipes/mcts_annotate.py as `annotate_ranks` processes, with the `annotate` settings."""
    args = [
        "recipes/mcts_annotate.py",
        "--config",
        "recipes/configs/tiny/mcts_annotate.yaml",
        f"policy.path={demo.policy}",
        f"data.problems_file={demo.data / 'annotate_problems.jsonl'}",
        f"output_dir={demo.mcts}",
        f"policy.sampling.seed={demo.cfg.seed}",
        demo.attn,
        *demo.overrides["annotate"],
    ]
    logs = demo.out / "logs" / "annotate"
    stage(
        demo,
        lane,
        "annotate",
        demo.mcts / "prm_data.jsonl",
        lambda: run_ranks(lane, demo.cfg.annotate_ranks, logs, *args),
    )


# ---- 5. reward models on the same rollouts (initialised from the policy, as MM-PRM does from its
# base): soft MC labels, outcome labels only, and with `hard_prm` hard labels ---------------------
def train_reward_model(demo: Demo, lane: Lane, train_file: Path, model_out: Path, *extra: str) -> None:
    """recipes/prm_train.py from the policy on TRAIN_FILE, with the `prm` settings, then EXTRA."""
    run(
        lane,
        "recipes/prm_train.py",
        "--config",
        "recipes/configs/tiny/prm_train.yaml",
        f"model.name_or_path={demo.policy}",
        f"data.train_file={train_file}",
        "data.eval_file=null",
        f"output_dir={model_out}",
        f"train.seed={demo.cfg.seed}",
        "train.report_to=none",
        "train.overwrite_output_dir=true",  # a stage that runs again starts over (see stage())
        demo.attn,
        *demo.overrides["prm"],
        *extra,
    )


def soft_prm(demo: Demo, lane: Lane, ended: threading.Event) -> None:
    """The PRM on the MC values as soft labels; sets ENDED when it is done or has failed, so that
    the other lane, which waits for it, never hangs."""

    def train() -> None:
        train_reward_model(demo, lane, demo.mcts / "prm_data.jsonl", demo.prm, "data.label_mode=soft")

    try:
        stage(demo, lane, "prm", demo.prm_done, train)
    finally:
        ended.set()


def hard_prm(demo: Demo, lane: Lane) -> None:
    """The PRM on hard labels. MC > 0 -> 1: a step from which any rollout reached the gold answer counts as right."""

    def train() -> None:
        labels = "data.label_mode=hard_any_correct"
        train_reward_model(demo, lane, demo.mcts / "prm_data.jsonl", demo.out / "prm_hard", labels)

    stage(demo, lane, "prm_hard", demo.out / "prm_hard" / "mmprm_prm.json", train)


def outcome_model(demo: Demo, lane: Lane) -> None:
    """The outcome model: one label per solution from its final answer, with `prm` then `orm` settings."""
    orm_file = demo.mcts / "outcome_data.jsonl"

    def train() -> None:
        print(f"outcome data: {write_outcome_data(demo.mcts / 'prm_data.jsonl', orm_file)}")
        train_reward_model(demo, lane, orm_file, demo.out / "orm", "data.label_mode=soft", *demo.overrides["orm"])

    stage(demo, lane, "orm", demo.out / "orm" / "mmprm_prm.json", train)


# ---- 6. Best-of-N on held-out problems: one set of candidates, each reward model's scores -------
def best_of_n(demo: Demo, lane: Lane) -> None:
    """recipes/bon_rerank.py: N candidates per held-out problem, scored by the soft PRM (`bon` settings)."""
    args = [
        "recipes/bon_rerank.py",
        "--config",
        "recipes/configs/tiny/bon_rerank.yaml",
        f"prm.path={demo.prm}",
        "candidates_file=null",
        "generate.enabled=true",
        f"policy.path={demo.policy}",
        f"generate.problems_file={demo.data / 'heldout_problems.jsonl'}",
        f"generate.n={demo.cfg.n}",
        f"policy.sampling.seed={demo.cfg.seed}",
        f"output_dir={demo.bon}",
        f"report.seed={demo.cfg.seed}",
        demo.attn,
        *demo.overrides["bon"],
    ]
    stage(demo, lane, "bon", demo.bon / "report.json", lambda: run(lane, *args))


def rescore(demo: Demo, lane: Lane, model: str, cand_file: Path) -> None:
    """recipes/bon_rerank.py on CAND_FILE with MODEL's scores (the `bon` settings but generation's)."""
    run(
        lane,
        "recipes/bon_rerank.py",
        "--config",
        "recipes/configs/tiny/bon_rerank.yaml",
        f"prm.path={demo.out / MODELS[model][0]}",
        f"candidates_file={cand_file}",
        "generate.enabled=false",
        f"output_dir={demo.out / MODELS[model][1]}",
        f"report.seed={demo.cfg.seed}",
        demo.attn,
        *[o for o in demo.overrides["bon"] if not o.startswith(("generate.", "policy."))],
    )


def rescore_hard(demo: Demo, lane: Lane) -> None:
    """The hard-label PRM's scores of the same candidates."""

    def run_it() -> None:
        rescore(demo, lane, "hard", demo.bon / "candidates.jsonl")

    stage(demo, lane, "bon_hard", demo.out / "bon_hard" / "report.json", run_it)


def rescore_outcome(demo: Demo, lane: Lane) -> None:
    """The outcome model's scores of the same candidates, whole and of every prefix."""

    def run_it() -> None:
        from demo.ablation import PREFIX_SCORES, write_outcome_prefix_scores

        write_outcome_candidates(demo.bon / "candidates.jsonl", demo.bon / "candidates_outcome.jsonl")
        rescore(demo, lane, "outcome", demo.bon / "candidates_outcome.jsonl")
        # The outcome model's score of every prefix of every candidate (its step scores in the
        # report): the slowest part of the evaluation, done in this lane so the report need not wait.
        write_outcome_prefix_scores(
            demo.out / "orm",
            demo.bon / "candidates.jsonl",
            demo.out / "bon_orm" / PREFIX_SCORES,
            demo.cfg.model.attn_implementation,
            progress=False,  # in-process: its bar would land in the main log between the lanes' lines
        )

    stage(demo, lane, "bon_orm", demo.out / "bon_orm" / "report.json", run_it)


def untrained_scores(demo: Demo, lane: Lane) -> None:
    """The step scores of the test candidates by a PRM head left at its seeded init on the policy:
    the report's floor, scored in this lane so the report need not wait."""

    from demo.ablation import UNTRAINED_SCORES, write_untrained_step_scores

    def run_it() -> None:
        # In-process and seeded: the other lane runs its stages as subprocesses meanwhile, so
        # nothing else in this process draws from torch's generator.
        write_untrained_step_scores(
            demo.policy, demo.bon / "candidates.jsonl", demo.bon / UNTRAINED_SCORES, demo.cfg.model.attn_implementation
        )

    stage(demo, lane, "untrained", demo.bon / UNTRAINED_SCORES, run_it)


# ---- 7. PRM-guided search vs Best-of-N at the same generated tokens (soft PRM) -----------------
def guided_search(demo: Demo, lane: Lane) -> None:
    """recipes/prm_search.py on the first `search_problems` test problems (`search` settings)."""
    cfg, search = demo.cfg, demo.out / "search"
    if cfg.search_problems <= 0:
        return

    def run_it() -> None:
        run(
            lane,
            "recipes/prm_search.py",
            "--config",
            "recipes/configs/tiny/prm_search.yaml",
            f"policy.path={demo.policy}",
            f"prm.path={demo.prm}",
            f"problems_file={search_problems_file(demo.data, cfg.search_problems)}",
            "limit=null",
            f"policy.sampling.seed={cfg.seed}",
            f"report.seed={cfg.seed}",
            f"output_dir={search}",
            demo.attn,
            *demo.overrides["search"],
        )

    stage(demo, lane, "search", search / "report.json", run_it)


def reward_models_and_sampling(demo: Demo) -> None:
    """Stages 5-7 in two lanes, one per core. Each lane waits only for what it reads; a failed lane
    sets its events so that the other one does not hang."""
    if demo.cfg.hard_prm:
        three_reward_models_in_lanes(demo)
    else:
        two_reward_models_in_lanes(demo)


def two_reward_models_in_lanes(demo: Demo) -> None:
    """Lane 1: the soft PRM, the Best-of-N candidates it scores, the untrained head's scores of
    them, then (once the outcome model is there) the outcome model's rescoring. Lane 2: the outcome
    model, then (once the soft PRM is there) the search. The outcome model trains longest (by row,
    where the soft PRM trains on tree packs) and the search is the longest evaluation, so each lane
    holds one of them; each lane waits only for the model it reads."""
    soft_ready, outcome_ready = threading.Event(), threading.Event()
    outcome_done = demo.out / MODELS["outcome"][0] / "mmprm_prm.json"

    def lane_soft_and_candidates(lane: Lane) -> None:
        soft_prm(demo, lane, soft_ready)
        if not demo.prm_done.exists():
            return
        best_of_n(demo, lane)
        untrained_scores(demo, lane)
        outcome_ready.wait()
        if outcome_done.exists():  # else lane 2 failed and says why
            rescore_outcome(demo, lane)

    def lane_outcome_and_search(lane: Lane) -> None:
        try:
            outcome_model(demo, lane)
        finally:
            outcome_ready.set()
        soft_ready.wait()
        if demo.prm_done.exists():  # else lane 1 failed and says why
            guided_search(demo, lane)

    in_lanes(demo.out, lane_soft_and_candidates, lane_outcome_and_search)


def three_reward_models_in_lanes(demo: Demo) -> None:
    """Each lane about two reward models' training long. Lane 1: the soft PRM, the hard PRM, then
    the hard PRM's rescoring of the candidates. Lane 2: the outcome model, then (once the soft PRM
    is there) the Best-of-N candidates, the search, the outcome model's rescoring."""
    soft_ready, candidates_ready = threading.Event(), threading.Event()
    bon_report = demo.bon / "report.json"

    def lane_prms(lane: Lane) -> None:
        soft_prm(demo, lane, soft_ready)
        hard_prm(demo, lane)
        candidates_ready.wait()
        if bon_report.exists():  # else lane 2 failed and says why
            rescore_hard(demo, lane)

    def lane_outcome_and_sampling(lane: Lane) -> None:
        try:
            outcome_model(demo, lane)
            soft_ready.wait()
            if demo.prm_done.exists():  # else lane 1 failed and says why
                best_of_n(demo, lane)
        finally:
            candidates_ready.set()
        if bon_report.exists():
            guided_search(demo, lane)
            rescore_outcome(demo, lane)

    in_lanes(demo.out, lane_prms, lane_outcome_and_sampling)


# ---- 8. ground-truth step evaluation and the report -------------------------------------------
def report(demo: Demo) -> None:
    """Check every test step against its exact label, then write OUTPUT_DIR/report.md and its JSON."""
    cfg, out = demo.cfg, demo.out
    print("==> [report] ...", flush=True)
    t0, c0 = time.time(), time.thread_time()
    from demo.ablation import evaluate
    from demo.report import write_report

    results = evaluate(
        out,
        demo.data,
        demo.policy,
        reward_models(cfg),
        n_resamples=1000,
        seed=cfg.seed,
        attn_implementation=cfg.model.attn_implementation,
    )
    demo.timings.append(("step eval + report", time.time() - t0, time.thread_time() - c0, "ran"))
    # The whole run's wall time, when this run made every output; a rerun reports the run that did.
    times_file = out / "stage_times.json"
    recorded = json.loads(times_file.read_text())
    if all(status == "ran" for *_, status in demo.timings):
        recorded["whole run"] = {"wall": round(time.time() - demo.started, 1)}
        times_file.write_text(json.dumps(recorded, indent=2) + "\n")
    # The report shows each stage's settings as the overrides its command line got.
    config = {**to_dict(cfg), **demo.overrides}
    write_report(out, config, results, demo.timings, recorded.get("whole run", {}).get("wall"))
    print(f"==> [report] {out / 'report.md'}", flush=True)


def main(argv: list[str]) -> None:
    demo = setup(argv)
    lane = Lane()  # stages 1-4 run here, their commands' output on the terminal
    stage(demo, lane, "data", demo.data / "task.json", lambda: make_data(demo.cfg, demo.data))
    make_model(demo, lane)
    train_policy(demo, lane)
    annotate(demo, lane)
    reward_models_and_sampling(demo)
    report(demo)
    if demo.cfg.publish:
        publish(demo.out)


def publish(out: Path) -> None:
    """Copy the report, its JSON and plots to docs/demo/.

    The README links to docs/demo/report.md instead of holding the numbers, so a run never edits
    prose that people wrote.
    """
    docs = REPO / "docs" / "demo"
    docs.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "report.json", "bon_curve.png", "search_vs_bon.png"):
        if (out / name).exists():
            shutil.copyfile(out / name, docs / name)
    print(f"==> [publish] {docs.relative_to(REPO)}/ updated from {out}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"quickstart: {e}", file=sys.stderr)
        sys.exit(2)
