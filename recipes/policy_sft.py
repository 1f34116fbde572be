r"""Teach a (multimodal) policy to solve in tagged steps: `<step>...</step>` per step, then `<answer>`.

    # one process (CPU or one GPU)
    accelerate launch recipes/policy_sft.py --config recipes/configs/tiny/policy_sft.yaml
    # 8 GPUs, DeepSpeed ZeRO-3
    accelerate launch --config_file launch/accelerate/deepspeed_zero3.yaml \
        recipes/policy_sft.py --config recipes/configs/qwen2_5_vl_7b/policy_sft.yaml
    # overrides: train.lr=4e-5 data.max_length=2048 resume_from_checkpoint=latest

The rendering is `mmprm.steps.render_solution`, the very format MCTS annotation parses. Loss is on
assistant tokens only; eval reports loss, format compliance (greedy generations that parse into
steps + an answer) and answer accuracy with `mmprm.answers`. The prompt format (system prompt,
step mode) is saved beside the weights as `mmprm_policy.json` (`mmprm.policy`), and annotation
and Best-of-N generation read it, so they prompt the policy exactly as it was trained.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.data.schema import DataError, load_examples, load_image
from mmprm.models.loading import load_backbone, resolve_attn_implementation, vision_tower_parameters
from mmprm.models.sharding import partition_report, partition_summary
from mmprm.models.prm import PER_TOKEN_KEYS, collate_model_inputs
from mmprm.policy import PolicySpec, save_policy_spec
from mmprm.steps import assistant_start, parse_solution, prompt_text, render_solution
from mmprm.training import (BatchStream, TrainProgress, find_checkpoint, lr_factor, process_group_kwargs,
                            rank_share)

IGNORE = -100


@dataclass
class LoraConfig:
    """LoRA adapters on the language model (peft); off trains all unfrozen weights.

    Attributes:
        enabled: train LoRA adapters instead of the full language model
        r: adapter rank
        alpha: adapter scaling numerator (scale = alpha / r)
        dropout: dropout on the adapter input
        target_modules: names of the linear layers that get adapters
    """

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


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
        gradient_checkpointing: recompute activations in the backward pass: less memory, ~30% slower
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
    """

    train_file: str = ""
    eval_file: str | None = None
    max_length: int = 2048


@dataclass
class TrainConfig:
    """The training loop.

    Attributes:
        seed: seed of data order, initialisation of new weights and dropout
        max_steps: optimizer steps to train (one epoch = ceil(rows / global batch))
        batch_size: examples per process per micro-step
        grad_accum: micro-steps per optimizer step (global batch = batch_size x grad_accum x processes)
        weight_decay: AdamW weight decay
        warmup_steps: linear warmup steps before the schedule
        schedule: learning-rate schedule after warmup: cosine | linear | constant
        max_grad_norm: clip the global gradient norm to this (0 turns clipping off)
        bf16: bf16 mixed precision (where the device supports it)
        group_by_length: batch examples of similar length together (less padding)
        log_every: log loss and learning rate every N optimizer steps
        eval_every: evaluate on data.eval_file every N optimizer steps
        save_every: write a resumable checkpoint every N optimizer steps
        eval_batch_size: examples per forward during evaluation
        report_to: tracker for metrics: tensorboard | wandb | none
        stop_at_step: stop early at this step with a checkpoint (e.g. before a Slurm time limit); null runs to
            max_steps
        lr: peak learning rate (AdamW)
        eval_generations: eval examples to answer greedily for format compliance and accuracy
        max_new_tokens: token cap of those eval generations
    """

    seed: int = 42
    max_steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 4e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: bool = False
    group_by_length: bool = True
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    eval_batch_size: int = 8
    eval_generations: int = 64
    max_new_tokens: int = 256
    report_to: str = "tensorboard"
    stop_at_step: int | None = None


