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
on-disk cache and their images opened per micro-batch (`mmprm.training_data`), as in prm_train.
The prompt format (system prompt, step mode) is saved beside the weights as `mmprm_policy.json`
(`mmprm.generation.policy`), and annotation and Best-of-N generation read it, so they prompt the policy
exactly as it was trained.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.data.schema import DataError, load_image
from mmprm.generation.policy import PolicySpec, save_policy_spec
from mmprm.models.loading import load_backbone, resolve_attn_implementation, vision_tower_parameters
from mmprm.models.sharding import log_zero3_partitions, merge_lora_copy
from mmprm.models.vision_sync import vision_sync
from mmprm.steps import parse_solution, prompt_text
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
from mmprm.training_data import IGNORE, SFTCollator, load_tokenized


@dataclass
class ModelConfig:
    """The policy to fine-tune.

    Attributes:
        name_or_path: base model: a Hugging Face model directory (or hub id where the hub is reachable);
            required
        attn_implementation: attention kernel: sdpa | flash_attention_2 (mmprm[flash], CUDA) | eager | auto
            (flash-attn when installed and a GPU is visible, else sdpa)
        dtype: weights dtype at load (float32, bfloat16, float16); use train.bf16 for mixed precision
        freeze_vision_tower: keep the vision encoder frozen (MM-PRM: language model updated, ViT frozen)
        gradient_checkpointing: recompute activations in the backward pass: less memory, the forward runs twice
        lora: LoRA adapters (section)
        system_prompt: system message of every prompt; annotation and Best-of-N must send the same
    """

    name_or_path: str = ""
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    freeze_vision_tower: bool = True
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    system_prompt: str | None = None


@dataclass
class DataConfig:
    """SFT rows (id, images, question, steps, answer); `mmprm convert-sft` writes them.

    Attributes:
        train_file: training rows (JSONL); required
        eval_file: held-out rows for loss, format compliance and accuracy; null skips evaluation
        max_length: tokens per example (prompt + target); longer examples are dropped and counted
        num_proc: tokenization workers; null: the CPUs, at most 16
        cache_dir: tokenized-data cache (Arrow); null: $MMPRM_CACHE, else ~/.cache/mmprm/tokenized
    """

    train_file: str = ""
    eval_file: str | None = None
    max_length: int = 2048
    num_proc: int | None = None
    cache_dir: str | None = None


@dataclass
class SFTTrainConfig(TrainConfig):
    """The training loop (mmprm.training.TrainConfig), with SFT's learning rate and eval generations.

    Attributes:
        lr: peak learning rate (AdamW)
        eval_generations: eval examples to answer greedily for format compliance and accuracy
        max_new_tokens: token cap of those eval generations
    """

    lr: float = 4e-5
    eval_generations: int = 64
    max_new_tokens: int = 256


@dataclass
class Config:
    """policy_sft settings.

    Attributes:
        model: the policy
        data: the data
        train: the loop
        output_dir: where checkpoints, metrics.jsonl and the final model directory go
        resume_from_checkpoint: latest (the newest checkpoint in output_dir) or a checkpoint directory; null
            starts fresh (refused over checkpoints in output_dir unless train.overwrite_output_dir=true)
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    output_dir: str = "runs/policy"
    resume_from_checkpoint: str | None = None

    def validate(self) -> None:
        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.model.name_or_path:
            raise ValueError("model.name_or_path: required (a HF model directory or hub name)")
        if not self.data.train_file:
            raise ValueError("data.train_file: required (SFT JSONL: id, images, question, steps, answer)")


def token_loss_sum(model, batch) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over assistant tokens, and their count."""
    labels = batch.pop("labels")
    logits = model(**batch, use_cache=False).logits  # (B, S, V)
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, int((shift_labels != IGNORE).sum())


