r"""Teach a (multimodal) policy to solve in tagged steps: `<step>...</step>` per step, then `<answer>`.

    # one process (CPU or one GPU)
    accelerate launch recipes/policy_sft.py --config recipes/configs/tiny/policy_sft.yaml
    # 8 GPUs, DeepSpeed ZeRO-3
    accelerate launch --config_file launch/accelerate/deepspeed_zero3.yaml \
        recipes/policy_sft.py --config recipes/configs/qwen2_5_vl_7b/policy_sft.yaml
    # overrides: train.lr=4e-5 data.max_length=2048 resume_from_checkpoint=latest

The rendering is `mmprm.steps.render_solution`, the very format MCTS annotation parses. Loss is on
assistant tokens only; eval reports loss, format compliance (greedy generations that parse into
steps + an answer) and answer accuracy with `mmprm.answers`. Rows are tokenized once into an
on-disk cache and their images opened per micro-batch (`mmprm.training.data`), as in prm_train.
The prompt format (system prompt, step mode) is saved beside the weights as `mmprm_policy.json`
(`mmprm.generation.policy`), and annotation and Best-of-N generation read it, so they prompt the policy
exactly as it was trained.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from accelerate.utils import gather_object

from mmprm.config import ConfigError, load_config, parse_cli, require_files, require_model_dir
from mmprm.config_sections import TrainFilesConfig
from mmprm.data.schema import DataError, load_image
from mmprm.generation.policy import PolicySpec, save_policy_spec
from mmprm.models.loading import resolve_attn_implementation
from mmprm.models.sharding import merge_lora_copy
from mmprm.steps import parse_solution, prompt_text
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
from mmprm.training.data import IGNORE, SFTCollator, load_tokenized
from mmprm.training.lm_loss import next_token_loss_sum
from mmprm.training.packing import collate_sequence_packs, plan_sequence_packs, sequence_pack_inputs
from mmprm.training.vision_sync import vision_sync


@dataclass
class SFTModelConfig(TrainModelConfig):
    """The policy to fine-tune (mmprm.training.run.TrainModelConfig), with the system prompt it learns under.

    Attributes:
        system_prompt: system message of every prompt; annotation and Best-of-N must send the same
    """

    system_prompt: str | None = None


@dataclass
class SFTDataConfig(TrainFilesConfig):
    """SFT rows (id, images, question, steps, answer); `mmprm convert-sft` writes them.

    Attributes:
        eval_file: held-out rows for loss, format compliance and accuracy; null skips evaluation
        max_length: tokens per example (prompt + target); longer examples are dropped and counted
        num_proc: tokenization workers; null: the CPUs, at most 16
        cache_dir: tokenized-data cache (Arrow); null: $MMPRM_CACHE, else ~/.cache/mmprm/tokenized
        pack_sequences: train on sequences of several whole rows (`mmprm.training.packing`), each attending
            only to itself, instead of rows padded to the longest of their batch; the loss is the
            same. train.batch_size then counts packs. Needs sdpa, eager, flex_attention or
            flash_attention_2 (flash-attn's varlen kernel)
        pack_tokens: pack_sequences: most tokens in one pack (at least max_length)
    """

    pack_sequences: bool = False
    pack_tokens: int = 4096


@dataclass
class SFTTrainConfig(TrainConfig):
    """The training loop (mmprm.training.run.TrainConfig), with SFT's learning rate and eval generations.

    Attributes:
        lr: peak learning rate (AdamW)
        eval_generations: eval examples to answer greedily for format compliance and accuracy
        max_new_tokens: token cap of those eval generations
        loss_chunk_tokens: assistant tokens per chunk of LM-head logits (`mmprm.training.lm_loss`);
            null: 2**27 logits per chunk over the vocabulary (883 tokens at 151,936)
    """

    lr: float = 4e-5
    eval_generations: int = 64
    max_new_tokens: int = 256
    loss_chunk_tokens: int | None = None


@dataclass
class PolicySFTConfig:
    """policy_sft settings.

    Attributes:
        model: the policy
        data: the data
        train: the loop
        output_dir: where checkpoints, metrics.jsonl and the final model directory go
        resume_from_checkpoint: latest (the newest checkpoint in output_dir) or a checkpoint directory; null
            starts fresh (refused over checkpoints in output_dir unless train.overwrite_output_dir=true)
    """

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    output_dir: str = "runs/policy"
    resume_from_checkpoint: str | None = None

    def validate(self) -> None:
        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.model.name_or_path:
            raise ValueError("model.name_or_path: required (a HF model directory or hub name)")
        if not self.data.train_file:
            raise ValueError("data.train_file: required (SFT JSONL: id, images, question, steps, answer)")
        if self.train.loss_chunk_tokens is not None and self.train.loss_chunk_tokens < 1:
            raise ValueError(f"train.loss_chunk_tokens: must be >= 1 or null, got {self.train.loss_chunk_tokens}")
        if self.data.pack_sequences and self.data.pack_tokens < self.data.max_length:
            raise ValueError(
                f"data.pack_tokens={self.data.pack_tokens} is below data.max_length={self.data.max_length}: "
                "a pack must hold at least one row"
            )


def token_loss_sum(model, batch, chunk_tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over assistant tokens, and their count; the LM head's
    logits a chunk of tokens at a time (no full-vocabulary logits over a long batch). A batch of
    sequence packs (`PackedSFTCollator`: it carries position_ids) runs with attention within rows."""
    if "position_ids" not in batch:
        return next_token_loss_sum(model, batch, chunk_tokens)
    with sequence_pack_inputs(model, batch) as inputs:
        return next_token_loss_sum(model, inputs, chunk_tokens)


class PackedSFTCollator:
    """Packs of cached SFT rows -> one batch row per pack (`mmprm.training.packing.collate_sequence_packs`).

    `packs[i]` lists the row indices of pack i; a batch is a list of pack indices. Rows are
    tokenized and checked by the `SFTCollator`. Returns (batch, the rows' items).
    """

    def __init__(self, rows: SFTCollator, packs: list[list[int]]):
        self.rows, self.packs = rows, packs

    def __call__(self, indices: list[int]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        groups = [self.rows.items(self.packs[i]) for i in indices]
        return collate_sequence_packs(groups, self.rows.pad_id), [t for g in groups for t in g]


def pack_sequences(collate: SFTCollator, pack_tokens: int, log) -> tuple[PackedSFTCollator, list[int], list[int]]:
    """The training units as packs of whole rows (data.pack_sequences): their collator, token
    counts and assistant tokens (the loss normaliser), logged with how full the packs are."""
    lengths, n_targets = collate.data.column("length"), collate.data.column("n_targets")
    packs = plan_sequence_packs(lengths, pack_tokens)
    pack_lengths = [sum(lengths[i] for i in p) for p in packs]
    log(
        f"sequence packing: {len(lengths)} rows in {len(packs)} packs of at most {pack_tokens} tokens "
        f"({sum(lengths) / max(1, len(packs) * pack_tokens):.0%} full, {len(lengths) / max(1, len(packs)):.1f} rows a pack)"
    )
    return PackedSFTCollator(collate, packs), pack_lengths, [sum(n_targets[i] for i in p) for p in packs]


@torch.no_grad()
def generate_eval(model, processor, data, cfg: PolicySFTConfig, accelerator, sync) -> dict[str, float]:
    """Greedy solutions for the first eval rows: format compliance and answer accuracy.
    `sync`: `mmprm.training.vision_sync.vision_sync`."""
    from mmprm.answers import answers_match

    tokenizer = getattr(processor, "tokenizer", processor)
    model = accelerator.unwrap_model(model)
    model.eval()
    # an even share per process (generate() under ZeRO-3 needs every rank); wrapped rows not counted
    idx, count = eval_share(
        min(cfg.train.eval_generations, len(data)), accelerator.process_index, accelerator.num_processes
    )
    mine = [data[i] for i in idx]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # Llama 3 ships without one; padded columns are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    results = []
    for start in range(0, len(mine), cfg.train.eval_batch_size):
        chunk = mine[start : start + cfg.train.eval_batch_size]
        prompts = [prompt_text(processor, ex["question"], len(ex["images"]), cfg.model.system_prompt) for ex in chunk]
        images = [load_image(p) for ex in chunk for p in ex["images"]]
        if images:
            enc = processor(text=prompts, images=images, return_tensors="pt", padding=True)
        else:
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(accelerator.device) for k, v in enc.items()}
        with sync(enc, generate=True):
            out = model.generate(
                **enc, do_sample=False, max_new_tokens=cfg.train.max_new_tokens, pad_token_id=tokenizer.pad_token_id
            )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for ex, text in zip(chunk, texts):
            parsed = parse_solution(text)
            compliant = bool(parsed.steps) and parsed.complete
            correct = compliant and ex["answer"] is not None and answers_match(parsed.answer, ex["answer"])
            results.append((compliant, correct))
    tokenizer.padding_side = side
    model.train()
    results = gather_object(results[:count])
    n = max(1, len(results))
    return {
        "format_compliance": sum(c for c, _ in results) / n,
        "answer_accuracy": sum(a for _, a in results) / n,
        "generated": len(results),
    }


@torch.no_grad()
def eval_loss(model, collate: SFTCollator, batch_size, accelerator, sync, chunk_tokens: int | None = None) -> float:
    """Mean token loss on the eval split (each process an even share; wrap-around rows not counted).
    `sync`: `mmprm.training.vision_sync.vision_sync`."""
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    mine, n_real = eval_share(len(collate.data), accelerator.process_index, accelerator.num_processes)
    for start in range(0, len(mine), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + batch_size])[0].items()}
        if start + batch_size > n_real:  # padding rows: forward them (even passes), count nothing
            keep = torch.arange(batch["labels"].shape[0], device=accelerator.device) < n_real - start
            batch["labels"] = torch.where(keep[:, None], batch["labels"], IGNORE)
        with sync(batch):
            loss, n = token_loss_sum(model, batch, chunk_tokens)
        total, count = total + loss, count + n
    model.train()
    total, count = accelerator.reduce(total, "sum"), accelerator.reduce(count, "sum")
    return (total / count.clamp_min(1)).item()


