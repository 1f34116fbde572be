"""What the training recipes share: deterministic batch order, LR schedule, resume state, and the
run itself (`TrainingRun`: accelerator, checkpoints, metrics and the training loop).

Batch order is a pure function of (seed, epoch, step), so a resumed run sees exactly the batches
an uninterrupted run would have seen, on any number of processes.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmprm.config_sections import AttnImplementation


@dataclass
class LoraConfig:
    """LoRA adapters on the language model (peft); off trains all unfrozen weights.

    Attributes:
        enabled: train LoRA adapters instead of the full language model
        r: adapter rank
        alpha: adapter scaling numerator (scale = alpha / r)
        dropout: dropout on the adapter input
        target_modules: names of the linear layers that get adapters; with
            `model.freeze_vision_tower` (the default) only the language model's layers of these
            names get them, as the vision towers of InternVL and LLaVA use the same names
    """

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainModelConfig:
    """The backbone a training recipe fine-tunes (prm_train builds the PRM on it; policy_sft adds its
    system prompt).

    Attributes:
        name_or_path: backbone: a Hugging Face model directory (or hub id where the hub is reachable);
            required
        attn_implementation: attention kernel: sdpa | flash_attention_2 (mmprm[flash], CUDA) |
            flex_attention (prm_train with data.pack_trees: the tree is a block mask) | eager | auto
            (flash-attn when installed and a GPU is visible, else sdpa)
        dtype: weights dtype at load; use train.bf16 for mixed precision
        freeze_vision_tower: keep the vision encoder frozen (MM-PRM trains the language model, not
            the ViT)
        gradient_checkpointing: recompute activations in the backward pass: less memory, the forward runs twice
        lora: LoRA adapters (section)
    """

    name_or_path: str = ""
    attn_implementation: AttnImplementation = "sdpa"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    freeze_vision_tower: bool = True
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TrainConfig:
    """The training loop of prm_train and policy_sft (policy_sft adds its eval generations).

    Attributes:
        seed: seed of data order, initialisation of new weights and dropout
        max_steps: optimizer steps to train (one epoch = ceil(rows / global batch))
        batch_size: examples per process per micro-step
        grad_accum: micro-steps per optimizer step (global batch = batch_size x grad_accum x processes)
        global_batch_size: examples (packs with data.pack_trees) per optimizer step on any number of
            processes: grad_accum is derived from it and the world size (`resolve_grad_accum`), so
            the same config trains the same way on 1 node or 4; null uses grad_accum as given
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
        keep_checkpoints: keep only the newest N complete checkpoints (a 7B ZeRO-3 checkpoint with its
            optimizer is ~100 GB); null keeps every one
        require_gpu: stop before loading anything when no CUDA GPU is visible (the 7B configs set
            it: a torch built for a newer CUDA than the host driver sees no GPU, and DeepSpeed then
            trains on CPU without a word)
        prefetch_batches: collate the next optimizer step's micro-batches (image decoding,
            tokenization checks, padding) on a background thread while this step trains
            (`Prefetcher`); the batches are the same either way
        overwrite_output_dir: let a fresh start (no resume_from_checkpoint) delete the checkpoints another run
            left in output_dir; false refuses to start over them
        lr: peak learning rate (AdamW)
        dist_timeout_s: seconds a collective may wait for the other ranks before the run fails
            (NCCL's own default, 600, is shorter than a large ZeRO-3 save or data build)
        peak_tflops: the device's peak TFLOP/s that MFU is measured against; null takes the bf16
            figure of a known GPU (`mmprm.mfu.PEAK_BF16_TFLOPS`) and logs MFU as null elsewhere
        compile: `torch.compile` each decoder layer of the language model
            (`mmprm.models.compile_layers`); the first steps pay the compile. Not under DeepSpeed ZeRO-3
    """

    seed: int = 42
    max_steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    global_batch_size: int | None = None
    lr: float = 2e-6
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
    report_to: str = "tensorboard"
    stop_at_step: int | None = None
    keep_checkpoints: int | None = None
    overwrite_output_dir: bool = False
    require_gpu: bool = False
    prefetch_batches: bool = True
    dist_timeout_s: int = 1800
    peak_tflops: float | None = None
    compile: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what to do."""
        if self.dist_timeout_s < 1:
            raise ValueError(
                f"train.dist_timeout_s: {self.dist_timeout_s} (give the seconds a collective may wait, e.g. 1800)"
            )
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(
                f"train.keep_checkpoints: {self.keep_checkpoints} would delete the checkpoint just written "
                "(use 1 or more, or null to keep every one)"
            )
        for key in ("log_every", "eval_every", "save_every"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"train.{key}: {getattr(self, key)} is not a step interval (use 1 or more; a value past "
                    "train.max_steps acts only at the last step)"
                )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(
                f"train.peak_tflops: {self.peak_tflops} is not a FLOP rate (use a positive number, or null)"
            )
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"train.schedule: {self.schedule!r} is not one of ['cosine', 'linear', 'constant']")


def check_gpu(train: TrainConfig) -> None:
    """Raise RuntimeError when `train.require_gpu` and torch sees no CUDA GPU, saying what to check."""
    import torch

    if train.require_gpu and not torch.cuda.is_available():
        cuda = torch.version.cuda or "none (a CPU build)"
        raise RuntimeError(
            f"train.require_gpu: torch {torch.__version__} (CUDA {cuda}) sees no GPU. Check `nvidia-smi` and that "
            "the driver supports this CUDA (a CUDA 13 build needs driver >= 580, or the forward-compatibility "
            "libraries), and that the job was given GPUs (--gpus-per-node); set train.require_gpu=false to run on CPU"
        )


