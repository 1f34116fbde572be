"""PRM training throughput: mmprm's recipe vs TRL's PRMTrainer on the same model, data and batches.

    python benchmarks/prm_train_throughput.py            # full run (~2 min on 2 CPU cores)
    python benchmarks/prm_train_throughput.py --quick    # smoke test

Both sides train the text-only tiny Qwen2 (`build_tiny_model("qwen2")`, step token added) on the
same synthetic stepwise rows (2-10 steps of 4-30 words, 0/1 labels), batch 8, max length 512,
fp32, AdamW, cosine schedule, grad clip 1.0, the same number of optimizer
steps, each in its own process (so peak RSS is that side's alone):

  ours  the loop of `recipes/prm_train.py` with the recipe's own parts: collate_steps +
        ProcessRewardModel + the recipe's `step_loss` (loaded from the file) + BatchStream with
        length grouping + accelerate, soft-CE on the step tokens. In a loop rather than the recipe
        as a subprocess so both sides are timed the same way, per optimizer step.
  trl   `trl.experimental.prm.PRMTrainer` when the installed trl has it; trl 1.16 dropped it
        (huggingface/trl#7133), and then its pipeline is rebuilt from transformers parts:
        `AutoModelForTokenClassification` (2 labels) + `Trainer` + `DataCollatorForTokenClassification`,
        labels -100 except at the step tokens. Its input ids are mmprm's `tokenize_steps` ids, so
        both sides see identical tokens. The TRL side samples batches as PRMConfig does by default
        (random); `--trl-sampling group_by_length` gives it length-grouped batches like ours.

tokens/s counts non-pad tokens. A step's time runs from fetching its batch to the end of its
optimizer step. The machine is shared, so the headline rate is the median over steps (first two
skipped: one-off warm-up); the mean rate is beside it.
Two more sides are floors of what any PRM trainer pays, the bare backbone with backward and AdamW
on the same batches as ours: `floor_lm` with its plain LM loss (vocabulary logits at every token),
`floor_decoder` with the decoder alone and a loss at the step tokens (`ratio_tokens_per_s_vs_*`).
The sides alternate for `--rounds` rounds; each keeps its best round. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = (
    "we add the two numbers then multiply by three so the total is and the answer follows since each "
    "side of the square has length four which gives area perimeter"
).split()


FLOORS = ("floor_lm", "floor_decoder")


def write_rows(path: Path, n: int, seed: int = 0) -> Path:
    """n synthetic step-labelled rows of variable length (mmprm JSONL schema, text only)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = rng.randint(2, 10)
            steps = [
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) + f" = {rng.randint(0, 99)}."
                for _ in range(k)
            ]
            wrong = rng.choice([None, rng.randrange(k)])
            labels = [0.0 if wrong is not None and j >= wrong else 1.0 for j in range(k)]
            f.write(
                json.dumps(
                    {
                        "id": f"r{i}",
                        "question": f"Problem {i}: " + " ".join(rng.sample(WORDS, 12)) + "?",
                        "steps": steps,
                        "labels": labels,
                    }
                )
                + "\n"
            )
    return path


def run_child(cmd: list[str], env: dict[str, str], log_dir: Path) -> tuple[str, int]:
    """Run a side in its own process; returns (stdout, its peak RSS in MiB from wait4)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_file, err_file = log_dir / "stdout.txt", log_dir / "stderr.txt"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env)
        # wait4, not proc.wait(): it also returns this child's own resource usage
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed ({code}):\n{err_file.read_text()[-3000:]}")
    return out_file.read_text(), usage.ru_maxrss // 1024  # Linux reports KiB


def run_side(
    name: str, model: str, data: Path, out: Path, a: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """One side in its own process: per-step tokens and seconds, final loss, peak RSS."""
    cmd = [
        sys.executable,
        __file__,
        "--_child",
        name,
        "--model",
        model,
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(a.steps),
        "--batch-size",
        str(a.batch_size),
        "--max-length",
        str(a.max_length),
        "--trl-sampling",
        a.trl_sampling,
    ]
    stdout, rss = run_child(cmd, env, out / "logs")
    res = json.loads(stdout.strip().splitlines()[-1])
    tokens, secs = res.pop("step_tokens"), res.pop("step_seconds")
    # The first steps pay one-off costs (allocator, lazy kernels); the machine is shared, so the
    # median step rate is the robust number and the mean rate is reported beside it.
    skip = min(2, len(tokens) - 1)
    rates = sorted(t / s for t, s in zip(tokens[skip:], secs[skip:]))
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_mean": sum(tokens[skip:]) / sum(secs[skip:]),
        "non_pad_tokens": sum(tokens),
        "peak_rss_mib": rss,
        **res,
    }


def tokenized_rows(a: argparse.Namespace, processor: Any) -> list[Any]:
    """The rows of `a.data` as the PRM trains on them (`tokenize_steps`, cut at `a.max_length`)."""
    from mmprm.data.schema import load_examples
    from mmprm.steps import tokenize_steps

    return [
        t
        for ex in load_examples(a.data, require_labels=True)
        if (t := tokenize_steps(processor, ex.question, ex.steps, labels=ex.labels, max_length=a.max_length))
    ]


def print_steps(step_tokens: list[int], step_seconds: list[float], final_loss: float | None, trainer: str) -> None:
    """A side's result line: per-step tokens and seconds, its final loss, what it ran."""
    print(
        json.dumps(
            {"step_tokens": step_tokens, "step_seconds": step_seconds, "final_loss": final_loss, "trainer": trainer}
        )
    )