def build_model(cfg: PolicySFTConfig) -> tuple[Any, Any]:
    """The policy (vision tower frozen, LoRA, gradient checkpointing as configured) and its processor."""
    model, processor = load_trainable_backbone(cfg.model)
    return adapt_backbone(model, cfg.model), processor


def load_data(cfg: PolicySFTConfig, processor, run: TrainingRun) -> tuple[SFTCollator, SFTCollator | None]:
    """The tokenized train and eval rows (eval None without data.eval_file).

    Text is tokenized once into an on-disk cache (one rank builds, the others wait on its lock);
    images are opened per micro-batch by the collator, so memory does not grow with the data.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    settings = {"max_length": cfg.data.max_length, "system": cfg.model.system_prompt}

    def tokenized(path: str) -> tuple[SFTCollator, dict]:
        data, stats = load_tokenized(
            path, "sft", processor, settings, cfg.data.cache_dir, cfg.data.num_proc, run.accelerator
        )
        return SFTCollator(data, processor, pad_id, source=path, **settings), stats

    collate, stats = tokenized(cfg.data.train_file)
    run.log(
        f"train: {stats['kept']} examples kept, {stats['dropped_examples']} dropped (no assistant token "
        f"left within max_length={cfg.data.max_length}); {'reused' if stats['reused'] else 'built'} cache "
        f"{stats['cache']}"
    )
    return collate, tokenized(cfg.data.eval_file)[0] if cfg.data.eval_file else None


def train_micro_batch(run: TrainingRun, sync, batch: dict, items: list, k: int, n_window: int) -> float:
    """Forward and backward of micro-batch k of a window holding `n_window` assistant tokens on all
    ranks; returns its share of the window's mean loss. `sync`: `mmprm.training.vision_sync.vision_sync`."""
    accelerator = run.accelerator
    with accelerator.autocast(), sync(batch):
        loss_sum, _ = token_loss_sum(run.model, batch, run.train.loss_chunk_tokens)
    if not torch.isfinite(loss_sum):
        raise FloatingPointError(
            f"non-finite loss at step {run.progress.step}, micro-batch {k}, example ids "
            f"{[t['id'] for t in items]}: lower train.lr or check these rows"
        )
    # backward() divides by grad_accum and DDP / DeepSpeed average the ranks' gradients:
    # both undone, the window's gradient is that of the mean over its tokens
    accelerator.backward(loss_sum * run.train.grad_accum * accelerator.num_processes / max(1, n_window))
    return loss_sum.item() / max(1, n_window)