@torch.no_grad()
def generate_eval(model, processor, data, cfg: Config, accelerator, sync) -> dict[str, float]:
    """Greedy solutions for the first eval rows: format compliance and answer accuracy.
    `sync`: `mmprm.models.vision_sync.vision_sync`."""
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
def eval_loss(model, collate: SFTCollator, batch_size, accelerator, sync) -> float:
    """Mean token loss on the eval split (each process an even share; wrap-around rows not counted).
    `sync`: `mmprm.models.vision_sync.vision_sync`."""
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    mine, n_real = eval_share(len(collate.data), accelerator.process_index, accelerator.num_processes)
    for start in range(0, len(mine), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + batch_size])[0].items()}
        if start + batch_size > n_real:  # padding rows: forward them (even passes), count nothing
            keep = torch.arange(batch["labels"].shape[0], device=accelerator.device) < n_real - start
            batch["labels"] = torch.where(keep[:, None], batch["labels"], IGNORE)
        with sync(batch):
            loss, n = token_loss_sum(model, batch)
        total, count = total + loss, count + n
    model.train()
    total, count = accelerator.reduce(total, "sum"), accelerator.reduce(count, "sum")
    return (total / count.clamp_min(1)).item()


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv, Config)
    cfg = load_config(Config, config_path, overrides)
    require_model_dir(cfg, "model.name_or_path")
    out_dir = Path(cfg.output_dir)
    log_with = None if cfg.train.report_to == "none" else cfg.train.report_to
    use_bf16 = cfg.train.bf16 and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
    # Our LR schedule counts optimizer steps: accelerate's default steps it once per process.
    # gradient_accumulation_steps tells DeepSpeed which micro-batch closes a step (see the loop).
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
    model, processor = load_backbone(
        cfg.model.name_or_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation
    )
    if cfg.model.freeze_vision_tower:
        for p in vision_tower_parameters(model):
            p.requires_grad_(False)
    if cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lora = cfg.model.lora
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules
            ),
        )
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # ZeRO-3 / FSDP: a batch without images still runs the vision tower, or the ranks' collectives part
    sync = vision_sync(accelerator, model, processor)
    tokenizer = getattr(processor, "tokenizer", processor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # Text tokenized once into an on-disk cache (one rank builds, the others wait on its lock);
    # images are opened per micro-batch by the collator, so memory does not grow with the data.
    settings = {"max_length": cfg.data.max_length, "system": cfg.model.system_prompt}

    def tokenized(path: str) -> tuple[SFTCollator, dict]:
        data, stats = load_tokenized(
            path, "sft", processor, settings, cfg.data.cache_dir, cfg.data.num_proc, accelerator
        )
        return SFTCollator(data, processor, pad_id, source=path, **settings), stats

    collate, train_stats = tokenized(cfg.data.train_file)
    train_data = collate.data
    log(
        f"train: {train_stats['kept']} examples kept, {train_stats['dropped_examples']} dropped (no assistant token "
        f"left within max_length={cfg.data.max_length}); {'reused' if train_stats['reused'] else 'built'} cache "
        f"{train_stats['cache']}"
    )
    eval_collate = tokenized(cfg.data.eval_file)[0] if cfg.data.eval_file else None
    n_targets = train_data.column("n_targets")  # loss tokens per row, for the loss normaliser

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
    stream = BatchStream(train_data.column("length"), global_batch, cfg.train.seed, cfg.train.group_by_length)
    log(
        f"global batch: {cfg.train.batch_size} rows x {cfg.train.grad_accum} micro-step(s) x "
        f"{accelerator.num_processes} process(es) = {global_batch * cfg.train.grad_accum} rows per optimizer step"
    )
    if padded := wrap_padding(len(train_data), global_batch):
        log(
            f"{len(train_data)} rows do not fill whole global batches of {global_batch}: each epoch's last batch "
            f"repeats {padded} rows from the epoch's start, so every process gets {cfg.train.batch_size} rows"
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
        accelerator.init_trackers("policy_sft", config={k: str(v) for k, v in to_dict(cfg).items()})

    def write_metrics(row: dict) -> None:
        if accelerator.is_main_process:
            with open(out_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")
        accelerator.log(
            {f"{row['split']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"]
        )

    def run_eval() -> None:
        row = {
            "split": "eval",
            "step": progress.step,
            "loss": eval_loss(model, eval_collate, cfg.train.eval_batch_size, accelerator, sync),
        }
        if cfg.train.eval_generations > 0:
            row.update(generate_eval(model, processor, eval_collate.data, cfg, accelerator, sync))
        write_metrics(row)
        log(f"step {progress.step} eval: " + " ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)))

    if eval_collate and progress.step == 0:
        run_eval()  # the untrained policy's numbers, to compare against

    # ---- training loop --------------------------------------------------------------------
    model.train()
    bar = tqdm(
        total=cfg.train.max_steps, initial=progress.step, desc="policy_sft", disable=not accelerator.is_main_process
    )
    t0, running = time.time(), []
    prefetch = Prefetcher(collate, enabled=cfg.train.prefetch_batches)
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
        # The loss is a mean over the assistant tokens of the whole window on all ranks, so a token
        # weighs the same whichever rank and micro-batch run it. Every rank holds the global batches,
        # so each counts them all without a collective.
        n_tokens = sum(n_targets[i] for b in global_batches for i in b)
        step_loss = 0.0
        for k, idx in enumerate(micro_batches):
            batch, items = prefetch.get(idx)
            batch = {key: v.to(accelerator.device) for key, v in batch.items()}
            # accumulate() syncs (DDP all-reduce, DeepSpeed step) on the last of grad_accum micro-batches only
            with accelerator.accumulate(model):
                with accelerator.autocast(), sync(batch):
                    loss_sum, _ = token_loss_sum(model, batch)
                if not torch.isfinite(loss_sum):
                    raise FloatingPointError(
                        f"non-finite loss at step {progress.step}, micro-batch {k}, example ids "
                        f"{[t['id'] for t in items]}: lower train.lr or check these rows"
                    )
                # backward() divides by grad_accum and DDP / DeepSpeed average the ranks' gradients:
                # both undone, the window's gradient is that of the mean over its tokens
                accelerator.backward(loss_sum * cfg.train.grad_accum * accelerator.num_processes / max(1, n_tokens))
            step_loss += loss_sum.item() / max(1, n_tokens)
        # this rank's share of the window's mean; the ranks' shares add up to the loss trained on
        step_loss = accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), "sum").item()
        if cfg.train.max_grad_norm > 0:
            accelerator.clip_grad_norm_(trainable, cfg.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.examples_seen += global_batch * cfg.train.grad_accum
        running.append(step_loss)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}")
        if progress.step % cfg.train.log_every == 0 or progress.step == cfg.train.max_steps:
            write_metrics(
                {
                    "split": "train",
                    "step": progress.step,
                    "loss": sum(running) / len(running),
                    "lr": scheduler.get_last_lr()[0],
                    "seconds": time.time() - t0,
                }
            )
            running = []
        if eval_collate and (progress.step % cfg.train.eval_every == 0 or progress.step == cfg.train.max_steps):
            prefetch.wait()  # evaluation tokenizes with the same processor
            run_eval()
        stopping = progress.step == cfg.train.stop_at_step
        if progress.step % cfg.train.save_every == 0 or progress.step == cfg.train.max_steps or stopping:
            save_checkpoint(accelerator, out_dir, progress.step, run_id=run_id, keep=cfg.train.keep_checkpoints)
        if stopping:
            log(f"stopping at step {progress.step} (train.stop_at_step); resume with resume_from_checkpoint=latest")
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
        final = accelerator.unwrap_model(model)
        if cfg.model.lora.enabled:
            final, state = merge_lora_copy(final, state), None  # the merged weights are its own
        final.save_pretrained(out_dir, state_dict=state)
        processor.save_pretrained(out_dir)
        # The prompt it learned, for annotation and Best-of-N (they read it unless overridden).
        save_policy_spec(out_dir, PolicySpec(system_prompt=cfg.model.system_prompt, step_mode="tags"))
        log(f"saved policy to {out_dir}")
    leave_run(accelerator)  # every rank waits for rank 0's save before the group goes down


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError, FileExistsError) as e:
        print(f"policy_sft: {e}", file=sys.stderr)
        sys.exit(2)
