"""The streamed training data path: cached tokenization equals the eager path batch for batch on
every architecture, the cache is reused and keyed, images are checked per batch, truncation
never turns a negative path positive, and every rank gets a full share."""

from __future__ import annotations

import json
import os
import random
import re
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmprm.data.schema import DataError, load_examples, load_image
from mmprm.models.loading import add_step_token, load_processor
from mmprm.steps import tokenize_steps
from mmprm.training.collate import collate_steps
from mmprm.training.data import (
    PRMCollator,
    SFTCollator,
    collate_sft,
    load_tokenized,
    prm_labels,
    tokenize_sft,
    truncation_keeps_row,
)
from mmprm.training.run import (
    BatchStream,
    Prefetcher,
    TrainConfig,
    check_world_size,
    epoch_batches,
    eval_share,
    launched_world_size,
    rank_share,
    resolve_grad_accum,
    wrap_padding,
)

ARCHS = ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"]
# Sizes whose processed token counts differ (Qwen grids, InternVL tiles); LLaVA is fixed.
SIZES = [(640, 480), (28, 28), (300, 90), (90, 300), (200, 200)]


def write_rows(folder: Path, n: int, images: bool = True, name: str = "rows.jsonl", answer: bool = False) -> Path:
    """n labelled rows with noisy images of varied sizes (blank-image tokenization must not care)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        imgs = []
        if images:  # one file per size, shared by path like a question's image across its rows
            w, h = SIZES[i % len(SIZES)]
            image = f"img{i % len(SIZES)}.png"
            if not (folder / image).exists():
                Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3)).save(folder / image)
            imgs = [image]
        n_steps = 1 + i % 3
        labels = [1.0] * n_steps if i % 2 else [1.0] * (n_steps - 1) + [0.25]
        row = {
            "id": f"r{i}",
            "images": imgs,
            "question": f"What is {i} + {i}?",
            "steps": [f"Step {k}: {i} + {k} = {i + k}." for k in range(n_steps)],
            "labels": labels,
        }
        if answer:
            row["answer"] = str(2 * i)
        rows.append(row)
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prm_processor(tiny_models, arch):
    processor = load_processor(tiny_models(arch))
    add_step_token(processor, None)
    return processor


SETTINGS = {
    "max_length": 512,
    "step_token": "<|prm_step|>",
    "system": None,
    "label_mode": "soft",
    "hard_threshold": 0.5,
}


def assert_batches_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_prm_batch_equals_eager_batch(tiny_models, tmp_path, arch):
    processor = prm_processor(tiny_models, arch)
    path = write_rows(tmp_path, 10, images=arch != "qwen2")
    data, stats = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    assert stats["kept"] == 10 and not stats["reused"]
    collate = PRMCollator(data, processor, pad_id=0, source=str(path), **SETTINGS)

    examples = load_examples(path, require_labels=True)  # the old eager path: everything up front
    eager = [
        tokenize_steps(processor, e.question, e.steps, [load_image(p) for p in e.images], e.labels, 512)
        for e in examples
    ]
    for idx in ([0, 1, 2, 3], [9, 4, 7], [5, 6, 8]):
        batch, items = collate(idx)
        assert_batches_equal(batch, collate_steps([eager[i] for i in idx], pad_id=0))
        assert [t.id for t in items] == [examples[i].id for i in idx]
        # same ids, same step positions as the one step tokenization
        assert [t.step_positions for t in items] == [eager[i].step_positions for i in idx]
    if arch != "qwen2":
        assert "pixel_values" in batch


def write_paths(folder: Path, problems: int, paths: int, images: bool = True) -> Path:
    """`paths` rows per problem sharing its question and image, as an MCTS export writes them."""
    rng = random.Random(1)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in range(problems):
        w, h = SIZES[p % len(SIZES)]
        image = f"problem{p}.png"
        if images:
            Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3)).save(folder / image)
        for k in range(paths):
            n_steps = 1 + (p + k) % 3
            rows.append(
                {
                    "id": f"p{p}/path{k}",
                    "images": [image] if images else [],
                    "question": f"Problem {p}: add the numbers.",
                    "steps": [f"Step {j}: {p} + {k * j} = {p + k * j}." for j in range(n_steps)],
                    "labels": [round(1.0 - 0.25 * j, 2) for j in range(n_steps)],
                }
            )
    rng.shuffle(rows)
    path = folder / "paths.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_cache_gives_the_batches_of_full_tokenization(tiny_models, tmp_path, arch):
    processor = prm_processor(tiny_models, arch)
    path = write_paths(tmp_path, problems=3, paths=4, images=arch != "qwen2")
    data, _ = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    cached = PRMCollator(data, processor, 0, source=str(path), **SETTINGS)
    uncached = PRMCollator(data, processor, 0, source=str(path), prompt_cache_mb=0, **SETTINGS)
    for idx in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [11, 0, 5]):
        assert_batches_equal(cached(idx)[0], uncached(idx)[0])
    assert len(cached.prompts.entries) == 3 and not uncached.prompts.entries  # one prompt per problem


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cut", [False, True])
def test_cache_built_from_known_prompts_equals_tokenizing_each_row(tiny_models, tmp_path, arch, cut):
    """Building the cache, a problem's later rows tokenize only their steps after its first row's
    prompt (`extend_steps`); every row must still get the ids of its own full tokenization, cut
    rows too (cut: max_length 2 tokens under the median row, so longer rows lose steps)."""
    processor = prm_processor(tiny_models, arch)
    path = write_paths(tmp_path, problems=3, paths=4, images=arch != "qwen2")
    examples = load_examples(path, require_labels=True)
    images = {e.id: [load_image(tmp_path / p) for p in e.images] for e in examples}
    max_length = 512
    if cut:
        lengths = sorted(len(tokenize_steps(processor, e.question, e.steps, images[e.id]).input_ids) for e in examples)
        max_length = lengths[len(lengths) // 2] - 2
    data, stats = load_tokenized(
        path, "prm", processor, {**SETTINGS, "max_length": max_length}, cache_dir=tmp_path / "cache", num_proc=1
    )
    cached = {data.row(i)["id"]: data.row(i) for i in range(len(data))}
    trimmed = 0
    for e in examples:
        tok = tokenize_steps(processor, e.question, e.steps, images[e.id], e.labels, max_length)
        assert (tok is None) == (e.id not in cached), e.id
        if tok is not None:
            assert cached[e.id]["input_ids"] == tok.input_ids, e.id
            assert cached[e.id]["step_positions"] == tok.step_positions, e.id
            trimmed += len(tok.step_positions) < len(e.steps)
    assert stats["kept"] == len(data) > 0
    assert (trimmed > 0) == cut


def test_prompt_cache_stays_within_its_bound(tiny_models, tmp_path):
    processor = prm_processor(tiny_models, "qwen2_vl")
    path = write_paths(tmp_path, problems=5, paths=2)
    data, _ = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    collate = PRMCollator(data, processor, 0, **SETTINGS)
    collate(list(range(10)))
    one = max(size for _, size in collate.prompts.entries.values())
    small = PRMCollator(data, processor, 0, prompt_cache_mb=one / 2**20, **SETTINGS)  # room for the largest
    for i in range(10):
        small([i])
        assert 0 < small.prompts.bytes <= one
    assert len(small.prompts.entries) < 5  # older prompts went out
    assert_batches_equal(small(list(range(10)))[0], collate(list(range(10)))[0])


@pytest.mark.parametrize("arch", ["qwen2_vl", "internvl", "qwen2"])
def test_streamed_sft_batch_equals_eager_batch(tiny_models, tmp_path, arch):
    processor = load_processor(tiny_models(arch))
    path = write_rows(tmp_path, 6, images=arch != "qwen2", answer=True)
    settings = {"max_length": 512, "system": "Solve."}
    data, stats = load_tokenized(path, "sft", processor, settings, cache_dir=tmp_path / "cache", num_proc=1)
    collate = SFTCollator(data, processor, pad_id=0, **settings)
    examples = load_examples(path)
    eager = [
        tokenize_sft(processor, e.question, e.steps, e.answer, [load_image(p) for p in e.images], 512, "Solve.")
        for e in examples
    ]
    batch, _ = collate([5, 0, 3])
    assert_batches_equal(batch, collate_sft([eager[i] for i in (5, 0, 3)], pad_id=0))
    assert list(data["n_targets"]) == [sum(x != -100 for x in t["labels"][1:]) for t in eager]


def test_cache_is_reused_and_keyed_by_file_processor_and_settings(tiny_models, tmp_path):
    processor = prm_processor(tiny_models, "qwen2_vl")
    path = write_rows(tmp_path, 130)  # enough rows for 2 tokenization workers
    cache = tmp_path / "cache"
    data, first = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=cache, num_proc=2)
    assert first["kept"] == 130 and list(data["id"]) == [f"r{i}" for i in range(130)]  # order kept
    PRMCollator(data, processor, 0, **SETTINGS)([0, 64, 127, 129])  # workers' ids match the real images'
    again, second = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=cache, num_proc=2)
    assert not first["reused"] and second["reused"] and first["cache"] == second["cache"]
    assert list(again["input_ids"]) == list(data["input_ids"])
    _, other = load_tokenized(path, "prm", processor, {**SETTINGS, "max_length": 64}, cache_dir=cache, num_proc=1)
    assert not other["reused"] and other["cache"] != first["cache"]
    add_step_token(processor, None, token="<|other_step|>")  # a different vocabulary: a different cache
    _, grown = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=cache, num_proc=1)
    assert not grown["reused"] and grown["cache"] != first["cache"]
    os.utime(path, ns=(0, 0))  # the file changed (mtime): tokenized again
    _, touched = load_tokenized(
        path, "prm", prm_processor(tiny_models, "qwen2_vl"), SETTINGS, cache_dir=cache, num_proc=1
    )
    assert not touched["reused"] and touched["cache"] != first["cache"]
    assert not list(cache.glob("*.tmp-*"))  # builds are renamed into place, nothing half-written left


def test_cached_rows_read_what_datasets_wrote_across_shards(tmp_path):
    import datasets

    from mmprm.training.data import CachedRows

    rows = {"id": [f"r{i}" for i in range(7)], "input_ids": [[i] * (i % 3 + 1) for i in range(7)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "data"), num_shards=3)
    cached = CachedRows(tmp_path / "data")
    assert len(list((tmp_path / "data").glob("*.arrow"))) == 3 and len(cached) == 7
    assert cached.column("input_ids") == rows["input_ids"] and cached["id"] == rows["id"]
    assert cached[[5, 0]] == {"id": ["r5", "r0"], "input_ids": [[5, 5, 5], [0]]}
    assert cached[4] == {"id": "r4", "input_ids": [4, 4]}


def test_cached_rerun_does_not_import_datasets(tiny_models, tmp_path):
    """A rerun (and every rank but the builder) opens the cache with pyarrow alone: 0.4 s per start."""
    import subprocess
    import sys

    model = tiny_models("qwen2_vl")
    path = write_rows(tmp_path, 12)
    load_tokenized(path, "prm", prm_processor(tiny_models, "qwen2_vl"), SETTINGS, cache_dir=tmp_path / "cache")
    script = f"""