def ours_child(a: argparse.Namespace) -> None:
    """Our side: the loop of recipes/prm_train.py with its own parts, timed per optimizer step."""
    import importlib.util

    import torch
    from accelerate import Accelerator

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.training.collate import collate_steps, model_input_keys
    from mmprm.training.run import BatchStream, lr_factor

    spec = importlib.util.spec_from_file_location("prm_train_recipe", REPO / "recipes" / "prm_train.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)  # the recipe's own step_loss, not a copy

    torch.manual_seed(42)
    accelerator = Accelerator(mixed_precision="no")
    backbone, processor = load_backbone(a.model, dtype=torch.float32)
    model = build_prm(backbone, processor, PRMSpec())
    data = tokenized_rows(a, processor)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 0, a.steps, "cosine"))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    stream = BatchStream([len(t.input_ids) for t in data], a.batch_size, seed=42, group_by_length=True)
    pad_id = processor.pad_token_id if processor.pad_token_id is not None else 0
    model.train()
    step_tokens, step_seconds, loss = [], [], None
    for _ in range(a.steps):
        t0 = time.perf_counter()
        items = [data[i] for i in stream.next()]
        batch = {k: v.to(accelerator.device) for k, v in collate_steps(items, pad_id).items()}
        with accelerator.autocast():
            logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        loss = recipe.step_loss(logits, batch["targets"], None)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # syncs, as the recipe's logging does
        step_seconds.append(time.perf_counter() - t0)
        step_tokens.append(int(batch["attention_mask"].sum()))
    print_steps(
        step_tokens,
        step_seconds,
        loss_value,
        "recipes/prm_train.py loop: collate_steps + ProcessRewardModel + step_loss + "
        "BatchStream(group_by_length) + accelerate",
    )


