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
their images opened per micro-batch (`mmprm.training_data`), so memory does not grow with the data.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmprm.collate import model_input_keys
from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.data.schema import DataError
from mmprm.models.loading import load_backbone, resolve_attn_implementation, vision_tower_parameters
from mmprm.models.prm import PRMSpec, ProcessRewardModel, build_prm, save_prm
from mmprm.models.sharding import log_zero3_partitions
from mmprm.models.vision_sync import vision_sync
from mmprm.packing import run_tokens
from mmprm.scoring.losses import soft_bce_value, soft_ce_token_pair
from mmprm.scoring.metrics import step_metrics
from mmprm.steps import StepTokenError
from mmprm.training import (
    METRICS_FILE,
    BatchStream,
    LoraConfig,
    Prefetcher,
    TrainConfig,
    TrainProgress,
    accelerator_kwargs,
    check_gpu,
    check_world_size,
    eval_share,
    find_checkpoint,
    launched_world_size,
    leave_run,
    lr_factor,
    rank_share,
    resolve_grad_accum,
    save_checkpoint,
    start_run,
    wrap_padding,
)
from mmprm.training_data import LabelMode, PackedPRMCollator, PRMCollator, load_tokenized, plan_tree_packs


@dataclass
class ModelConfig:
    """The backbone the PRM is built on.

    Attributes:
        name_or_path: backbone: a Hugging Face model directory (or hub id where the hub is reachable); required
        attn_implementation: attention kernel: sdpa | flash_attention_2 (mmprm[flash], CUDA) | flex_attention
            (FlexAttention; with data.pack_trees the tree is a block mask) | eager | auto
            (flash-attn when installed and a GPU is visible, else sdpa)
        dtype: weights dtype at load (float32, bfloat16, float16); use train.bf16 for mixed precision
        freeze_vision_tower: keep the vision encoder frozen (MM-PRM trains only the language model)
        gradient_checkpointing: recompute activations in the backward pass: less memory, the forward runs twice
        lora: LoRA adapters (section)
    """

    name_or_path: str = ""
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    freeze_vision_tower: bool = True
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class PRMConfig:
    """The PRM head and prompt.

    Attributes:
        head: token_pair (softmax over the LM logits of the two reward tokens) | value (a new linear head)
        reward_tokens: token_pair: the good and bad tokens whose logits score a step
        system_prompt: system message of every prompt; null uses none (scoring must use the same)
    """

    head: str = "token_pair"
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    system_prompt: str | None = None


@dataclass
class DataConfig:
    """Step-labelled training data (JSONL rows of id, question, steps, labels, images).

    Attributes:
        train_file: training rows, e.g. prm_data.jsonl from recipes/mcts_annotate.py; required
        eval_file: held-out rows for eval metrics; null skips evaluation
        max_length: tokens per example; trailing steps past it are dropped, and a negative row whose
            first error step would be cut is dropped whole (both counted in the log and metrics.jsonl)
        label_mode: soft (the MC value is the target) | hard (MC >= hard_threshold -> 1 else 0) |
            hard_any_correct (MM-PRM's hard labels: MC > 0 -> 1 else 0, i.e. some rollout from the step
            reached the answer; `mmprm.training_data.prm_labels`)
        hard_threshold: label_mode=hard only: the cut between good and bad steps
        balance: weight positive and negative steps (label >= 0.5 or not) to equal total weight
        num_proc: tokenization workers; null: the CPUs, at most 16
        cache_dir: tokenized-data cache (Arrow); null: $MMPRM_CACHE, else ~/.cache/mmprm/tokenized
        prompt_cache_mb: memory per process for the tokenized prompts and image tensors of recently
            seen problems (an MCTS export has several rows per problem; `PRMCollator`); 0: off
        pack_trees: train on one sequence per problem (`mmprm.packing`): its prompt and every step
            that several rows share are computed once, the loss is the rows' loss; train.batch_size
            then counts packs (a problem's rows, split at pack_tokens). Needs sdpa or eager attention
            (model.attn_implementation=auto then picks sdpa)
        pack_tokens: pack_trees: most tokens in one pack (at least max_length)
    """

    train_file: str = ""
    eval_file: str | None = None
    max_length: int = 2048
    label_mode: LabelMode = "soft"
    hard_threshold: float = 0.5
    balance: bool = False
    num_proc: int | None = None
    cache_dir: str | None = None
    prompt_cache_mb: float = 256
    pack_trees: bool = False
    pack_tokens: int = 4096