import sys
from mmprm.models.loading import add_step_token, load_processor
from mmprm.training.data import load_tokenized
processor = load_processor({str(model)!r})
add_step_token(processor, None)
rows, stats = load_tokenized({str(path)!r}, "prm", processor, {SETTINGS!r}, cache_dir={str(tmp_path / "cache")!r})
assert stats["reused"] and len(rows) == 12, stats
print("datasets" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_rank_that_starts_after_the_cache_is_built_still_meets_rank_0(tiny_models, tmp_path):
    """Rank 1 calls load_tokenized only once rank 0's cache is on disk (a slow node, a late start).

    It used to see the finished cache, skip the barrier rank 0 was waiting in, and leave both
    ranks in mismatched collectives: the 2-node Slurm training jobs hung in CI this way.
    """
    import subprocess

    from recipe_runs import cpu_ddp_launcher

    model = tiny_models("qwen2_vl")
    train, ev = write_rows(tmp_path, 6), write_rows(tmp_path, 4, name="eval.jsonl")
    cache = tmp_path / "cache"
    script = tmp_path / "late_rank.py"
    script.write_text(f"""
import datetime, time
from pathlib import Path
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from mmprm.models.loading import add_step_token, load_processor
from mmprm.training.data import load_tokenized

# a mismatched collective fails after 60 s instead of hanging the suite
acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])
processor = load_processor({str(model)!r})
add_step_token(processor, None)
for path in ({str(train)!r}, {str(ev)!r}):  # two files, as prm_train loads train and eval
    if acc.process_index == 1:
        while len(list(Path({str(cache)!r}).glob("*/stats.json"))) < (1 if path == {str(train)!r} else 2):
            time.sleep(0.2)
    rows, stats = load_tokenized(path, "prm", processor, {SETTINGS!r}, cache_dir={str(cache)!r}, accelerator=acc)
    total = acc.reduce(torch.tensor([float(len(rows))]), reduction="sum").item()
    assert total == 2 * len(rows), (acc.process_index, total, len(rows))
    with open({str(tmp_path)!r} + f"/rank{{acc.process_index}}.txt", "a") as f:
        f.write(f"{{path}} {{len(rows)}} {{stats['reused']}}\\n")
acc.end_training()
""")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([*cpu_ddp_launcher(), str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # both ranks read both files; only the late rank found each cache already built
    for rank in (0, 1):
        seen = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert seen == [f"{train} 6 {rank == 1}", f"{ev} 4 {rank == 1}"], (rank, seen)


def test_a_build_longer_than_the_collective_timeout_does_not_kill_the_waiting_rank(tiny_models, tmp_path):
    """Two ranks whose process group times out after 5 s; building the cache takes 15. No rank may
    wait for the builder inside a collective (a barrier would time out, as NCCL's 600 s default did
    on a large multimodal set): both get the rows. A build that fails fails on both ranks."""
    import subprocess

    from recipe_runs import cpu_ddp_launcher

    model = tiny_models("qwen2_vl")
    train = write_rows(tmp_path, 6)
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    rows[0]["labels"] = [2.0] * len(rows[0]["steps"])
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    script = tmp_path / "slow_build.py"
    script.write_text(f"""
import datetime, time
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from mmprm.training import data as training_data
from mmprm.data.schema import DataError
from mmprm.models.loading import add_step_token, load_processor

acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5))])
build = training_data._build

def slow_build(path, *args, **kwargs):
    if path == {str(train)!r}:
        time.sleep(15)  # a large set on real processors, in miniature
    return build(path, *args, **kwargs)

training_data._build = slow_build
processor = load_processor({str(model)!r})
add_step_token(processor, None)
rows, stats = training_data.load_tokenized(
    {str(train)!r}, "prm", processor, {SETTINGS!r}, cache_dir={str(cache)!r}, accelerator=acc
)
total = acc.reduce(torch.tensor([float(len(rows))]), reduction="sum").item()
assert total == 2 * len(rows) == 12, (acc.process_index, total, len(rows))
try:
    training_data.load_tokenized({str(bad)!r}, "prm", processor, {SETTINGS!r}, cache_dir={str(cache)!r}, accelerator=acc)
    outcome = "built"
except DataError as e:
    outcome = str(e)
with open({str(tmp_path)!r} + f"/rank{{acc.process_index}}.txt", "w") as f:
    f.write(f"{{len(rows)}} {{stats['reused']}}\\n{{outcome}}\\n")
""")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([*cpu_ddp_launcher(), str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    for rank in (0, 1):
        got, failed = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert got == "6 False", (rank, got)  # neither found the cache when it asked: it was built for this job
        assert "bad.jsonl:1: id=r0: labels[0]: 2.0 is outside [0,1]" in failed, (rank, failed)


def test_image_changed_after_caching_is_caught_by_the_collator(tiny_models, tmp_path):
    processor = prm_processor(tiny_models, "qwen2_vl")
    path = write_rows(tmp_path, 3)
    data, _ = load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    Image.new("RGB", (28, 28)).save(tmp_path / "img0.png")  # was 640x480: fewer image tokens now
    with pytest.raises(DataError, match=r"rows.jsonl:1: id=r0: token ids differ from the tokenization cache"):
        PRMCollator(data, processor, 0, source=str(path), **SETTINGS)([0, 1])


def test_bad_rows_are_all_reported_before_tokenizing(tiny_models, tmp_path):
    processor = prm_processor(tiny_models, "qwen2_vl")
    path = write_rows(tmp_path, 3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["labels"] = [2.0] * len(rows[1]["steps"])
    rows[2]["images"] = ["missing.png"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"rows.jsonl:2: id=r1: labels\[0\]: 2.0 is outside \[0,1\]"):
        load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    rows[1]["labels"] = [1.0] * len(rows[1]["steps"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"rows.jsonl:3: id=r2: images: FileNotFoundError"):
        load_tokenized(path, "prm", processor, SETTINGS, cache_dir=tmp_path / "cache", num_proc=1)
    assert not list((tmp_path / "cache").glob("*"))  # a failed build leaves no cache behind


def test_sft_rows_with_the_models_special_tokens_are_refused(tiny_models, tmp_path):
    """An end-of-turn token inside a step (or the answer) would teach the policy to stop mid-solution:
    the SFT data is refused naming the row and field, as the PRM data is."""
    processor = load_processor(tiny_models("qwen2"))
    eos = getattr(processor, "tokenizer", processor).eos_token
    path = write_rows(tmp_path, 3, images=False, answer=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["steps"][0] += eos
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"max_length": 512, "system": None}
    with pytest.raises(DataError, match=re.escape(f"rows.jsonl:2: id=r1: steps[0] contains the special token {eos!r}")):
        load_tokenized(path, "sft", processor, settings, cache_dir=tmp_path / "cache", num_proc=1)
    rows[1]["steps"][0] = rows[1]["steps"][0].replace(eos, "")
    rows[2]["answer"] = f"4{eos}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=re.escape(f"rows.jsonl:3: id=r2: answer contains the special token {eos!r}")):
        load_tokenized(path, "sft", processor, settings, cache_dir=tmp_path / "cache", num_proc=1)


# ---- label modes: MC values -> training targets ------------------------------------------------


def test_label_modes_by_hand():
    # MC values of 16 rollouts: 0/16, 1/16, 7/16, 8/16, 16/16
    mc = [0.0, 0.0625, 0.4375, 0.5, 1.0]
    assert prm_labels(mc, "soft", 0.5) == [0.0, 0.0625, 0.4375, 0.5, 1.0]
    assert prm_labels(mc, "hard", 0.5) == [0.0, 0.0, 0.0, 1.0, 1.0]
    # MM-PRM's hard labels: one correct rollout in 16 makes a step good; the threshold is not read
    assert prm_labels(mc, "hard_any_correct", 0.5) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert prm_labels(mc, "hard_any_correct", 0.9) == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_label_mode_reaches_the_cached_rows(tiny_models, tmp_path):
    """The mode is applied at tokenization: the cache holds the mapped labels and counts its
    positive steps from them, and each mode keys its own cache."""
    processor = prm_processor(tiny_models, "qwen2")
    path = write_rows(tmp_path, 4, images=False)  # labels [0.25], [1, 1], [1, 1, 0.25], [1]
    by_mode = {}
    for mode in ("soft", "hard", "hard_any_correct"):
        settings = {**SETTINGS, "label_mode": mode}
        data, stats = load_tokenized(path, "prm", processor, settings, cache_dir=tmp_path / "cache", num_proc=1)
        assert not stats["reused"], mode
        by_mode[mode] = (data.column("labels"), sum(data.column("n_pos")))
    assert by_mode["soft"] == ([[0.25], [1.0, 1.0], [1.0, 1.0, 0.25], [1.0]], 5)
    assert by_mode["hard"] == ([[0.0], [1.0, 1.0], [1.0, 1.0, 0.0], [1.0]], 5)
    assert by_mode["hard_any_correct"] == ([[1.0], [1.0, 1.0], [1.0, 1.0, 1.0], [1.0]], 7)


# ---- truncation: a negative path never trains as a positive one -------------------------------


def test_truncation_policy_by_hand():
    assert truncation_keeps_row([1.0, 1.0, 1.0], kept=1)  # positive path: a shorter positive path
    assert not truncation_keeps_row([1.0, 1.0, 0.0], kept=2)  # the only error step would go
    assert truncation_keeps_row([1.0, 0.0, 0.0], kept=2)  # first error kept, later steps cut
    assert not truncation_keeps_row([1.0, 0.4, 1.0], kept=1)  # soft label 0.4 < 0.5 is an error step
    assert truncation_keeps_row([1.0, 0.6], kept=1)  # 0.6 is not


def test_truncated_error_step_drops_the_row_and_counts_it(tiny_models, tmp_path):
    processor = prm_processor(tiny_models, "qwen2")
    long_step = "Then " + " ".join(["we add the numbers again carefully."] * 12)
    rows = [  # hand-built: steps 2-3 fall past max_length in both rows
        {"id": "neg", "question": "1+1?", "steps": ["1+1=2.", long_step, "So 3."], "labels": [1.0, 1.0, 0.0]},
        {"id": "pos", "question": "1+1?", "steps": ["1+1=2.", long_step, "So 2."], "labels": [1.0, 1.0, 1.0]},
        {"id": "neg-early", "question": "1+1?", "steps": ["1+1=3.", long_step, "So 3."], "labels": [0.0, 0.0, 0.0]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = tokenize_steps(processor, "1+1?", rows[0]["steps"], labels=rows[0]["labels"])
    max_length = full.step_positions[0] + 1  # room for the first step only
    data, stats = load_tokenized(
        path, "prm", processor, {**SETTINGS, "max_length": max_length}, cache_dir=tmp_path / "cache", num_proc=1
    )
    assert list(data["id"]) == ["pos", "neg-early"]
    assert stats["dropped_error_step_truncated"] == 1 and stats["dropped_prompt_too_long"] == 0
    assert stats["dropped_steps"] == 4  # two trailing steps cut from each kept row
    batch, items = PRMCollator(data, processor, 0, **{**SETTINGS, "max_length": max_length})([0, 1])
    assert [t.labels for t in items] == [[1.0], [0.0]]  # the early error step still trains as one
    assert batch["targets"].tolist() == [1.0, 0.0]


# ---- every rank fed ---------------------------------------------------------------------------


def test_last_global_batch_is_padded_by_wrap_around():
    lengths = list(range(9))
    batches = epoch_batches(lengths, 8, seed=0, epoch=0, group_by_length=False, pad_last=True)
    assert [len(b) for b in batches] == [8, 8]
    order = batches[0] + batches[1][:1]
    assert sorted(order) == lengths and batches[1][1:] == batches[0][:7]  # wrap-around from the start
    for batch in batches:  # 2 ranks x batch size 4: both ranks get 4 rows in every batch
        assert [len(rank_share(batch, r, 2)) for r in (0, 1)] == [4, 4]
    assert wrap_padding(9, 8) == 7 and wrap_padding(16, 8) == 0
    tiny = epoch_batches([5, 6], 8, seed=0, epoch=0, pad_last=True)  # fewer rows than one batch
    assert len(tiny) == 1 and len(tiny[0]) == 8 and set(tiny[0]) == {0, 1}
    stream = BatchStream(lengths, 8, seed=0)
    assert all(len(stream.next()) == 8 for _ in range(5))
    with pytest.raises(ValueError, match="without a row"):
        rank_share([3], 1, 2)


def test_eval_share_gives_every_rank_the_same_count():
    shares = [eval_share(5, r, 2) for r in (0, 1)]
    assert shares == [([0, 2, 4], 3), ([1, 3, 0], 2)]  # rank 1 scores row 0 again, counts 2
    assert sorted(i for idx, n in shares for i in idx[:n]) == [0, 1, 2, 3, 4]
    assert eval_share(1, 1, 4) == ([0], 0)


def test_a_global_batch_size_derives_accumulation_from_the_world_size():
    for processes, accum in ((1, 32), (8, 4), (32, 1)):
        train = TrainConfig(batch_size=4, global_batch_size=128)
        assert resolve_grad_accum(train, processes) == accum == train.grad_accum
    assert resolve_grad_accum(TrainConfig(batch_size=4, grad_accum=3), 8) == 3  # no global batch: as given
    with pytest.raises(ValueError, match=r"global_batch_size=100 is not a multiple of .* 4 x 8 = 32"):
        resolve_grad_accum(TrainConfig(batch_size=4, global_batch_size=100), 8)
    with pytest.raises(ValueError, match="not a multiple"):  # fewer rows than one micro-step of all ranks
        resolve_grad_accum(TrainConfig(batch_size=4, global_batch_size=16), 8)
    with pytest.raises(ValueError, match=r"grad_accum=2 and train.global_batch_size=128 disagree .* asks for 4"):
        resolve_grad_accum(TrainConfig(batch_size=4, grad_accum=2, global_batch_size=128), 8)


def test_the_world_size_is_the_launchers_and_a_process_that_runs_alone_is_refused(monkeypatch):
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launched_world_size() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launched_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert launched_world_size() == 16
    check_world_size(types.SimpleNamespace(num_processes=16), 16)
    with pytest.raises(RuntimeError, match="started 16 processes but this one sees 1: .* ACCELERATE_USE_CPU=true"):
        check_world_size(types.SimpleNamespace(num_processes=1), 16)


def test_peek_shows_the_next_batches_without_moving_the_stream():
    stream = BatchStream([3, 1, 2, 5, 4], batch_size=2, seed=0, group_by_length=False)
    stream.next()
    state = stream.state_dict()
    ahead = stream.peek(4)  # crosses into the next epoch
    assert stream.state_dict() == state
    assert [stream.next() for _ in range(4)] == ahead


@pytest.mark.parametrize("group_by_length", [False, True])
def test_a_stream_resumed_on_twice_the_processes_skips_no_row_of_the_epoch(group_by_length):
    # 64 rows, global_batch_size=8 of batch_size 4: 1 process streams batches of 4 (2 micro-steps
    # a step), 2 processes batches of 8. A checkpoint after 5 steps on 1 process, resumed on 2.
    lengths = [random.Random(i).randint(10, 90) for i in range(64)]
    one = BatchStream(lengths, 4, seed=3, group_by_length=group_by_length)
    trained = [i for _ in range(5 * 2) for i in one.next()]
    two = BatchStream(lengths, 8, seed=3, group_by_length=group_by_length)
    two.load_state_dict(one.state_dict())
    while two.epoch == 0:
        batch = two.next()
        if two.epoch == 0:
            assert len(batch) == 8
            trained += batch
    assert sorted(trained) == list(range(64))  # epoch 0 whole: no row skipped, none twice
    # the rest of epoch 0 goes in the order 1 process would have trained it
    assert trained[40:] == [i for _ in range(6) for i in one.next()]
    # and the next epochs are those of a run on 2 processes from the start
    fresh = BatchStream(lengths, 8, seed=3, group_by_length=group_by_length)
    fresh.load_state_dict({"epoch": 1, "rows": 0, "epoch_batch": 8})
    assert batch == fresh.next()


def test_a_stream_resumed_on_more_processes_fills_the_epochs_last_batch():
    # 20 rows in batches of 8 (2 processes x 4; the epoch's third batch repeats 4 rows), resumed
    # after two batches on 3 processes: the 8 rows left do not fill a batch of 12, so it takes 4
    # more from the epoch's start, as every epoch's last batch does
    lengths = list(range(20))
    two = BatchStream(lengths, 8, seed=0, group_by_length=False)
    first = two.next() + two.next()
    state = two.state_dict()
    left = two.next()
    three = BatchStream(lengths, 12, seed=0, group_by_length=False)
    three.load_state_dict(state)
    last = three.next()
    assert len(last) == 12 and last[:8] == left and last[8:] == first[:4]
    assert sorted(set(first + last)) == lengths and three.epoch == 0
    assert three.next() == epoch_batches(lengths, 12, seed=0, epoch=1, group_by_length=False, pad_last=True)[0]
    assert three.epoch == 1


def test_a_stream_state_without_rows_still_loads():
    # checkpoints written before the position was counted in rows hold (epoch, index of the batch)
    stream = BatchStream(list(range(10)), 2, seed=0)
    ahead = stream.peek(4)
    again = BatchStream(list(range(10)), 2, seed=0)
    again.load_state_dict({"epoch": 0, "index": 2})
    assert again.next() == ahead[2]


def test_prefetcher_collates_ahead_on_one_thread_and_equals_collate():
    import threading
    import time

    calls, running, overlaps = [], [], []

    def collate(indices):
        if running:
            overlaps.append(tuple(indices))
        running.append(1)
        time.sleep(0.01)
        calls.append((tuple(indices), threading.current_thread().name))
        running.pop()
        if indices == [9]:
            raise DataError(["row 9: bad image"])
        return sum(indices)

    prefetch = Prefetcher(collate)
    prefetch.submit([[1, 2], [3]])
    prefetch.submit([[3], [4, 5]])  # a batch already queued is not queued twice
    assert [prefetch.get([1, 2]), prefetch.get([3]), prefetch.get([4, 5])] == [3, 3, 9]
    assert [c for c, _ in calls] == [(1, 2), (3,), (4, 5)] and all(t.startswith("mmprm-collate") for _, t in calls)
    prefetch.submit([[6], [7]])
    assert prefetch.get([7]) == 7  # out of order: the queue is waited for and dropped, then collated here
    assert calls[-1] == ((7,), threading.current_thread().name) and not overlaps
    prefetch.submit([[9]])
    prefetch.wait()  # the error stays with its batch
    with pytest.raises(DataError, match="row 9"):
        prefetch.get([9])
    prefetch.close()
    off = Prefetcher(collate, enabled=False)
    off.submit([[8]])
    assert off.get([8]) == 8 and calls[-1][1] == threading.current_thread().name