def floor_child(a: argparse.Namespace) -> None:
    """The floor of any PRM trainer: the bare backbone, forward + backward + AdamW on the very
    batches ours trains on (same tokenization, sampler and collation), and nothing else: no head,
    no step loss, no accelerate, no clipping, no schedule. Loss: `floor_lm` the backbone's plain LM
    loss (logits over the vocabulary at every token); `floor_decoder` the decoder alone, a loss
    read off its last hidden states at the step tokens (what no PRM head can undercut)."""
    import torch

    from mmprm.models.loading import add_step_token, load_backbone
    from mmprm.steps import STEP_TOKEN
    from mmprm.training.collate import collate_steps
    from mmprm.training.run import BatchStream

    torch.manual_seed(42)
    backbone, processor = load_backbone(a.model, dtype=torch.float32)
    add_step_token(processor, backbone, STEP_TOKEN)
    data = tokenized_rows(a, processor)
    optimizer = torch.optim.AdamW([p for p in backbone.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    stream = BatchStream([len(t.input_ids) for t in data], a.batch_size, seed=42, group_by_length=True)
    pad_id = processor.pad_token_id if processor.pad_token_id is not None else 0
    backbone.train()
    step_tokens, step_seconds, loss_value = [], [], None
    for _ in range(a.steps):
        t0 = time.perf_counter()
        batch = collate_steps([data[i] for i in stream.next()], pad_id)
        if a._child == "floor_lm":
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        else:
            hidden = backbone.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).last_hidden_state
            loss = hidden[batch["step_mask"]].float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        step_seconds.append(time.perf_counter() - t0)
        step_tokens.append(int(batch["attention_mask"].sum()))
    loss_kind = "forward with its LM loss" if a._child == "floor_lm" else "decoder, loss at the step tokens"
    print_steps(step_tokens, step_seconds, loss_value, f"bare backbone, AdamW: {loss_kind}")


def trl_child(a: argparse.Namespace) -> None:
    """The TRL side, in its own process, timed per optimizer step like ours."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, TrainerCallback

    from mmprm.data.schema import load_examples
    from mmprm.models.loading import add_step_token, load_processor
    from mmprm.steps import tokenize_steps

    torch.manual_seed(42)
    tok = load_processor(a.model)
    model = AutoModelForTokenClassification.from_pretrained(a.model, num_labels=2)
    add_step_token(tok, model)
    rows: dict[str, list] = {"input_ids": [], "labels": []}
    for ex in load_examples(a.data, require_labels=True):
        t = tokenize_steps(tok, ex.question, ex.steps, labels=ex.labels, max_length=a.max_length)
        if t is None:
            continue
        labels = [-100] * len(t.input_ids)
        for p, y in zip(t.step_positions, t.labels):
            labels[p] = int(y >= 0.5)  # TRL trains hard 0/1 step labels
        rows["input_ids"].append(t.input_ids)
        rows["labels"].append(labels)
    ds = Dataset.from_dict(rows)

    step_tokens: list[int] = []
    collate = DataCollatorForTokenClassification(tok)

    def counting_collate(features: list[dict]) -> dict:
        batch = collate(features)
        step_tokens.append(int(batch["attention_mask"].sum()))  # non-pad tokens, as ours counts them
        return batch

    class Clock(TrainerCallback):
        # step k spans from the end of step k-1 (or train begin) to its end: batch fetch included, as in ours
        def on_train_begin(self, args, state, control, **kw):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    common = dict(
        output_dir=str(a.out),
        per_device_train_batch_size=a.batch_size,
        max_steps=a.steps,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=a.steps,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=42,
        train_sampling_strategy=a.trl_sampling,
    )
    clock = Clock()
    try:
        from trl.experimental.prm import PRMConfig, PRMTrainer

        trainer = PRMTrainer(
            model=model,
            args=PRMConfig(**common, max_length=a.max_length),
            train_dataset=ds,
            processing_class=tok,
            data_collator=counting_collate,
            callbacks=[clock],
        )
        name = "trl.experimental.prm.PRMTrainer"
    except ImportError:
        from transformers import Trainer, TrainingArguments

        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=ds,
            data_collator=counting_collate,
            callbacks=[clock],
        )
        name = (
            "transformers.Trainer + AutoModelForTokenClassification + DataCollatorForTokenClassification "
            "(PRMTrainer's pipeline; trl.experimental.prm is not in this trl)"
        )
    result = trainer.train()
    secs = [b - a_ for a_, b in zip(clock.marks, clock.marks[1:])]
    print_steps(step_tokens[: len(secs)], secs, result.training_loss, name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few rows and steps, one round (smoke test)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per side (the same for both)")
    parser.add_argument(
        "--trl-sampling",
        default="random",
        choices=["random", "group_by_length"],
        help="TRL side's batch sampler: 'random' is PRMConfig's default, what its users get",
    )
    parser.add_argument("--_child", choices=["ours", "trl", "floor_lm", "floor_decoder"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a._child:
        {"ours": ours_child, "trl": trl_child}.get(a._child, floor_child)(a)
        return {}
    if a.quick:
        a.rows, a.steps, a.rounds = 32, 4, 1

    from mmprm.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="prm_train_bench_"))
    model = str(build_tiny_model("qwen2", root / "qwen2", seed=0))
    data = write_rows(root / "rows.jsonl", a.rows)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    best: dict[str, dict[str, Any]] = {}
    for r in range(a.rounds):
        for name in ("ours", "trl", "floor_lm", "floor_decoder"):
            res = run_side(name, model, data, root / f"{name}_{r}", a, env)
            if name not in best or res["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = res
    result = {
        "benchmark": "prm_train_throughput",
        "model": "tiny qwen2 (text-only, random init)",
        "quick": a.quick,
        "rows": a.rows,
        "optimizer_steps": a.steps,
        "batch_size": a.batch_size,
        "max_length": a.max_length,
        "threads": a.threads,
        "rounds": a.rounds,
        "trl_sampling": a.trl_sampling,
        "ours": {k: round(v, 4) if isinstance(v, float) else v for k, v in best["ours"].items()},
        "trl": {k: round(v, 4) if isinstance(v, float) else v for k, v in best["trl"].items()},
        "ratio_tokens_per_s": round(best["ours"]["tokens_per_s"] / best["trl"]["tokens_per_s"], 3),
        "ratio_peak_rss": round(best["ours"]["peak_rss_mib"] / best["trl"]["peak_rss_mib"], 3),
        **{side: {k: round(v, 4) if isinstance(v, float) else v for k, v in best[side].items()} for side in FLOORS},
        **{
            f"ratio_tokens_per_s_vs_{side}": round(best["ours"]["tokens_per_s"] / best[side]["tokens_per_s"], 3)
            for side in FLOORS
        },
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