def launched_world_size() -> int:
    """How many processes the launcher started, read from its environment (torchrun, accelerate,
    deepspeed, MPI), 1 when run plainly. Read before the Accelerator exists: building a
    PartialState early would fix the process group without the Accelerator's arguments (CPU mode,
    timeout) and can leave each process believing it runs alone."""
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def check_world_size(accelerator: Any, launched: int) -> None:
    """Refuse a run whose processes do not see each other: each would train alone on the whole
    data, write the same checkpoints, and use a grad_accum meant for `launched` processes."""
    if accelerator.num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes but this one sees {accelerator.num_processes}: the "
            "processes did not join one group. Without GPUs, set ACCELERATE_USE_CPU=true for multi-process CPU "
            "runs; with GPUs, check that each process sees one (CUDA_VISIBLE_DEVICES)"
        )


def resolve_grad_accum(train: TrainConfig, num_processes: int) -> int:
    """Set and return `train.grad_accum` for `num_processes`: from `train.global_batch_size` when
    given (which must be a multiple of batch_size x processes), else as configured.

    >>> resolve_grad_accum(TrainConfig(batch_size=4, global_batch_size=512), 8)
    16
    >>> resolve_grad_accum(TrainConfig(batch_size=4, global_batch_size=512), 32)
    4
    """
    if train.global_batch_size is None:
        return train.grad_accum
    per_micro_step = train.batch_size * num_processes
    accum, rest = divmod(train.global_batch_size, per_micro_step)
    if accum < 1 or rest:
        raise ValueError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of train.batch_size x processes = "
            f"{train.batch_size} x {num_processes} = {per_micro_step}: change one of them (or set "
            "train.global_batch_size=null and give train.grad_accum)"
        )
    if train.grad_accum not in (1, accum):
        raise ValueError(
            f"train.grad_accum={train.grad_accum} and train.global_batch_size={train.global_batch_size} disagree on "
            f"{num_processes} process(es) (the global batch asks for {accum}): give one of them (grad_accum=1 or "
            "global_batch_size=null)"
        )
    train.grad_accum = accum
    return accum


def epoch_batches(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    epoch: int,
    group_by_length: bool = True,
    drop_last: bool = False,
    pad_last: bool = False,
) -> list[list[int]]:
    """Global batches (lists of example indices) for one epoch.

    With `group_by_length`, a shuffled order is cut into mega-batches of 32 batches and each is
    sorted by length before cutting batches, so padding stays small while order stays random; the
    batches are then shuffled so long ones are not all at the end. With `pad_last`, a short last
    batch is filled by wrap-around from the start of the epoch's order (rows seen twice that epoch),
    so every global batch splits into equal shares for all processes (see `rank_share`).
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if group_by_length:
        mega = batch_size * 32
        order = [i for s in range(0, len(order), mega) for i in sorted(order[s : s + mega], key=lambda j: -lengths[j])]
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    elif pad_last and batches and len(batches[-1]) < batch_size:
        short = batch_size - len(batches[-1])
        batches[-1] = batches[-1] + [order[k % len(order)] for k in range(short)]
    if group_by_length:
        rng.shuffle(batches)
    return batches


def wrap_padding(n_rows: int, global_batch: int) -> int:
    """Rows each epoch repeats to fill its last global batch (0 when `n_rows` divides evenly)."""
    return -n_rows % global_batch


def rank_share(batch: Sequence[int], rank: int, world: int) -> list[int]:
    """This process's slice of a global batch (strided, so every rank gets similar lengths).

    Never empty: a rank without rows would fail in the collator, or hang a collective while the
    others train. Batches from `BatchStream` are full, so every rank gets batch_size rows.
    """
    share = list(batch[rank::world])
    if not share:
        raise ValueError(
            f"global batch of {len(batch)} rows leaves process {rank} of {world} without a row: "
            "pad the batch (epoch_batches(pad_last=True))"
        )
    return share


def eval_share(n_rows: int, rank: int, world: int) -> tuple[list[int], int]:
    """This process's eval rows, evened out: (indices, how many of them count).

    Every process gets ceil(n_rows / world) rows, so all run the same number of forward passes
    (ZeRO-3 gathers weights collectively); rows past `n_rows` wrap around to the start and are
    scored but left out of the metrics (the first `count` indices are the real ones).
    """
    per_rank = -(-n_rows // world)
    positions = range(rank, per_rank * world, world)
    return [p % n_rows for p in positions], sum(p < n_rows for p in positions)


class BatchStream:
    """Endless stream of full global batches over epochs, resumable on any number of processes.

    Its position is counted in rows: the epoch, how many rows of the epoch's order it has handed
    out, and the global batch that order was cut with. A checkpoint taken with batches of 4 rows
    (1 process) and resumed with batches of 8 (2 processes) goes on with the epoch's next row, so
    no row is skipped; an epoch begun at one size is finished in that order, cut at the new size.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, group_by_length: bool = True):
        if not lengths:
            raise ValueError("no training examples left after tokenization; check data.train_file and max_length")
        self.lengths, self.batch_size, self.seed, self.group = list(lengths), batch_size, seed, group_by_length
        self.epoch, self.rows, self.epoch_batch = 0, 0, batch_size
        self._order = self._epoch_order(0, batch_size)

    def _epoch_order(self, epoch: int, cut: int) -> list[int]:
        # the epoch's full batches of `cut` rows (see rank_share), one after the other
        return [i for b in epoch_batches(self.lengths, cut, self.seed, epoch, self.group, pad_last=True) for i in b]

    def next(self) -> list[int]:
        if self.rows >= len(self._order):
            self.epoch, self.rows, self.epoch_batch = self.epoch + 1, 0, self.batch_size
            self._order = self._epoch_order(self.epoch, self.batch_size)
        batch = self._order[self.rows : self.rows + self.batch_size]
        self.rows += self.batch_size
        # short only in an epoch cut at another size before a resume: filled from the epoch's start
        batch += [self._order[k % len(self._order)] for k in range(self.batch_size - len(batch))]
        return batch

    def peek(self, n: int) -> list[list[int]]:
        """The next `n` batches, leaving the stream (and so its checkpointed position) where it is."""
        saved = self.epoch, self.rows, self.epoch_batch, self._order
        try:
            return [self.next() for _ in range(n)]
        finally:
            self.epoch, self.rows, self.epoch_batch, self._order = saved

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "rows": self.rows, "epoch_batch": self.epoch_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "rows" in state:
            self.epoch, self.rows, self.epoch_batch = int(state["epoch"]), int(state["rows"]), int(state["epoch_batch"])
        else:  # a checkpoint that counted global batches, of this run's size
            self.epoch, self.rows = int(state["epoch"]), int(state["index"]) * self.batch_size
            self.epoch_batch = self.batch_size
        self._order = self._epoch_order(self.epoch, self.epoch_batch)


