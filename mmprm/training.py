"""Small pieces the training recipes share: deterministic batch order, LR schedule, resume state.

Batch order is a pure function of (seed, epoch, step), so a resumed run sees exactly the batches
an uninterrupted run would have seen, on any number of processes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


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
    """Endless stream of full global batches over epochs; `position` (epoch, index) is resumable."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, group_by_length: bool = True):
        if not lengths:
            raise ValueError("no training examples left after tokenization; check data.train_file and max_length")
        self.lengths, self.batch_size, self.seed, self.group = list(lengths), batch_size, seed, group_by_length
        self.epoch, self.index = 0, 0
        self._batches = self._epoch(0)

    def _epoch(self, epoch: int) -> list[list[int]]:
        # full batches only, so every process gets its share (see rank_share)
        return epoch_batches(self.lengths, self.batch_size, self.seed, epoch, self.group, pad_last=True)

    def next(self) -> list[int]:
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self._epoch(self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._batches = self._epoch(self.epoch)


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


def find_checkpoint(output_dir: str | Path, resume: str | None) -> Path | None:
    """Resolve `resume_from_checkpoint`: None/'' -> None, 'latest' -> newest under output_dir/checkpoints."""
    if not resume:
        return None
    if resume == "latest":
        ckpts = sorted((Path(output_dir) / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(
            f"resume_from_checkpoint={resume}: no such checkpoint directory "
            "(use 'latest' or a path under OUTPUT_DIR/checkpoints)"
        )
    return path


def process_group_kwargs() -> list:
    """`kwargs_handlers` for `Accelerator` so DeepSpeed ranks on a machine without GPUs form one group.

    Without a GPU, accelerate gives DeepSpeed no backend and counts one process per rank: two
    processes of `accelerate launch --num_processes 2 --config_file deepspeed_zero3.yaml` each
    train alone on all the data. Naming gloo makes them one group (world size 2). With GPUs, and
    outside a DeepSpeed launch, this returns nothing and accelerate chooses as usual.
    """
    import os

    import torch

    launched = os.environ.get("LOCAL_RANK") is not None
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not (launched and deepspeed) or torch.cuda.is_available():
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="gloo")]