@dataclass
class Config:
    """policy_sft settings.

    Attributes:
        model: the policy
        data: the data
        train: the loop
        output_dir: where checkpoints, metrics.jsonl and the final model directory go
        resume_from_checkpoint: latest (the newest checkpoint in output_dir) or a checkpoint directory; null
            starts fresh
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/policy"
    resume_from_checkpoint: str | None = None

    def validate(self) -> None:
        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.model.name_or_path:
            raise ValueError("model.name_or_path: required (a HF model directory or hub name)")
        if not self.data.train_file:
            raise ValueError("data.train_file: required (SFT JSONL: id, images, question, steps, answer)")


def tokenize_sft(processor, ex, max_length: int, system: str | None):
    """ids + loss labels for one example: prompt tokens are masked, the rendered solution is learned.

    Returns None when truncation leaves no assistant token (the example is dropped and counted).
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    images = [load_image(p) for p in ex.images]
    prompt, lead = assistant_start(processor, ex.question, len(images), system)
    # The lead (" " after LLaVA-1.5's "ASSISTANT:") is learned with the answer, as the model generates it.
    answer = lead + render_solution(ex.steps, ex.answer) + (tokenizer.eos_token or "")
    if images:
        enc = processor(text=[prompt + answer], images=images, return_tensors="pt")
        n_prompt = len(processor(text=[prompt], images=images, return_tensors="pt")["input_ids"][0])
    else:
        enc = tokenizer([prompt + answer], return_tensors="pt", add_special_tokens=False)
        n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = enc["input_ids"][0].tolist()
    if n_prompt >= min(len(ids), max_length):
        return None
    ids = ids[:max_length]
    labels = [IGNORE] * n_prompt + ids[n_prompt:]
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    for key in PER_TOKEN_KEYS:
        if key in extra:
            extra[key] = extra[key][:, :max_length]
    return {"id": ex.id, "input_ids": ids, "labels": labels, "extra": extra}