class Prefetcher:
    """Collates micro-batches on one background thread while the training thread computes, so
    image decoding and tokenization overlap the GPU's work instead of stalling it.

        prefetch = Prefetcher(collate)
        prefetch.submit(next_window)          # queued in the order they will be asked for
        batch, items = prefetch.get(indices)  # collate(indices), from the queue when it is there

    One thread: the collators keep a prompt cache that is not thread-safe, so a collator never
    runs twice at once. `get` of anything not at the head of the queue waits for the queue, then
    collates on the calling thread; batches are `collate(indices)`'s either way. Call `wait()`
    before other work uses the same processor (evaluation): the queue then sits finished, and
    `close()` at the end. With
    `enabled=False` every `get` collates on the calling thread.
    """

    def __init__(self, collate: Callable[[Sequence[int]], Any], enabled: bool = True):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.collate = collate
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mmprm-collate") if enabled else None
        self._queue: deque = deque()  # (indices, Future), in submission order

    def submit(self, batches: Sequence[Sequence[int]]) -> None:
        if self._pool is None:
            return
        queued = {key for key, _ in self._queue}
        for indices in batches:
            key = tuple(indices)
            if key not in queued:
                queued.add(key)
                self._queue.append((key, self._pool.submit(self.collate, list(indices))))

    def get(self, indices: Sequence[int]) -> Any:
        if self._queue and self._queue[0][0] == tuple(indices):
            return self._queue.popleft()[1].result()
        self.wait()  # asked out of order: the queue is of no use, and must not run beside us
        self._queue.clear()
        return self.collate(indices)

    def wait(self) -> None:
        """Block until every queued collation has finished (their batches stay queued), so that
        nothing runs on the background thread."""
        for _, future in self._queue:
            future.exception()  # an error surfaces when its batch is asked for, not here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._queue.clear()


@dataclass
class TrainProgress:
    """Counters saved with every checkpoint (registered with accelerate)."""

    step: int = 0
    examples_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "examples_seen": self.examples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.examples_seen = int(state["step"]), int(state["examples_seen"])


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine", min_ratio: float = 0.0
) -> float:
    """Multiplier of the peak LR at `step`: linear warmup, then cosine / linear decay or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}: use cosine, linear or constant")


# Written into a checkpoint after every rank has saved its part: one without it was cut off. It
# names the step and the run that wrote it (`run_id`, which every resume of that run keeps).
CHECKPOINT_DONE = "mmprm_checkpoint.json"


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def _step_dirs(output_dir: str | Path) -> list[Path]:
    """output_dir/checkpoints/step_N folders, oldest first."""
    found = (Path(output_dir) / "checkpoints").glob("step_*")
    return sorted((p for p in found if p.name.removeprefix("step_").isdigit()), key=_step)


def _marker(checkpoint: Path) -> dict | None:
    """A checkpoint's completion marker; None for one cut off while saving."""
    import json

    try:
        return json.loads((checkpoint / CHECKPOINT_DONE).read_text())
    except FileNotFoundError:
        return None


