r"""Train a (multimodal) process reward model with soft Monte-Carlo labels.

    # one process (CPU or one GPU)
    accelerate launch recipes/prm_train.py --config recipes/configs/tiny/prm_train.yaml
    # 8 GPUs, DeepSpeed ZeRO-2
    accelerate launch --config_file launch/accelerate/deepspeed_zero2.yaml \
        recipes/prm_train.py --config recipes/configs/qwen2_5_vl_7b/prm_train.yaml
    # any key can be overridden: train.lr=2e-6 data.label_mode=hard_any_correct resume_from_checkpoint=latest

The head is read at the step token after every step (`mmprm.steps.tokenize_steps`) and trained
with cross-entropy against the float label; eval metrics go to OUTPUT_DIR/metrics.jsonl and the
trackers; the final PRM is a standard HF directory in OUTPUT_DIR that `mmprm.load_prm` restores.
Rows are tokenized once into an on-disk cache (`data.cache_dir`, `data.num_proc` workers) and
their images opened per micro-batch (`mmprm.training.data`), so memory does not grow with the data.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from mmprm.config import ConfigError, load_config, parse_cli, require_files, require_model_dir
from mmprm.config_sections import TrainFilesConfig
from mmprm.data.schema import DataError
from mmprm.models.loading import resolve_attn_implementation
from mmprm.models.prm import PRMSpec, ProcessRewardModel, build_prm, save_prm
from mmprm.models.spec import TrainLayout, trained_spec
from mmprm.scoring.losses import soft_bce_value, soft_ce_token_pair
from mmprm.scoring.metrics import step_metrics
from mmprm.steps import StepTokenError
from mmprm.training import (
    TrainConfig,
    TrainingRun,
    TrainModelConfig,
    adapt_backbone,
    eval_share,
    leave_run,
    load_trainable_backbone,
    wrap_padding,
)
from mmprm.training.collate import model_input_keys
from mmprm.training.data import LabelMode, PackedPRMCollator, PRMCollator, load_tokenized, plan_tree_packs
from mmprm.training.vision_sync import vision_sync


@dataclass
class PRMConfig:
    """The PRM head and prompt.

    Attributes:
        head: token_pair (softmax over the LM logits of the two reward tokens) | value (a new linear head)
        reward_tokens: token_pair: the good and bad tokens whose logits score a step
        system_prompt: system message of every prompt; null uses none (scoring must use the same)
        layout: the input layout: mmprm (the question in the user turn, the steps in the assistant
            turn, each followed by mmprm's step token) | mm_prm (MM-PRM's: InternVL's system
            message, an empty user turn, then the image, "Question: q", "Process: s1<prm>s2<prm>"
            in the assistant turn, read at each <prm>; mmprm.models.spec.train_step_format). The
            PRM directory records it, so scoring lays out its input alike
    """

    head: str = "token_pair"
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    system_prompt: str | None = None
    layout: TrainLayout = "mmprm"


@dataclass
class PRMDataConfig(TrainFilesConfig):
    """Step-labelled training data (JSONL rows of id, question, steps, labels, images).

    Attributes:
        train_file: training rows, e.g. prm_data.jsonl from recipes/mcts_annotate.py; required
        eval_file: held-out rows for eval metrics; null skips evaluation
        max_length: tokens per example; trailing steps past it are dropped, and a negative row whose
            first error step would be cut is dropped whole (both counted in the log and metrics.jsonl)
        label_mode: soft (the MC value is the target) | hard (MC >= hard_threshold -> 1 else 0) |
            hard_any_correct (MM-PRM's hard labels: MC > 0 -> 1 else 0, i.e. some rollout from the step
            reached the answer; `mmprm.training.data.prm_labels`)
        hard_threshold: label_mode=hard only: the cut between good and bad steps
        balance: weight positive and negative steps (label >= 0.5 or not) to equal total weight over the
            training data (`balance_weights`); the loss stays a mean over the global batch's step tokens
        prompt_cache_mb: memory per process for the tokenized prompts and image tensors of recently
            seen problems (an MCTS export has several rows per problem; `PRMCollator`); 0: off
        pack_trees: train on one sequence per problem (`mmprm.training.packing`): its prompt and every step
            that several rows share are computed once, the loss is the rows' loss; train.batch_size
            then counts packs (a problem's rows, split at pack_tokens). Needs sdpa or eager attention
            (model.attn_implementation=auto then picks sdpa)
        pack_tokens: pack_trees: most tokens in one pack (at least max_length)
    """

    label_mode: LabelMode = "soft"
    hard_threshold: float = 0.5
    balance: bool = False
    prompt_cache_mb: float = 256
    pack_trees: bool = False
    pack_tokens: int = 4096


@dataclass
class PRMTrainConfig:
    """prm_train settings.

    Attributes:
        model: the backbone
        prm: the head
        data: the data
        train: the loop
        output_dir: where checkpoints, metrics.jsonl and the final PRM directory go
        resume_from_checkpoint: latest (the newest checkpoint in output_dir) or a checkpoint directory; null
            starts fresh (refused over checkpoints in output_dir unless train.overwrite_output_dir=true)
    """

    model: TrainModelConfig = field(default_factory=TrainModelConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    data: PRMDataConfig = field(default_factory=PRMDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/prm"
    resume_from_checkpoint: str | None = None

    def validate(self) -> None:
        if self.data.pack_trees and self.model.attn_implementation == "flash_attention_2":
            raise ValueError(
                "data.pack_trees needs attention that takes a tree mask: model.attn_implementation=sdpa, "
                "flex_attention or eager, not 'flash_attention_2' (or set data.pack_trees=false)"
            )
        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if self.model.attn_implementation == "flex_attention" and not torch.cuda.is_available():
            raise ValueError(
                "model.attn_implementation=flex_attention trains on a GPU only (torch's FlexAttention has no "
                "backward on CPU): use sdpa here"
            )
        if not self.model.name_or_path:
            raise ValueError("model.name_or_path: required (a HF model directory or hub name)")
        if not self.data.train_file:
            raise ValueError("data.train_file: required (step-labelled JSONL, see README)")
        if self.prm.head not in ("token_pair", "value"):
            raise ValueError(f"prm.head: {self.prm.head!r} is not one of ['token_pair', 'value']")
        if self.prm.layout == "mm_prm" and self.prm.system_prompt is not None:
            raise ValueError(
                "prm.system_prompt: the mm_prm layout writes InternVL's system message itself; leave it null"
            )
        if self.data.pack_trees and self.data.pack_tokens < self.data.max_length:
            raise ValueError(
                f"data.pack_tokens={self.data.pack_tokens} is below data.max_length={self.data.max_length}: "
                "a pack must hold at least one row"
            )


def step_loss(head_logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean soft cross-entropy over the step tokens of a micro-batch (weighted when balancing)."""
    if head_logits.ndim == 2:
        return soft_ce_token_pair(head_logits, targets, weights)
    return soft_bce_value(head_logits, targets, weights)


@torch.no_grad()
def evaluate(model, collate: PRMCollator, batch_size, accelerator, sync) -> tuple[dict[str, float], list[dict]]:
    """Step-level metrics on the eval split (each process scores an even share, gathered on all), and
    the per-step scores by example id. `sync`: `mmprm.training.vision_sync.vision_sync`."""
    model.eval()
    # An even share: under ZeRO-3 each forward gathers weights from all ranks, so a rank with one
    # batch fewer would leave the others waiting for ever.
    mine, count = eval_share(len(collate.data), accelerator.process_index, accelerator.num_processes)
    scores, labels, ids = [], [], []
    for start in range(0, len(mine), batch_size):
        batch, items = collate(mine[start : start + batch_size])
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with sync(batch):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        probs = ProcessRewardModel.probabilities(logits).tolist()
        pos = 0
        for t in items:  # nothing for a rank that only ran to keep the others company
            scores.append(probs[pos : pos + len(t.step_positions)])
            labels.append(t.labels)
            ids.append(t.id)
            pos += len(t.step_positions)
    from accelerate.utils import gather_object

    # wrap-around rows that only even out the forward passes are not counted
    scores, labels, ids = gather_object(scores[:count]), gather_object(labels[:count]), gather_object(ids[:count])
    model.train()
    return step_metrics(scores, labels, threshold=0.5), [{"id": i, "scores": s} for i, s in zip(ids, scores)]


@dataclass
class PRMData:
    """What prm_train trains and evaluates on.

    Attributes:
        train: the tokenized training rows
        eval: the tokenized eval rows; None without data.eval_file
        stats: what tokenization kept and dropped (`load_tokenized`)
        units: what a batch is made of: `rows`, or packs of one problem's rows (data.pack_trees)
        unit_lengths: tokens a unit runs, for length grouping
        unit_steps: step tokens of a unit, for the loss normaliser
        pos_weight: loss weight of a positive step (label >= 0.5), data.balance
        neg_weight: loss weight of a negative step
        balanced: the step losses are weighted by pos_weight / neg_weight
    """

    train: PRMCollator
    eval: PRMCollator | None
    stats: dict
    units: PRMCollator | PackedPRMCollator
    unit_lengths: list[int]
    unit_steps: list[int]
    pos_weight: float = 1.0
    neg_weight: float = 1.0
    balanced: bool = False


def build_model(cfg: PRMTrainConfig) -> tuple[ProcessRewardModel, Any, PRMSpec]:
    """The PRM on its backbone (vision tower frozen, LoRA, gradient checkpointing as configured),
    its processor and its spec."""
    attn = cfg.model.attn_implementation
    if cfg.data.pack_trees and attn == "auto":  # flash-attn takes no tree mask
        attn = "sdpa"
    backbone, processor = load_trainable_backbone(cfg.model, attn)
    p = cfg.prm
    spec = trained_spec(p.head, p.reward_tokens, p.system_prompt, p.layout)
    model = build_prm(backbone, processor, spec)
    model.backbone = adapt_backbone(model.backbone, cfg.model)
    return model, processor, spec


def load_data(cfg: PRMTrainConfig, processor, spec: PRMSpec, run: TrainingRun) -> PRMData:
    """Tokenize the train and eval rows, then weigh (data.balance) and pack (data.pack_trees) them.

    Text is tokenized once into an on-disk cache (one rank builds, the others wait on its lock);
    images are opened per micro-batch by the collator, which keeps only a bounded cache of recent
    prompts, so memory does not grow with the data.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    settings = {
        "max_length": cfg.data.max_length,
        "step_token": spec.step_token,
        "system": spec.system_prompt,
        # only when set, so that the default's tokenized-data cache keeps its key
        **({"layout": cfg.prm.layout} if cfg.prm.layout != "mmprm" else {}),
        "label_mode": cfg.data.label_mode,
        "hard_threshold": cfg.data.hard_threshold,
    }

    def tokenized(path: str) -> tuple[PRMCollator, dict]:
        data, stats = load_tokenized(
            path, "prm", processor, settings, cfg.data.cache_dir, cfg.data.num_proc, run.accelerator
        )
        collate = PRMCollator(
            data, processor, pad_id, source=path, prompt_cache_mb=cfg.data.prompt_cache_mb, **settings
        )
        return collate, stats

    collate, stats = tokenized(cfg.data.train_file)
    eval_collate = tokenized(cfg.data.eval_file)[0] if cfg.data.eval_file else None
    run.log(
        f"train: {stats['examples']} examples, {stats['kept']} kept "
        f"({'reused' if stats['reused'] else 'built'} cache {stats['cache']}); truncation to "
        f"max_length={cfg.data.max_length} cut {stats['dropped_steps']} trailing steps and dropped "
        f"{stats['dropped_prompt_too_long']} rows whose prompt and first step do not fit and "
        f"{stats['dropped_error_step_truncated']} negative rows whose first error step would be cut"
    )
    n_steps = collate.data.column("n_steps")  # step tokens per row, for the loss normaliser
    data = PRMData(collate, eval_collate, stats, collate, collate.data.column("length"), n_steps)
    if cfg.data.balance:
        balance_steps(data, run.log)
    if cfg.data.pack_trees:
        pack_trees(data, cfg.data.pack_tokens, run.log)
    return data


def balance_weights(n_pos: int, n_all: int) -> tuple[float, float]:
    """Loss weights (positive, negative) of a step that give each side half the weight of all
    `n_all` steps, `n_pos` of them positive; they average 1 over the data, so the loss is still
    divided by the step count (`train_micro_batch`)."""
    return n_all / (2 * max(1, n_pos)), n_all / (2 * max(1, n_all - n_pos))


def balance_steps(data: PRMData, log) -> None:
    """Weigh positive and negative steps so that each side carries half the loss (data.balance)."""
    n_pos, n_all = sum(data.train.data.column("n_pos")), sum(data.train.data.column("n_steps"))
    n_neg = n_all - n_pos
    data.pos_weight, data.neg_weight = balance_weights(n_pos, n_all)
    data.balanced = True
    log(
        f"balancing: {n_pos} positive / {n_neg} negative steps -> weights {data.pos_weight:.3f} / {data.neg_weight:.3f}"
    )


def pack_trees(data: PRMData, pack_tokens: int, log) -> None:
    """Make the training units packs of one problem's rows (data.pack_trees) instead of rows."""
    rows, n_steps = data.train.data, data.train.data.column("n_steps")
    plan = plan_tree_packs(rows, pack_tokens)
    data.units = PackedPRMCollator(data.train, plan.packs)
    data.unit_lengths = plan.lengths
    data.unit_steps = [sum(n_steps[i] for i in pack) for pack in plan.packs]
    log(
        f"tree packing: {len(rows)} rows in {len(plan.packs)} packs of at most {pack_tokens} "
        f"tokens; {sum(plan.lengths)} tokens to run instead of {plan.row_tokens} ({plan.ratio:.2f}x)"
    )
    if plan.ratio > 0.7:  # so few tokens saved that attention over whole packs can cost more
        log(
            "tree packing saves little here: a pack's attention spans all its branches, which can cost "
            "more than the shared tokens save; compare a few steps with data.pack_trees=false"
        )


def train_micro_batch(run: TrainingRun, sync, data: PRMData, batch: dict, items: list, k: int, n_window: int) -> float:
    """Forward and backward of micro-batch k of a window holding `n_window` step tokens on all
    ranks; returns its share of the window's mean loss. `sync`: `mmprm.training.vision_sync.vision_sync`."""
    accelerator = run.accelerator
    with accelerator.autocast(), sync(batch):
        logits = run.model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
    targets = batch["targets"]
    # a packed step stands for the rows through it: weighted by their count, it is their loss
    weights = batch.get("step_weights")
    if data.balanced:
        sides = torch.where(targets >= 0.5, data.pos_weight, data.neg_weight).to(targets.dtype)
        weights = sides if weights is None else weights * sides
    # the micro-batch's total weight, so that loss * row_steps is its weighted sum: divided by the
    # window's step count below, a step weighs the same whichever micro-batch or rank runs it
    row_steps = len(targets) if weights is None else float(weights.sum())
    loss = step_loss(logits, targets, weights)
    if not torch.isfinite(loss):
        ids = [t.id for t in items]
        raise FloatingPointError(
            f"non-finite loss {loss.item()} at step {run.progress.step}, micro-batch {k}, "
            f"example ids {ids}: lower train.lr or check these rows"
        )
    # backward() divides by grad_accum and DDP / DeepSpeed average the ranks' gradients:
    # both undone, the window's gradient is that of the mean over its step tokens
    scale = run.train.grad_accum * accelerator.num_processes / max(1, n_window)
    accelerator.backward(loss * row_steps * scale)
    return loss.item() * row_steps / max(1, n_window)


def run_eval(run: TrainingRun, collate: PRMCollator, sync) -> None:
    """Evaluate at the current step: metrics to metrics.jsonl, the step scores to
    eval_predictions.jsonl, the headline numbers to the log."""
    metrics, predictions = evaluate(run.model, collate, run.train.eval_batch_size, run.accelerator, sync)
    run.write_metrics({"split": "eval", "step": run.progress.step, **metrics})
    if run.accelerator.is_main_process:  # the latest eval's step scores, for error analysis
        (run.output_dir / "eval_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in predictions))
    run.log(
        f"step {run.progress.step} eval: "
        + " ".join(f"{k}={metrics[k]:.4f}" for k in ("bce", "brier", "step_accuracy", "first_error_f1") if k in metrics)
    )


def save_final(run: TrainingRun, processor) -> None:
    """The trained PRM as a standard HF directory in output_dir (`mmprm.load_prm` restores it)."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    # ZeRO-3 shards every weight, LoRA's base weights and adapters included: all ranks gather the
    # full state dict, then rank 0 writes it (merging LoRA into a copy that holds these weights).
    state = accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        save_prm(accelerator.unwrap_model(run.model), processor, run.output_dir, state_dict=state)
        run.log(f"saved PRM to {run.output_dir} (load with mmprm.load_prm('{run.output_dir}'))")


def main(argv: list[str]) -> None:
    """Set up (config, run, model, data, optimizer, resume), train, save the PRM, leave the run."""
    config_path, overrides = parse_cli(argv, PRMTrainConfig)
    cfg = load_config(PRMTrainConfig, config_path, overrides)
    require_model_dir(cfg, "model.name_or_path")
    run = TrainingRun("prm_train", cfg.train, cfg.output_dir, cfg.resume_from_checkpoint)
    require_files(cfg, "data.train_file", "data.eval_file")  # after the GPU and checkpoint checks, before the model
    model, processor, spec = build_model(cfg)
    # ZeRO-3 / FSDP: a batch without images still runs the vision tower, or the ranks' collectives part
    sync = vision_sync(run.accelerator, model.backbone, processor)
    data = load_data(cfg, processor, spec, run)
    run.prepare(model)
    unit = "packs" if cfg.data.pack_trees else "rows"
    run.batch_order(data.unit_lengths, unit)
    if padded := wrap_padding(len(data.unit_lengths), run.global_batch):
        run.log(
            f"{len(data.unit_lengths)} {unit} do not fill whole global batches of {run.global_batch}: each epoch's "
            f"last batch repeats {padded} {unit} from the epoch's start, so every process gets {cfg.train.batch_size}"
        )
    run.resume(cfg)
    if run.progress.step == 0:  # what tokenization kept and dropped, beside the losses it explains
        stats = {k: v for k, v in data.stats.items() if isinstance(v, (int, float))}
        run.write_metrics({"split": "data", "step": 0, **stats})

    micro_step = partial(train_micro_batch, run, sync, data)
    evaluate_now = partial(run_eval, run, data.eval, sync) if data.eval else None
    if run.fit(data.units, data.unit_steps, micro_step, evaluate_now):
        why = "as asked (train.stop_at_step)" if run.stopped_by == "stop_at_step" else "on the save notice (SIGUSR1)"
        run.log(f"stopping at step {run.progress.step} {why}; resume with resume_from_checkpoint=latest")
    else:
        save_final(run, processor)
    leave_run(run.accelerator)  # every rank waits for rank 0's save before the group goes down


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, StepTokenError, FileNotFoundError, FileExistsError) as e:
        print(f"prm_train: {e}", file=sys.stderr)
        sys.exit(2)