def collate(items, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(t["input_ids"]) for t in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, t in enumerate(items):
        n = len(t["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(t["input_ids"]), torch.tensor(t["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            **collate_model_inputs([t["extra"] for t in items], width)}


def token_loss_sum(model, batch) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over assistant tokens, and their count."""
    labels = batch.pop("labels")
    logits = model(**batch, use_cache=False).logits  # (B, S, V)
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                             shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, int((shift_labels != IGNORE).sum())


@torch.no_grad()
def generate_eval(model, processor, examples, cfg: Config, accelerator) -> dict[str, float]:
    """Greedy solutions for eval examples: format compliance and answer accuracy."""
    from mmprm.answers import answers_match

    tokenizer = getattr(processor, "tokenizer", processor)
    model = accelerator.unwrap_model(model)
    model.eval()
    chosen = examples[: cfg.train.eval_generations]
    mine = chosen[accelerator.process_index :: accelerator.num_processes]
    # Same number of generate calls on every rank (ZeRO-3 forwards are collective; transformers
    # syncs the decoding steps within a call, not the number of calls).
    n_chunks = math.ceil(math.ceil(len(chosen) / accelerator.num_processes) / cfg.train.eval_batch_size)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # Llama 3 ships without one; padded columns are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    results = []
    for c in range(n_chunks):
        chunk = mine[c * cfg.train.eval_batch_size : (c + 1) * cfg.train.eval_batch_size]
        keep = bool(chunk)
        chunk = chunk or chosen[:1]
        prompts = [prompt_text(processor, ex.question, len(ex.images), cfg.model.system_prompt) for ex in chunk]
        images = [load_image(p) for ex in chunk for p in ex.images]
        if images:
            enc = processor(text=prompts, images=images, return_tensors="pt", padding=True)
        else:
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(accelerator.device) for k, v in enc.items()}
        out = model.generate(**enc, do_sample=False, max_new_tokens=cfg.train.max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for ex, text in zip(chunk if keep else [], texts):
            parsed = parse_solution(text)
            compliant = bool(parsed.steps) and parsed.complete
            correct = compliant and ex.answer is not None and answers_match(parsed.answer, ex.answer)
            results.append((compliant, correct))
    tokenizer.padding_side = side
    model.train()
    results = gather_object(results)
    n = max(1, len(results))
    return {"format_compliance": sum(c for c, _ in results) / n, "answer_accuracy": sum(a for _, a in results) / n,
            "generated": len(results)}


@torch.no_grad()
def eval_loss(model, data, pad_id, batch_size, accelerator) -> float:
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    mine = data[accelerator.process_index :: accelerator.num_processes]
    # Same number of forwards on every rank: a ZeRO-3 forward gathers weights from all of them.
    n_batches = math.ceil(math.ceil(len(data) / accelerator.num_processes) / batch_size)
    for b in range(n_batches):
        items = mine[b * batch_size : (b + 1) * batch_size]
        batch = {k: v.to(accelerator.device) for k, v in collate(items or data[:1], pad_id).items()}
        loss, n = token_loss_sum(model, batch)
        if items:  # a rank out of rows only keeps the others company
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
    accelerator = Accelerator(mixed_precision="bf16" if use_bf16 else "no", log_with=log_with, project_dir=str(out_dir),
                              gradient_accumulation_steps=cfg.train.grad_accum, step_scheduler_with_optimizer=False,
                              kwargs_handlers=process_group_kwargs())
    set_seed(cfg.train.seed)
    log = accelerator.print

    # ---- model and data -------------------------------------------------------------------
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    model, processor = load_backbone(cfg.model.name_or_path, dtype=dtype,
                                   attn_implementation=cfg.model.attn_implementation)
    if cfg.model.freeze_vision_tower:
        for p in vision_tower_parameters(model):
            p.requires_grad_(False)
    if cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        lora = cfg.model.lora
        model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=lora.target_modules))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokenizer = getattr(processor, "tokenizer", processor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def load(path):
        examples = load_examples(path)
        missing = [e.id for e in examples if e.answer is None]
        if missing:
            raise DataError([f"{path}: id={i}: answer: missing (SFT rows need the final answer)" for i in missing])
        rows = [tokenize_sft(processor, e, cfg.data.max_length, cfg.model.system_prompt)
                for e in tqdm(examples, desc=f"tokenizing {Path(path).name}", disable=not accelerator.is_main_process)]
        kept = [r for r in rows if r is not None]
        return examples, kept, len(rows) - len(kept)

    _, train_data, dropped = load(cfg.data.train_file)
    log(f"train: {len(train_data)} examples kept, {dropped} dropped (no assistant token left within "
        f"max_length={cfg.data.max_length})")
    eval_examples, eval_data = ([], [])
    if cfg.data.eval_file:
        eval_examples, eval_data, _ = load(cfg.data.eval_file)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.schedule))
    ds = accelerator.state.deepspeed_plugin
    if ds is not None:
        # No dataloader goes through prepare(), so DeepSpeed cannot infer these "auto" values itself.
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds.deepspeed_config["gradient_clipping"] = cfg.train.max_grad_norm
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    partitions = partition_report(accelerator.unwrap_model(model))
    if any(r["partitioned"] for r in partitions):
        # ZeRO-3: say what each rank really holds (weights under the persistence threshold stay whole)
        log(partition_summary(accelerator.unwrap_model(model), partitions))
        if accelerator.is_main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "zero3_partitions.json").write_text(json.dumps(
                {"num_processes": accelerator.num_processes, "rank": 0, "parameters": partitions}, indent=1))
    global_batch = cfg.train.batch_size * accelerator.num_processes
    stream = BatchStream([len(t["input_ids"]) for t in train_data], global_batch, cfg.train.seed,
                         cfg.train.group_by_length)
    progress = TrainProgress()
    accelerator.register_for_checkpointing(stream, progress)
    ckpt = find_checkpoint(out_dir, cfg.resume_from_checkpoint)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        log(f"resumed from {ckpt} at step {progress.step}")
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.resolved.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if log_with:
        accelerator.init_trackers("policy_sft", config={k: str(v) for k, v in to_dict(cfg).items()})

    def write_metrics(row: dict) -> None:
        if accelerator.is_main_process:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        accelerator.log({f"{row['split']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))},
                        step=row["step"])

    def run_eval() -> None:
        row = {"split": "eval", "step": progress.step, "loss": eval_loss(model, eval_data, pad_id,
                                                                         cfg.train.eval_batch_size, accelerator)}
        if cfg.train.eval_generations > 0:
            row.update(generate_eval(model, processor, eval_examples, cfg, accelerator))
        write_metrics(row)
        log(f"step {progress.step} eval: " + " ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)))

    if eval_data and progress.step == 0:
        run_eval()  # the untrained policy's numbers, to compare against

    # ---- training loop --------------------------------------------------------------------
    model.train()
    bar = tqdm(total=cfg.train.max_steps, initial=progress.step, desc="policy_sft",
               disable=not accelerator.is_main_process)
    t0, running = time.time(), []
    while progress.step < cfg.train.max_steps:
        micro_batches = [rank_share(stream.next(), accelerator.process_index, accelerator.num_processes)
                         for _ in range(cfg.train.grad_accum)]
        # mean over assistant tokens of the whole accumulation window
        n_tokens = sum(sum(l != IGNORE for l in train_data[i]["labels"][1:]) for mb in micro_batches for i in mb)
        step_loss = 0.0
        for k, idx in enumerate(micro_batches):
            batch = {key: v.to(accelerator.device) for key, v in collate([train_data[i] for i in idx], pad_id).items()}
            # accumulate() syncs (DDP all-reduce, DeepSpeed step) on the last of grad_accum micro-batches only
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss_sum, _ = token_loss_sum(model, batch)
                if not torch.isfinite(loss_sum):
                    raise FloatingPointError(f"non-finite loss at step {progress.step}, micro-batch {k}, example ids "
                                             f"{[train_data[i]['id'] for i in idx]}: lower train.lr or check these rows")
                # backward() divides by grad_accum; the loss is already a mean over the window's tokens
                accelerator.backward(loss_sum * cfg.train.grad_accum / max(1, n_tokens))
            step_loss += loss_sum.item() / max(1, n_tokens)
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
            write_metrics({"split": "train", "step": progress.step, "loss": sum(running) / len(running),
                           "lr": scheduler.get_last_lr()[0], "seconds": time.time() - t0})
            running = []
        if eval_data and (progress.step % cfg.train.eval_every == 0 or progress.step == cfg.train.max_steps):
            run_eval()
        stopping = progress.step == cfg.train.stop_at_step
        if progress.step % cfg.train.save_every == 0 or progress.step == cfg.train.max_steps or stopping:
            accelerator.save_state(str(out_dir / "checkpoints" / f"step_{progress.step}"))
        if stopping:
            log(f"stopping at step {progress.step} (train.stop_at_step); resume with resume_from_checkpoint=latest")
            accelerator.end_training()
            return
    bar.close()

    # ---- save -----------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    # ZeRO-3 shards every weight: all ranks gather the full state dict, then rank 0 writes it.
    state = None if cfg.model.lora.enabled else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        if hasattr(final, "merge_and_unload"):
            final = final.merge_and_unload()
        final.save_pretrained(out_dir, state_dict=state)
        processor.save_pretrained(out_dir)
        # The prompt it learned, for annotation and Best-of-N (they read it unless overridden).
        save_policy_spec(out_dir, PolicySpec(system_prompt=cfg.model.system_prompt, step_mode="tags"))
        log(f"saved policy to {out_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"policy_sft: {e}", file=sys.stderr)
        sys.exit(2)