def _refuse_fresh_start(output_dir: str | Path, overwrite: bool) -> None:
    """Raise FileExistsError when a fresh start would train over checkpoints another run left."""
    found = _step_dirs(output_dir)
    if found and not overwrite:
        raise FileExistsError(
            f"{Path(output_dir) / 'checkpoints'} holds another run's checkpoints "
            f"({', '.join(p.name for p in found)}): continue that run with resume_from_checkpoint=latest, "
            "or start over, deleting them, with train.overwrite_output_dir=true (or pick another output_dir)"
        )


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, deepest first: the bytes this node wrote reach
    the (shared) filesystem before the checkpoint is renamed into place and marked complete."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:  # a temp file another writer has renamed since the listing
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    """fsync a folder, so the names created or renamed in it are on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the data files are synced
        pass
    finally:
        os.close(fd)


def _clear_leftovers(folder: Path) -> None:
    """Tidy what a job killed mid-save left in output_dir/checkpoints: a step_N.partial is deleted;
    a step_N.replaced (the complete old step_N, set aside for its rewrite) is put back when the
    new one never arrived, else deleted."""
    import shutil

    for p in folder.glob("step_*.partial"):
        shutil.rmtree(p, ignore_errors=True)
    for p in folder.glob("step_*.replaced"):
        final = p.with_suffix("")
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.rename(final)


def save_checkpoint(
    accelerator: Any, output_dir: str | Path, step: int, *, run_id: str, keep: int | None = None
) -> Path:
    """`accelerator.save_state` into output_dir/checkpoints/step_STEP, marked complete once all ranks wrote.

    Every rank writes into step_STEP.partial (DeepSpeed's layout inside is unchanged: its `latest`
    file names a tag, not a path); one process per node fsyncs what it wrote; rank 0 then writes
    the completion marker and renames the folder into place. A job killed while saving (a Slurm
    time limit, a preempted node) leaves only a .partial folder, which `find_checkpoint` never
    sees, and every earlier checkpoint intact, including a step_STEP being rewritten. The marker
    records `run_id` (see `start_run`). With `keep`, rank 0 then deletes all but the newest `keep`
    complete checkpoints of this run (and ones whose marker names no run, written before markers
    did), and any cut-off one older than `step`; another run's checkpoints are never deleted.
    """
    import json
    import shutil

    from mmprm.data.schema import atomic_write

    folder = Path(output_dir) / "checkpoints"
    path = folder / f"step_{step}"
    partial = folder / f"step_{step}.partial"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(folder)
    accelerator.wait_for_everyone()  # no rank writes into a leftover being deleted
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every rank has written: no file is still being renamed into place
    if accelerator.is_local_main_process:
        _fsync_tree(partial)  # ranks of a node share its page cache: one fsync pass per node
    accelerator.wait_for_everyone()  # every node's shards are on disk before the marker says so
    if accelerator.is_main_process:
        # whole or absent: a marker cut off while written would still pass for complete
        with atomic_write(partial / CHECKPOINT_DONE) as f:
            f.write(json.dumps({"step": step, "processes": accelerator.num_processes, "run_id": run_id}))
        aside = folder / f"step_{step}.replaced"
        if path.exists():
            path.rename(aside)
        partial.rename(path)
        _fsync_dir(folder)
        shutil.rmtree(aside, ignore_errors=True)
        if keep is not None:
            found = _step_dirs(output_dir)
            mine = [p for p in found if (m := _marker(p)) is not None and m.get("run_id", run_id) == run_id]
            cut = [p for p in found if _marker(p) is None and _step(p) < step]
            for old in [p for p in mine[:-keep] if _step(p) < step] + cut:
                shutil.rmtree(old, ignore_errors=True)
    return path


def find_checkpoint(
    output_dir: str | Path, resume: str | None, log: Any = print, overwrite: bool = False
) -> Path | None:
    """Resolve `resume_from_checkpoint`: None/'' -> None, 'latest' -> the newest complete checkpoint.

    None over checkpoints already in output_dir raises FileExistsError unless `overwrite`
    (`train.overwrite_output_dir`): a fresh start would mix its checkpoints with another run's,
    and `latest` could later resume the wrong one. 'latest' passes over checkpoints cut off while
    saving (no `CHECKPOINT_DONE`), naming them with `log`. Folders that exist but none complete
    raise rather than start over: passing one explicitly (`resume_from_checkpoint=PATH`) loads it
    as it is.
    """
    if not resume:
        _refuse_fresh_start(output_dir, overwrite)
        return None
    if resume == "latest":
        found = _step_dirs(output_dir)
        complete = [p for p in found if (p / CHECKPOINT_DONE).is_file()]
        cut = [p.name for p in found if p not in complete and (not complete or _step(p) > _step(complete[-1]))]
        if cut:
            log(f"passing over {', '.join(cut)} in {Path(output_dir) / 'checkpoints'}: cut off while saving")
        if found and not complete:
            raise FileNotFoundError(
                f"resume_from_checkpoint=latest: no complete checkpoint in {Path(output_dir) / 'checkpoints'} "
                f"({', '.join(p.name for p in found)} lack {CHECKPOINT_DONE}: cut off while saving, or written "
                "before checkpoints were marked); pass one with resume_from_checkpoint=PATH to load it anyway"
            )
        return complete[-1] if complete else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(
            f"resume_from_checkpoint={resume}: no such checkpoint directory "
            "(use 'latest' or a path under OUTPUT_DIR/checkpoints)"
        )
    return path


METRICS_FILE = "metrics.jsonl"


def _trim_metrics(path: Path, step: int | None, log: Any) -> None:
    """Keep the rows of the metrics file that the run continues: none on a fresh start (`step`
    None), those logged at or before `step` on a resume. Otherwise a rerun's curve is appended to
    the last run's, and a resume from an earlier step leaves the abandoned continuation's rows in
    between, each plotted as if this run had logged it."""
    from mmprm.data.schema import atomic_write

    if not path.is_file():
        return
    kept = dropped = 0
    with open(path, encoding="utf-8") as src, atomic_write(path) as dst:
        for line in src:
            try:
                row_step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                row_step = None  # a line cut off by a kill: not this run's
            if step is not None and isinstance(row_step, int) and row_step <= step:
                dst.write(line if line.endswith("\n") else line + "\n")
                kept += 1
            else:
                dropped += 1
    if dropped:
        why = "a fresh start" if step is None else f"resuming at step {step}"
        log(f"{why}: dropped {dropped} row(s) of {path} logged by {'another run' if step is None else 'later steps'}")


def start_run(
    accelerator: Any,
    output_dir: str | Path,
    checkpoint: Path | None,
    step: int,
    overwrite: bool = False,
    log: Any = print,
) -> str:
    """Ready output_dir/checkpoints for a run that starts, or resumed from `checkpoint`, at `step`;
    return the run id its checkpoints record (the same on every rank).

    A fresh start gets a new id; over checkpoints another run left it raises as `find_checkpoint`
    does, unless `overwrite`, which deletes them. A resumed run keeps the id in its checkpoint's
    marker, so one run keeps one id through every restart. Checkpoints newer than `step` were
    written by a continuation this run replaces (e.g. resuming step_900 explicitly after a step_1000
    that diverged): complete ones are moved to checkpoints/abandoned_after_step_STEP/ (kept for the
    user, never resumed by `latest` nor pruned by `keep`), ones cut off while saving are deleted,
    each named in the log. Call it after `load_state`, on every rank.
    """
    import secrets
    import shutil
    import time

    from accelerate.utils import broadcast_object_list

    folder = Path(output_dir) / "checkpoints"
    run_id = None
    if checkpoint is not None:
        run_id = (_marker(checkpoint) or {}).get("run_id")
    else:
        _refuse_fresh_start(output_dir, overwrite)
    if run_id is None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if accelerator.is_main_process:
        if checkpoint is None:
            if found := _step_dirs(output_dir):
                log(f"train.overwrite_output_dir: deleting {', '.join(p.name for p in found)} in {folder}")
            for old in found:
                (old / CHECKPOINT_DONE).unlink(missing_ok=True)
                shutil.rmtree(old)
        newer = [p for p in _step_dirs(output_dir) if _step(p) > step]
        cut = [p for p in newer if _marker(p) is None]
        if cut:
            log(f"resuming at step {step}: deleting {', '.join(p.name for p in cut)} in {folder}: cut off while saving")
        for old in cut:
            shutil.rmtree(old)
        if done := [p for p in newer if p not in cut]:
            aside, k = folder / f"abandoned_after_step_{step}", 1
            while aside.exists():
                k += 1
                aside = folder / f"abandoned_after_step_{step}_{k}"
            aside.mkdir()
            for p in done:
                p.rename(aside / p.name)
            log(
                f"resuming at step {step}: {', '.join(p.name for p in done)} in {folder} came after it, from a "
                f"continuation this run replaces; moved them to {aside} (delete it to free the space)"
            )
        _trim_metrics(Path(output_dir) / METRICS_FILE, step if checkpoint is not None else None, log)
    accelerator.wait_for_everyone()  # no rank saves before the folder is ready
    return broadcast_object_list([run_id])[0]


def accelerator_kwargs(timeout_s: int | None = None) -> list:
    """`kwargs_handlers` for the training recipes' `Accelerator`: `process_group_kwargs` plus DDP's
    search for parameters the loss does not reach.

    Some trainable parameters get no gradient, and plain DDP then fails at the second step
    ("Expected to have finished reduction in the prior iteration"): LLaVA reads its image
    features from the vision tower's second-to-last layer (`vision_feature_layer=-2`), so the last
    layer is unused once the tower trains; a PRM's value head leaves the LM head unused. DDP
    then walks the autograd graph once per step to find them (a small cost beside the forward);
    DeepSpeed and FSDP ignore the setting.
    """
    from accelerate.utils import DistributedDataParallelKwargs

    return [*process_group_kwargs(timeout_s), DistributedDataParallelKwargs(find_unused_parameters=True)]


def process_group_kwargs(timeout_s: int | None = None) -> list:
    """`kwargs_handlers` for `Accelerator`: the collective timeout (`timeout_s`, under a launcher),
    and gloo so DeepSpeed ranks on a machine without GPUs form one group.

    Without a GPU, accelerate gives DeepSpeed no backend and counts one process per rank: two
    processes of `accelerate launch --num_processes 2 --config_file deepspeed_zero3.yaml` each
    train alone on all the data. Naming gloo makes them one group (world size 2). With GPUs, and
    outside a DeepSpeed launch, accelerate chooses the backend as usual.
    """
    import os
    from datetime import timedelta

    import torch
    from accelerate.utils import InitProcessGroupKwargs

    launched = os.environ.get("LOCAL_RANK") is not None
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    timeout = {"timeout": timedelta(seconds=timeout_s)} if launched and timeout_s else {}
    if launched and deepspeed and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo", **timeout)]
    # the backend stays accelerate's choice: only fields that differ from the defaults are passed
    return [InitProcessGroupKwargs(**timeout)] if timeout else []


def leave_run(accelerator: Any) -> None:
    """End a run once every rank's work is on disk: the ranks meet, trackers finish, the process
    group is torn down, and a multi-process run's processes exit right away.

    Exiting at once skips the interpreter's own teardown, where gloo's worker threads that another
    library still holds (DeepSpeed keeps its groups) can abort a rank with SIGABRT ("terminate
    called without an active exception") and fail a job whose checkpoint is already written.
    """
    import logging
    import sys

    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.num_processes > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def load_trainable_backbone(cfg: TrainModelConfig, attn_implementation: str | None = None) -> tuple[Any, Any]:
    """(model, processor) of cfg.name_or_path in cfg.dtype, with cfg's attention kernel unless the
    recipe passes the one it resolved."""
    import torch

    from mmprm.models.loading import load_backbone

    return load_backbone(
        cfg.name_or_path,
        dtype=getattr(torch, cfg.dtype),
        attn_implementation=attn_implementation or cfg.attn_implementation,
    )


def adapt_backbone(model: Any, cfg: TrainModelConfig) -> Any:
    """Ready a loaded backbone for training: freeze its vision tower, wrap it in LoRA adapters
    (peft), turn on gradient checkpointing, each as configured; returns the (possibly wrapped) model."""
    from mmprm.models.loading import VISION_TOWER_PATTERN, vision_tower_parameters

    tower = vision_tower_parameters(model)
    if cfg.freeze_vision_tower:
        for p in tower:
            p.requires_grad_(False)
    lora = cfg.lora
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        # An adapter on the frozen tower would train it after all, and merging would change its weights.
        exclude = VISION_TOWER_PATTERN if cfg.freeze_vision_tower and tower else None
        if exclude and not any(
            not re.fullmatch(exclude, name) and any(name == t or name.endswith(f".{t}") for t in lora.target_modules)
            for name, _ in model.named_modules()
        ):
            from mmprm.config import ConfigError

            raise ConfigError(
                f"model.lora.target_modules: {lora.target_modules} name no layer of the language model, only of "
                "the frozen vision tower (model.freeze_vision_tower=true): name the language model's layers "
                "(e.g. q_proj, v_proj), or set model.freeze_vision_tower=false to adapt the tower"
            )
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                exclude_modules=exclude,
            ),
        )
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class SaveNotice:
    """A request to checkpoint and stop, caught from SIGUSR1 (the notice train.sbatch forwards
    before a Slurm time limit or preemption) and acted on at the end of an optimizer step.

    The handler only sets a flag: the step under way finishes, then every rank learns in one
    all-reduce whether any rank was told, so all of them save the same step together.
    """

    def __init__(self, signum: int | None = None):
        import signal

        self.signum = signal.SIGUSR1 if signum is None else signum
        self.received = False
        try:
            self._previous = signal.signal(self.signum, self._catch)
        except ValueError:  # not the main thread (a notebook's worker): no notice, runs as before
            self._previous = None

    def _catch(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed(self, accelerator: Any) -> bool:
        """True on every rank when any rank was told (a collective: call it on all ranks)."""
        import torch

        if accelerator.num_processes == 1:
            return self.received
        told = torch.tensor(float(self.received), device=accelerator.device)
        return accelerator.reduce(told, "sum").item() > 0

    def close(self) -> None:
        """Give the signal back its handler from before."""
        import signal

        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None


TRACKER_FILE = "tracker_run.json"


def tracker_run(output_dir: str | Path, run_id: str, report_to: str, write: bool = True) -> dict:
    """The tracker run this training run logs to, kept in OUTPUT_DIR/tracker_run.json so that a
    requeued or resumed run (same `run_id`, see `start_run`) goes on logging into the same wandb
    run; a new run id (a fresh start) gets a new tracker id. Rank 0 writes (`write`).

    Returns:
        {"run_id", "report_to", "tracker_id"}.
    """
    import secrets

    path = Path(output_dir) / TRACKER_FILE
    try:
        saved = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        saved = {}
    if saved.get("run_id") == run_id and saved.get("report_to") == report_to and saved.get("tracker_id"):
        return saved
    record = {"run_id": run_id, "report_to": report_to, "tracker_id": secrets.token_hex(8)}
    if write:
        from mmprm.data.schema import atomic_write

        with atomic_write(path) as f:
            f.write(json.dumps(record))
    return record


def peak_rss_gb() -> float:
    """The process's peak resident memory since it started, GiB (the OS keeps no resettable peak)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


@dataclass
class LogWindow:
    """What this rank saw over the optimizer steps since the last train row: their losses and
    gradient norms, tokens and model FLOPs, and host seconds spent waiting for data, in forward and
    backward, and in the optimizer step."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[Any] = field(default_factory=list)
    tokens: int = 0
    flops: float = 0.0
    data_s: float = 0.0
    fwd_bwd_s: float = 0.0
    optimizer_s: float = 0.0

    def count(self, batch: dict, shape: tuple[int, int, int]) -> None:
        """Add a micro-batch's tokens (padding left out) and their training FLOPs (`flops_per_token`
        of `shape` = (n_params, n_layers, hidden), at the batch's mean sequence length)."""
        from mmprm.mfu import flops_per_token
        from mmprm.training.packing import run_tokens

        tokens = run_tokens(batch)
        self.tokens += tokens
        self.flops += tokens * flops_per_token(*shape, tokens / max(1, batch["attention_mask"].shape[0]))


class TrainingRun:
    """One run of a training recipe (prm_train, policy_sft): what they share, in the order they use it.

        run = TrainingRun("prm_train", cfg.train, cfg.output_dir, cfg.resume_from_checkpoint)
        model = ...                     # built after the seed is set
        model = run.prepare(model)      # AdamW, LR schedule, DDP / DeepSpeed / FSDP
        run.batch_order(unit_lengths)   # the global batches, a pure function of (seed, epoch, step)
        run.resume(cfg)                 # the checkpoint, output_dir, config.resolved.json, trackers
        stopped = run.fit(collate, unit_weights, micro_step, evaluate)
        ...                             # the recipe's final save, unless stopped
        leave_run(run.accelerator)

    The recipe brings what differs: its model and data, the loss of a micro-batch (`fit`), its
    evaluation and its final save. Metrics go to OUTPUT_DIR/metrics.jsonl and the trackers.
    """

    def __init__(self, name: str, train: TrainConfig, output_dir: str | Path, resume: str | None):
        """Check the run's settings against the launch, build the Accelerator, set the seed and find
        the checkpoint to resume (raising ConfigError / FileExistsError before anything loads)."""
        import torch
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from mmprm.config import ConfigError

        self.name, self.train, self.output_dir = name, train, Path(output_dir)
        self.log_with = None if train.report_to == "none" else train.report_to
        if self.log_with == "wandb":
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "train.report_to=wandb but wandb is not installed: pip install 'mmprm[wandb]'"
                ) from None
        use_bf16 = train.bf16 and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
        # Our LR schedule counts optimizer steps: accelerate's default steps it once per process.
        # gradient_accumulation_steps tells DeepSpeed which micro-batch closes a step (see `fit`).
        # The world size comes from the launcher: the Accelerator needs grad_accum when it is built.
        try:
            check_gpu(train)
            world_size = launched_world_size()
            resolve_grad_accum(train, world_size)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self.accelerator = Accelerator(
            mixed_precision="bf16" if use_bf16 else "no",
            log_with=self.log_with,
            project_dir=str(self.output_dir),
            gradient_accumulation_steps=train.grad_accum,
            step_scheduler_with_optimizer=False,
            kwargs_handlers=accelerator_kwargs(train.dist_timeout_s),
        )
        try:
            check_world_size(self.accelerator, world_size)
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
        ds = self.accelerator.state.deepspeed_plugin
        if train.compile and ds is not None and ds.deepspeed_config.get("zero_optimization", {}).get("stage") == 3:
            # ZeRO-3 gathers each weight in hooks on every submodule, which would cut a layer's graph
            # at every linear layer; DeepSpeed compiles such a model itself (its `compile` config).
            raise ConfigError(
                "train.compile: not supported under DeepSpeed ZeRO-3 (its per-module weight gathering breaks the "
                "compiled layers apart); set train.compile=false, or use ZeRO-2 or FSDP2 (launch/accelerate/fsdp.yaml)"
            )
        set_seed(train.seed)
        self.log = self.accelerator.print
        # before loading anything: a fresh start over another run's checkpoints is refused here
        self.resume_from = find_checkpoint(self.output_dir, resume, log=self.log, overwrite=train.overwrite_output_dir)
        self.progress = TrainProgress()
        # from here on, not only in fit(): a notice that comes while the model loads is kept
        self.notice = SaveNotice()
        self.stopped_by: Literal["stop_at_step", "notice"] | None = None

    def prepare(self, model: Any) -> Any:
        """AdamW over the trainable weights and the LR schedule, handed with the model to accelerate
        (DDP, DeepSpeed or FSDP); returns the prepared model (also `self.model`)."""
        import torch

        from mmprm.mfu import model_shape, peak_flops
        from mmprm.models.sharding import log_zero3_partitions

        train, accelerator = self.train, self.accelerator
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=train.lr, weight_decay=train.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, train.warmup_steps, train.max_steps, train.schedule)
        )
        # counted before prepare() shards or partitions the weights
        self.model_shape = model_shape(model)
        device_name = torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else None
        self.peak_flops = peak_flops(train.peak_tflops, device_name)
        if self.peak_flops is None and device_name is not None:
            self.log(
                f"MFU is logged as null: {device_name} is not in mmprm.mfu.PEAK_BF16_TFLOPS (set train.peak_tflops)"
            )
        ds = accelerator.state.deepspeed_plugin
        if ds is not None:
            # No dataloader goes through prepare(), so DeepSpeed cannot infer these "auto" values itself.
            ds.deepspeed_config["train_micro_batch_size_per_gpu"] = train.batch_size
            ds.deepspeed_config["gradient_clipping"] = train.max_grad_norm
        if train.compile:
            # before prepare: DDP and FSDP2 wrap the compiled layers (FSDP2's hooks run outside the
            # graph); after adapt_backbone, so LoRA layers and gradient checkpointing are traced in
            from mmprm.config import ConfigError
            from mmprm.models.compile_layers import compile_decoder_layers

            try:
                n = compile_decoder_layers(model)
            except ValueError as e:
                raise ConfigError(f"train.{e}") from None
            self.log(f"train.compile: {n} decoder layers compiled (the first step traces and compiles them)")
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        # read after prepare: FSDP2's fully_shard replaces every parameter with a sharded one, and
        # the gradients land on those (the optimizer is remapped to them by accelerate)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        log_zero3_partitions(accelerator, self.model, self.output_dir, self.log)
        return self.model

    def batch_order(self, unit_lengths: Sequence[int], unit: str = "rows") -> None:
        """The stream of global batches over the training units (rows, or packs of rows), logged."""
        train, processes = self.train, self.accelerator.num_processes
        self.global_batch, self.unit = train.batch_size * processes, unit
        self.stream = BatchStream(unit_lengths, self.global_batch, train.seed, train.group_by_length)
        self.log(
            f"global batch: {train.batch_size} {unit} x {train.grad_accum} micro-step(s) x "
            f"{processes} process(es) = {self.global_batch * train.grad_accum} {unit} per optimizer step"
        )

    def resume(self, cfg: Any) -> None:
        """Load the checkpoint found at start (weights, optimizer, batch order, RNG, counters), ready
        output_dir for this run (`start_run`), save the resolved `cfg` and start the trackers."""
        from mmprm.config import RESOLVED_CONFIG, resolved_config_text, to_dict

        accelerator = self.accelerator
        accelerator.register_for_checkpointing(self.stream, self.progress)
        if self.resume_from is not None:
            accelerator.load_state(str(self.resume_from))
            self.log(f"resumed from {self.resume_from} at step {self.progress.step}")
            stream = self.stream
            if stream.epoch_batch != stream.batch_size:  # another number of processes, or batch_size
                self.log(
                    f"the checkpoint cut epoch {stream.epoch} into global batches of {stream.epoch_batch} {self.unit}, "
                    f"this run cuts {stream.batch_size}: it trains on from {self.unit} {stream.rows} of that "
                    "epoch's order, so none is skipped"
                )
        self.run_id = start_run(
            accelerator,
            self.output_dir,
            self.resume_from,
            self.progress.step,
            self.train.overwrite_output_dir,
            self.log,
        )
        if accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / RESOLVED_CONFIG).write_text(resolved_config_text(cfg, accelerator.num_processes))
        if self.log_with:
            tracker = tracker_run(self.output_dir, self.run_id, self.log_with, write=accelerator.is_main_process)
            init_kwargs = {
                "wandb": {"id": tracker["tracker_id"], "resume": "allow"},
                # a resume hides what a killed run logged after its checkpoint
                "tensorboard": {"purge_step": self.progress.step + 1} if self.resume_from is not None else {},
            }
            accelerator.init_trackers(
                self.name, config={k: str(v) for k, v in to_dict(cfg).items()}, init_kwargs=init_kwargs
            )

    def write_metrics(self, row: dict) -> None:
        """One row (split, step, numbers) to metrics.jsonl (rank 0) and to the trackers."""
        if self.accelerator.is_main_process:
            with open(self.output_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")
        self.accelerator.log(
            {f"{row['split']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"]
        )

    def fit(
        self,
        collate: Callable[[Sequence[int]], Any],
        unit_weights: Sequence[int],
        micro_step: Callable[[dict, Any, int, int], float],
        evaluate: Callable[[], None] | None = None,
    ) -> bool:
        """Train from the current step to train.max_steps, logging, evaluating and checkpointing as
        configured; True when it stopped early instead, its checkpoint written (`stopped_by`:
        train.stop_at_step, or the save notice, SIGUSR1, at the end of the step it came in).

        `collate(indices)` gives (batch, items) of training units; `unit_weights[i]`: the loss terms
        (step tokens, assistant tokens) of unit i. `micro_step(batch, items, k, n_window)` runs the
        forward and backward of micro-batch k of a window whose ranks hold `n_window` loss terms in
        all, and returns its share of the window's mean loss. `evaluate()` runs at train.eval_every
        and at the end. Every train.log_every steps a train row (`_log_train`) goes to metrics.jsonl.
        """
        from tqdm.auto import tqdm

        train, accelerator, progress = self.train, self.accelerator, self.progress
        self.model.train()
        bar = tqdm(
            total=train.max_steps, initial=progress.step, desc=self.name, disable=not accelerator.is_main_process
        )
        t0, window = time.time(), LogWindow()
        prefetch = Prefetcher(collate, enabled=train.prefetch_batches)
        while progress.step < train.max_steps:
            t_data = time.perf_counter()
            global_batches, micro_batches = self._next_window(prefetch)
            # The loss is a mean over the loss terms of the whole window on all ranks, so a term
            # weighs the same whichever rank and micro-batch run it. Every rank holds the global
            # batches, so each counts them all without a collective.
            n_window = sum(unit_weights[i] for b in global_batches for i in b)
            window_loss = 0.0
            for k, idx in enumerate(micro_batches):
                batch, items = prefetch.get(idx)
                window.count(batch, self.model_shape)  # on the host copy: no device sync
                batch = {key: v.to(accelerator.device) for key, v in batch.items()}
                t_model = time.perf_counter()
                window.data_s += t_model - t_data
                # accumulate() syncs (DDP all-reduce, DeepSpeed step) on the last of grad_accum micro-batches only
                with accelerator.accumulate(self.model):
                    window_loss += micro_step(batch, items, k, n_window)
                t_data = time.perf_counter()
                window.fwd_bwd_s += t_data - t_model
            window_loss, grad_norm = self._optimizer_step(window_loss)
            window.optimizer_s += time.perf_counter() - t_data
            window.losses.append(window_loss)
            window.grad_norms.append(grad_norm)
            bar.update(1)
            bar.set_postfix(loss=f"{window_loss:.4f}")
            if progress.step == train.stop_at_step:
                self.stopped_by = "stop_at_step"
            elif self.notice.agreed(accelerator) and progress.step < train.max_steps:
                self.stopped_by = "notice"
            stopping = self.stopped_by is not None
            # a run that stops logs the steps since its last row: the resumed run starts a new window
            if progress.step % train.log_every == 0 or progress.step == train.max_steps or stopping:
                self._log_train(window, time.time() - t0)
                window = LogWindow()
            if evaluate is not None and (progress.step % train.eval_every == 0 or progress.step == train.max_steps):
                prefetch.wait()  # evaluation tokenizes with the same processor
                evaluate()
            if progress.step % train.save_every == 0 or progress.step == train.max_steps or stopping:
                save_checkpoint(
                    accelerator, self.output_dir, progress.step, run_id=self.run_id, keep=train.keep_checkpoints
                )
            if stopping:
                prefetch.close()
                self.notice.close()
                return True
        prefetch.close()
        bar.close()
        self.notice.close()
        return False

    def _next_window(self, prefetch: Prefetcher) -> tuple[list[list[int]], list[list[int]]]:
        """The next optimizer step's global batches and this rank's micro-batches of them; queues
        those and the following step's for collation."""
        accelerator = self.accelerator
        global_batches = [self.stream.next() for _ in range(self.train.grad_accum)]
        micro_batches = [rank_share(b, accelerator.process_index, accelerator.num_processes) for b in global_batches]
        # the next step's micro-batches collate on a background thread while this step trains
        prefetch.submit(micro_batches)
        prefetch.submit(
            [
                rank_share(b, accelerator.process_index, accelerator.num_processes)
                for b in self.stream.peek(len(global_batches))
            ]
        )
        return global_batches, micro_batches

    def _optimizer_step(self, window_loss: float) -> tuple[float, Any]:
        """Clip, step the optimizer and the schedule, count the step; returns the window's mean loss
        over all ranks (`window_loss`: this rank's share of it) and the global gradient norm before
        clipping (a tensor or float, read on the host only at log steps; None if the engine has none)."""
        import torch
        from accelerate.utils import DistributedType

        accelerator, train = self.accelerator, self.train
        # this rank's share of the window's mean; the ranks' shares add up to the loss trained on
        window_loss = accelerator.reduce(torch.tensor(window_loss, device=accelerator.device), "sum").item()
        grad_norm = None
        if train.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(self.trainable, train.max_grad_norm)
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            # the engine stepped (and clipped) inside backward() at the window's last micro-batch;
            # it keeps that step's global norm over all partitions
            grad_norm = self.model.get_global_grad_norm()
        elif train.max_grad_norm <= 0:
            grad_norm = self._grad_norm()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.examples_seen += self.global_batch * train.grad_accum  # rows, or packs
        return window_loss, grad_norm

    def _grad_norm(self) -> Any:
        """The global L2 norm of the gradients, without clipping them (train.max_grad_norm=0)."""
        import torch

        grads = [p.grad for p in self.trainable if p.grad is not None]
        if not grads:
            return None
        norm = torch.nn.utils.get_total_norm(grads)
        # FSDP2 gradients are DTensor shards: their norm is a DTensor whose full value is the global one
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _log_train(self, window: LogWindow, elapsed: float) -> None:
        """A train row of metrics.jsonl and the trackers: loss, LR, grad norm, throughput, MFU,
        peak memory and the step time split, each over the steps since the last row."""
        import torch

        accelerator = self.accelerator
        if accelerator.device.type == "cuda":
            # CUDA runs ahead of the host: wait once per log window, so the window's time holds all
            # its kernels without a sync per step (the splits count where the host waited)
            torch.cuda.synchronize(accelerator.device)
            peak_gb = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
            torch.cuda.reset_peak_memory_stats(accelerator.device)
        else:
            peak_gb = peak_rss_gb()
        steps = len(window.losses)
        seconds = max(window.data_s + window.fwd_bwd_s + window.optimizer_s, 1e-9)
        # one collective per log step: tokens and FLOPs add up over ranks, memory is the largest rank's
        local = torch.tensor([window.tokens, window.flops, peak_gb], dtype=torch.float64, device=accelerator.device)
        every = accelerator.gather(local.unsqueeze(0)).reshape(-1, 3)
        tokens, flops, peak_gb = float(every[:, 0].sum()), float(every[:, 1].sum()), float(every[:, 2].max())
        norms = [float(g) for g in window.grad_norms if g is not None]
        row = {
            "split": "train",
            "step": self.progress.step,
            "loss": sum(window.losses) / steps,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": sum(norms) / len(norms) if norms else None,
            "tokens_per_s": tokens / seconds,
            "samples_per_s": steps * self.global_batch * self.train.grad_accum / seconds,
            "mfu": flops / seconds / (self.peak_flops * accelerator.num_processes) if self.peak_flops else None,
            ("peak_mem_gb" if accelerator.device.type == "cuda" else "peak_rss_gb"): peak_gb,
            "data_s": window.data_s / steps,
            "fwd_bwd_s": window.fwd_bwd_s / steps,
            "optimizer_s": window.optimizer_s / steps,
            "step_s": seconds / steps,
            "seconds": elapsed,
        }
        self.write_metrics(row)