def run_eval(run: TrainingRun, processor, collate: SFTCollator, cfg: PolicySFTConfig, sync) -> None:
    """Evaluate at the current step: loss and, with train.eval_generations, format compliance and
    accuracy of greedy generations, to metrics.jsonl and the log."""
    row = {
        "split": "eval",
        "step": run.progress.step,
        "loss": eval_loss(
            run.model, collate, cfg.train.eval_batch_size, run.accelerator, sync, cfg.train.loss_chunk_tokens
        ),
    }
    if cfg.train.eval_generations > 0:
        row.update(generate_eval(run.model, processor, collate.data, cfg, run.accelerator, sync))
    run.write_metrics(row)
    run.log(
        f"step {run.progress.step} eval: " + " ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float))
    )


def save_final(run: TrainingRun, processor, cfg: PolicySFTConfig) -> None:
    """The trained policy in output_dir (LoRA merged), its processor and the prompt it learned."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    # ZeRO-3 shards every weight, LoRA's base weights and adapters included: all ranks gather the
    # full state dict, then rank 0 writes it (merging LoRA into a copy that holds these weights).
    state = accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(run.model)
        if cfg.model.lora.enabled:
            final, state = merge_lora_copy(final, state), None  # the merged weights are its own
        final.save_pretrained(run.output_dir, state_dict=state)
        processor.save_pretrained(run.output_dir)
        # The prompt it learned, for annotation and Best-of-N (they read it unless overridden).
        save_policy_spec(run.output_dir, PolicySpec(system_prompt=cfg.model.system_prompt, step_mode="tags"))
        run.log(f"saved policy to {run.output_dir}")


def main(argv: list[str]) -> None:
    """Set up (config, run, model, data, optimizer, resume), train, save the policy, leave the run."""
    config_path, overrides = parse_cli(argv, PolicySFTConfig)
    cfg = load_config(PolicySFTConfig, config_path, overrides)
    require_model_dir(cfg, "model.name_or_path")
    run = TrainingRun("policy_sft", cfg.train, cfg.output_dir, cfg.resume_from_checkpoint)
    require_files(cfg, "data.train_file", "data.eval_file")  # after the GPU and checkpoint checks, before the model
    model, processor = build_model(cfg)
    # ZeRO-3 / FSDP: a batch without images still runs the vision tower, or the ranks' collectives part
    sync = vision_sync(run.accelerator, model, processor)
    collate, eval_collate = load_data(cfg, processor, run)
    run.prepare(model)
    # assistant tokens per unit (row or pack), for the loss normaliser
    if cfg.data.pack_sequences:
        units, lengths, n_targets = pack_sequences(collate, cfg.data.pack_tokens, run.log)
        run.batch_order(lengths, unit="packs")
    else:
        units, n_targets = collate, collate.data.column("n_targets")
        run.batch_order(collate.data.column("length"))
    n_units, global_batch, unit = len(n_targets), run.global_batch, run.unit
    if padded := wrap_padding(n_units, global_batch):
        run.log(
            f"{n_units} {unit} do not fill whole global batches of {global_batch}: each epoch's last batch "
            f"repeats {padded} {unit} from the epoch's start, so every process gets {cfg.train.batch_size} {unit}"
        )
    run.resume(cfg)
    evaluate_now = partial(run_eval, run, processor, eval_collate, cfg, sync) if eval_collate else None
    if evaluate_now and run.progress.step == 0:
        evaluate_now()  # the untrained policy's numbers, to compare against

    if run.fit(units, n_targets, partial(train_micro_batch, run, sync), evaluate_now):
        why = "(train.stop_at_step)" if run.stopped_by == "stop_at_step" else "on the save notice (SIGUSR1)"
        run.log(f"stopping at step {run.progress.step} {why}; resume with resume_from_checkpoint=latest")
    else:
        save_final(run, processor, cfg)
    leave_run(run.accelerator)  # every rank waits for rank 0's save before the group goes down


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError, FileExistsError) as e:
        print(f"policy_sft: {e}", file=sys.stderr)
        sys.exit(2)