@dataclass
class Config:
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

    model: ModelConfig = field(default_factory=ModelConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
        if self.data.pack_trees and self.data.pack_tokens < self.data.max_length:
            raise ValueError(
                f"data.pack_tokens={self.data.pack_tokens} is below data.max_length={self.data.max_length}: "
                "a pack must hold at least one row"
            )
        if self.train.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"train.schedule: {self.train.schedule!r} is not one of ['cosine', 'linear', 'constant']")


def step_loss(head_logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean soft cross-entropy over the step tokens of a micro-batch (weighted when balancing)."""
    if head_logits.ndim == 2:
        return soft_ce_token_pair(head_logits, targets, weights)
    return soft_bce_value(head_logits, targets, weights)


@torch.no_grad()
def evaluate(model, collate: PRMCollator, batch_size, accelerator, sync) -> tuple[dict[str, float], list[dict]]:
    """Step-level metrics on the eval split (each process scores an even share, gathered on all), and
    the per-step scores by example id. `sync`: `mmprm.models.vision_sync.vision_sync`."""
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


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv, Config)
    cfg = load_config(Config, config_path, overrides)
    require_model_dir(cfg, "model.name_or_path")
    out_dir = Path(cfg.output_dir)
    log_with = None if cfg.train.report_to == "none" else cfg.train.report_to
    if log_with == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("train.report_to=wandb but wandb is not installed: pip install 'mmprm[wandb]'") from None
    use_bf16 = cfg.train.bf16 and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
    # Our LR schedule counts optimizer steps; gradient_accumulation_steps tells DeepSpeed which
    # micro-batch closes a step (see the loop).
    # The world size comes from the launcher: the Accelerator needs grad_accum when it is built.
    try:
        check_gpu(cfg.train)
        world_size = launched_world_size()
        resolve_grad_accum(cfg.train, world_size)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    accelerator = Accelerator(
        mixed_precision="bf16" if use_bf16 else "no",
        log_with=log_with,
        project_dir=str(out_dir),
        gradient_accumulation_steps=cfg.train.grad_accum,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=accelerator_kwargs(),
    )
    try:
        check_world_size(accelerator, world_size)
    except RuntimeError as e:
        raise ConfigError(str(e)) from None
    set_seed(cfg.train.seed)
    log = accelerator.print
    # before loading anything: a fresh start over another run's checkpoints is refused here
    ckpt = find_checkpoint(out_dir, cfg.resume_from_checkpoint, log=log, overwrite=cfg.train.overwrite_output_dir)

    # ---- model and data -------------------------------------------------------------------
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    attn = cfg.model.attn_implementation
    if cfg.data.pack_trees and attn == "auto":  # flash-attn takes no tree mask
        attn = "sdpa"
    backbone, processor = load_backbone(cfg.model.name_or_path, dtype=dtype, attn_implementation=attn)
    spec = PRMSpec(head=cfg.prm.head, reward_tokens=list(cfg.prm.reward_tokens), system_prompt=cfg.prm.system_prompt)
    model = build_prm(backbone, processor, spec)
    if cfg.model.freeze_vision_tower:
        for p in vision_tower_parameters(model.backbone):
            p.requires_grad_(False)
    if cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lora = cfg.model.lora
        model.backbone = get_peft_model(
            model.backbone,
            PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules
            ),
        )
    if cfg.model.gradient_checkpointing:
        model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # ZeRO-3 / FSDP: a batch without images still runs the vision tower, or the ranks' collectives part
    sync = vision_sync(accelerator, model.backbone, processor)
    tokenizer = getattr(processor, "tokenizer", processor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # Text tokenized once into an on-disk cache (one rank builds, the others wait on its lock);
    # images are opened per micro-batch by the collator, which keeps only a bounded cache of recent
    # prompts, so memory does not grow with the data.
    settings = {
        "max_length": cfg.data.max_length,
        "step_token": spec.step_token,
        "system": spec.system_prompt,
        "label_mode": cfg.data.label_mode,
        "hard_threshold": cfg.data.hard_threshold,
    }

    def tokenized(path: str) -> tuple[PRMCollator, dict]:
        data, stats = load_tokenized(
            path, "prm", processor, settings, cfg.data.cache_dir, cfg.data.num_proc, accelerator
        )
        collate = PRMCollator(
            data, processor, pad_id, source=path, prompt_cache_mb=cfg.data.prompt_cache_mb, **settings
        )
        return collate, stats

    collate, train_stats = tokenized(cfg.data.train_file)
    eval_collate = tokenized(cfg.data.eval_file)[0] if cfg.data.eval_file else None
    train_data = collate.data
    log(
        f"train: {train_stats['examples']} examples, {train_stats['kept']} kept "
        f"({'reused' if train_stats['reused'] else 'built'} cache {train_stats['cache']}); truncation to "
        f"max_length={cfg.data.max_length} cut {train_stats['dropped_steps']} trailing steps and dropped "
        f"{train_stats['dropped_prompt_too_long']} rows whose prompt and first step do not fit and "
        f"{train_stats['dropped_error_step_truncated']} negative rows whose first error step would be cut"
    )
    n_steps = train_data.column("n_steps")  # step tokens per row, for the loss normaliser
    n_pos, n_all = sum(train_data.column("n_pos")), sum(n_steps)
    pos_weight = neg_weight = 1.0
    if cfg.data.balance:
        n_neg = n_all - n_pos
        pos_weight = n_all / (2 * max(1, n_pos))
        neg_weight = n_all / (2 * max(1, n_neg))
        log(f"balancing: {n_pos} positive / {n_neg} negative steps -> weights {pos_weight:.3f} / {neg_weight:.3f}")

    # The units a batch is made of: rows, or packs of one problem's rows (data.pack_trees).
    train_collate, unit_lengths, unit_steps = collate, train_data.column("length"), n_steps
    if cfg.data.pack_trees:
        plan = plan_tree_packs(train_data, cfg.data.pack_tokens)
        train_collate = PackedPRMCollator(collate, plan.packs)
        unit_lengths = plan.lengths
        unit_steps = [sum(n_steps[i] for i in pack) for pack in plan.packs]
        log(
            f"tree packing: {len(train_data)} rows in {len(plan.packs)} packs of at most {cfg.data.pack_tokens} "
            f"tokens; {sum(plan.lengths)} tokens to run instead of {plan.row_tokens} ({plan.ratio:.2f}x)"
        )
        if plan.ratio > 0.7:  # so few tokens saved that attention over whole packs can cost more
            log(
                "tree packing saves little here: a pack's attention spans all its branches, which can cost "
                "more than the shared tokens save; compare a few steps with data.pack_trees=false"
            )

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.schedule)
    )
    ds = accelerator.state.deepspeed_plugin
    if ds is not None:
        # No dataloader goes through prepare(), so DeepSpeed cannot infer these "auto" values itself.
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds.deepspeed_config["gradient_clipping"] = cfg.train.max_grad_norm
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    log_zero3_partitions(accelerator, model, out_dir, log)
    global_batch = cfg.train.batch_size * accelerator.num_processes
    stream = BatchStream(unit_lengths, global_batch, cfg.train.seed, cfg.train.group_by_length)
    unit = "packs" if cfg.data.pack_trees else "rows"
    log(
        f"global batch: {cfg.train.batch_size} {unit} x {cfg.train.grad_accum} micro-step(s) x "
        f"{accelerator.num_processes} process(es) = {global_batch * cfg.train.grad_accum} {unit} per optimizer step"
    )
    if padded := wrap_padding(len(unit_lengths), global_batch):
        log(
            f"{len(unit_lengths)} {unit} do not fill whole global batches of {global_batch}: each epoch's last "
            f"batch repeats {padded} {unit} from the epoch's start, so every process gets {cfg.train.batch_size}"
        )
    progress = TrainProgress()
    accelerator.register_for_checkpointing(stream, progress)

    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        log(f"resumed from {ckpt} at step {progress.step}")
    run_id = start_run(accelerator, out_dir, ckpt, progress.step, cfg.train.overwrite_output_dir, log)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.resolved.json").write_text(
            json.dumps({**to_dict(cfg), "num_processes": accelerator.num_processes}, indent=2)
        )
    if log_with:
        accelerator.init_trackers("prm_train", config={k: str(v) for k, v in to_dict(cfg).items()})
    metrics_file = out_dir / METRICS_FILE

    def write_metrics(row: dict) -> None:
        if accelerator.is_main_process:
            with open(metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        accelerator.log(
            {f"{row['split']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"]
        )

    if progress.step == 0:  # what tokenization kept and dropped, beside the losses it explains
        write_metrics(
            {"split": "data", "step": 0, **{k: v for k, v in train_stats.items() if isinstance(v, (int, float))}}
        )

    # ---- training loop --------------------------------------------------------------------
    model.train()
    bar = tqdm(
        total=cfg.train.max_steps, initial=progress.step, desc="prm_train", disable=not accelerator.is_main_process
    )
    t0, tokens_seen, running = time.time(), 0, []
    prefetch = Prefetcher(train_collate, enabled=cfg.train.prefetch_batches)
    while progress.step < cfg.train.max_steps:
        global_batches = [stream.next() for _ in range(cfg.train.grad_accum)]
        micro_batches = [rank_share(b, accelerator.process_index, accelerator.num_processes) for b in global_batches]
        # the next step's micro-batches collate on a background thread while this step trains
        prefetch.submit(micro_batches)
        prefetch.submit(
            [
                rank_share(b, accelerator.process_index, accelerator.num_processes)
                for b in stream.peek(len(global_batches))
            ]
        )
        # The loss is a mean over the step tokens of the whole window on all ranks, so a step token
        # weighs the same whichever rank and micro-batch run it. Every rank holds the global batches,
        # so each counts them all without a collective.
        n_steps_total = sum(unit_steps[i] for b in global_batches for i in b)
        step_loss_sum = 0.0
        for k, idx in enumerate(micro_batches):
            batch, items = prefetch.get(idx)
            batch = {key: v.to(accelerator.device) for key, v in batch.items()}
            # accumulate() syncs (DDP all-reduce, DeepSpeed step) on the last of grad_accum micro-batches only
            with accelerator.accumulate(model):
                with accelerator.autocast(), sync(batch):
                    logits = model(
                        batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch)
                    )
                targets = batch["targets"]
                # a packed step stands for the rows through it: weighted by their count, it is their loss
                weights = batch.get("step_weights")
                row_steps = len(targets) if weights is None else float(weights.sum())
                if cfg.data.balance:
                    balance = torch.where(targets >= 0.5, pos_weight, neg_weight).to(targets.dtype)
                    weights = balance if weights is None else weights * balance
                loss = step_loss(logits, targets, weights)
                if not torch.isfinite(loss):
                    ids = [t.id for t in items]
                    raise FloatingPointError(
                        f"non-finite loss {loss.item()} at step {progress.step}, micro-batch {k}, "
                        f"example ids {ids}: lower train.lr or check these rows"
                    )
                # backward() divides by grad_accum and DDP / DeepSpeed average the ranks' gradients:
                # both undone, the window's gradient is that of the mean over its step tokens
                scale = cfg.train.grad_accum * accelerator.num_processes / max(1, n_steps_total)
                accelerator.backward(loss * row_steps * scale)
            step_loss_sum += loss.item() * row_steps / max(1, n_steps_total)
            tokens_seen += run_tokens(batch)
        # this rank's share of the window's mean; the ranks' shares add up to the loss trained on
        step_loss_sum = accelerator.reduce(torch.tensor(step_loss_sum, device=accelerator.device), "sum").item()
        if cfg.train.max_grad_norm > 0:
            accelerator.clip_grad_norm_(trainable, cfg.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.examples_seen += global_batch * cfg.train.grad_accum  # rows, or packs
        running.append(step_loss_sum)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss_sum:.4f}")

        if progress.step % cfg.train.log_every == 0 or progress.step == cfg.train.max_steps:
            elapsed = time.time() - t0
            write_metrics(
                {
                    "split": "train",
                    "step": progress.step,
                    "loss": sum(running) / len(running),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens_seen / max(elapsed, 1e-9),
                    "seconds": elapsed,
                }
            )
            running = []
        if eval_collate and (progress.step % cfg.train.eval_every == 0 or progress.step == cfg.train.max_steps):
            prefetch.wait()  # evaluation tokenizes with the same processor
            metrics, predictions = evaluate(model, eval_collate, cfg.train.eval_batch_size, accelerator, sync)
            write_metrics({"split": "eval", "step": progress.step, **metrics})
            if accelerator.is_main_process:  # the latest eval's step scores, for error analysis
                (out_dir / "eval_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in predictions))
            log(
                f"step {progress.step} eval: "
                + " ".join(
                    f"{k}={metrics[k]:.4f}" for k in ("bce", "brier", "step_accuracy", "first_error_f1") if k in metrics
                )
            )
        stopping = progress.step == cfg.train.stop_at_step
        if progress.step % cfg.train.save_every == 0 or progress.step == cfg.train.max_steps or stopping:
            save_checkpoint(accelerator, out_dir, progress.step, run_id=run_id, keep=cfg.train.keep_checkpoints)
        if stopping:
            log(
                f"stopping at step {progress.step} as asked (train.stop_at_step); resume with "
                "resume_from_checkpoint=latest"
            )
            prefetch.close()
            leave_run(accelerator)
            return
    prefetch.close()
    bar.close()

    # ---- save -----------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    # ZeRO-3 shards every weight, LoRA's base weights and adapters included: all ranks gather the
    # full state dict, then rank 0 writes it (merging LoRA into a copy that holds these weights).
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_prm(accelerator.unwrap_model(model), processor, out_dir, state_dict=state)
        log(f"saved PRM to {out_dir} (load with mmprm.load_prm('{out_dir}'))")
    leave_run(accelerator)  # every rank waits for rank 0's save before the group goes down


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, StepTokenError, FileNotFoundError, FileExistsError) as e:
        print(f"prm_train: {e}", file=sys.stderr)
        sys.exit(2)
