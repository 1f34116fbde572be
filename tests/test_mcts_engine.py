"""Annotation engine: batching across problems, statuses, problem files, resume after kill -9,
merge, and the HF backend on a tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image
from real_data import DATA, full_or_subset

from mmprm.annotate.engine import (
    AnnotationEngine,
    AnnotationOutage,
    Problem,
    RankBusyError,
    TreeFile,
    cli_merge_annotations,
    iter_records,
    merge_annotations,
    problem_fingerprint,
    resolve_rank_world,
    shard,
    tree_file_name,
)
from mmprm.annotate.omega import OmegaConfig
from mmprm.annotate.simulated import GOLD, SimProblem, SimulatedPolicy, random_problems
from mmprm.chat import EndpointUnavailable
from mmprm.data.problems import load_problems
from mmprm.data.schema import DataError, ImageReadError
from mmprm.generation.base import RolloutInputError, RolloutRequest, SamplingConfig, probe_seed

REPO = Path(__file__).resolve().parents[1]


def exact(pred, gold, choices=None):
    return pred == gold


def run_engine(problems: dict, concurrency: int = 8, **kw):
    step_mode = kw.pop("step_mode", "tags")
    policy = SimulatedPolicy(problems, seed=0, step_mode=step_mode, unparsable=kw.pop("unparsable", ()))
    engine = AnnotationEngine(
        policy,
        OmegaConfig(max_rollouts=kw.pop("max_rollouts", 200)),
        kw.pop("verify", exact),
        step_mode=step_mode,
        concurrency=concurrency,
        continuous=kw.pop("continuous", False),
    )
    records: list[dict] = []
    stats = engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    return records, stats, policy


def timeless(records: list[dict]) -> dict[str, dict]:
    """Records by id without their wall-clock seconds."""
    return {r["id"]: {k: v for k, v in r.items() if k != "seconds"} for r in records}


@pytest.mark.parametrize("concurrency", [1, 5])
def test_continuous_submission_writes_the_records_of_rounds(concurrency):
    problems = random_problems(12, seed=3)
    rounds, round_stats, _ = run_engine(problems, concurrency=concurrency)
    continuous, stats, policy = run_engine(problems, concurrency=concurrency, continuous=True)
    # Probes are seeded by problem and place in the search, not by call: the same rollouts
    # however they are batched, so the same records (in another finishing order).
    assert timeless(continuous) == timeless(rounds)
    assert timeless(rounds) == timeless(run_engine(problems, concurrency=12)[0])
    assert stats.rollouts == round_stats.rollouts == policy.stats.sequences
    assert stats.backend_calls == len(stats.sequences_per_call) == policy.stats.calls
    assert policy._pending == []
    if concurrency > 1:
        assert [r["id"] for r in continuous] != [r["id"] for r in rounds]


def test_probe_seeds_follow_the_problem_and_the_rollouts_drawn_before():
    # A probe of n samples uses offsets seed .. seed + n - 1; the next probe starts after them.
    assert probe_seed("p1", 16) - probe_seed("p1", 0) == 16
    assert probe_seed("p1", 0) == probe_seed("p1", 0) != probe_seed("p2", 0)
    assert 0 <= probe_seed("p1", 0) < 2**56  # with a worker's base seed, far below torch's 2**64


def test_continuous_submission_keeps_every_slot_busy():
    """A finished probe's search sends its next one at once and a finished problem's slot goes
    to the next problem, so until the queue runs dry every poll has `concurrency` probes out."""
    problems = random_problems(12, seed=3)
    policy = SimulatedPolicy(problems)
    out_at_poll: list[int] = []
    poll = policy.poll

    def counting():
        out_at_poll.append(len(policy._pending))
        return poll()

    policy.poll = counting
    records: list[dict] = []
    engine = AnnotationEngine(policy, OmegaConfig(max_rollouts=200), exact, concurrency=4, continuous=True)
    engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    assert len(records) == 12 and max(out_at_poll) == 4
    first_short = next(i for i, n in enumerate(out_at_poll) if n < 4)
    assert first_short > len(out_at_poll) // 2  # full for most of the run, draining at the end only


def test_continuous_needs_a_backend_that_takes_requests_one_by_one():
    class RoundsOnly:
        def generate(self, requests):
            return []

    with pytest.raises(ValueError, match="engine.continuous=true needs .*set engine.continuous=false"):
        AnnotationEngine(RoundsOnly(), OmegaConfig(), exact, continuous=True)


def test_many_problems_in_flight_share_each_backend_call():
    problems = random_problems(16, seed=2)  # seed 1 has a problem whose 16 root rollouts all fail
    records, stats, policy = run_engine(problems, concurrency=16)
    assert sorted(r["id"] for r in records) == sorted(problems)
    assert all(r["status"] == "annotated" for r in records)
    # 16 problems x k=16: the first call alone carries 256 sequences, and batches stay large.
    assert stats.sequences_per_call[0] == 256
    assert stats.summary()["mean_sequences_per_call"] > 80
    _, stats1, _ = run_engine(problems, concurrency=1)
    assert max(stats1.sequences_per_call) == 16 and stats1.backend_calls > 5 * stats.backend_calls
    assert stats.rollouts == sum(r["stats"]["rollouts"] for r in records) == policy.stats.sequences


@pytest.mark.parametrize("step_mode", ["tags", "blank_lines"])
def test_statuses_in_both_step_modes_and_no_steps_count(step_mode):
    problems = {
        "easy": SimProblem([0.0] * 4),
        "hard": SimProblem([1.0] * 4),
        "mid": SimProblem([0.2] * 8),
        "prose": SimProblem([0.2] * 8),
    }
    records, stats, _ = run_engine(problems, step_mode=step_mode, unparsable=["prose"])
    status = {r["id"]: r["status"] for r in records}
    # Tag mode finds no step in prose; blank-line mode reads the paragraph as one step but no
    # rollout ever reaches an answer, which says nothing about the steps: no_answer, not all wrong.
    prose = "no_steps" if step_mode == "tags" else "no_answer"
    assert status == {"easy": "screened_all_correct", "hard": "screened_all_wrong", "mid": "annotated", "prose": prose}
    assert sum(stats.by_status.values()) == 4 and stats.by_status.get("no_steps", 0) == (step_mode == "tags")
    mid = next(r for r in records if r["id"] == "mid")
    # blank-line steps carry the \\boxed answer in the last paragraph; the verifier read it
    assert mid["first_errors"] and mid["stats"]["unparsed_rollouts"] == 0


def test_rule_verifier_is_the_default():
    records, _, _ = run_engine({"mid": SimProblem([0.2] * 6)}, verify=None)
    assert records[0]["status"] == "annotated" and records[0]["nodes"][0]["mc"] not in (0.0, 1.0)


class _BadImageBackend(SimulatedPolicy):
    def generate(self, requests):
        for i, r in enumerate(requests):
            if r.problem_id == "broken":
                raise RolloutInputError(i, f"problem {r.problem_id}: image unreadable")
        return super().generate(requests)


@pytest.mark.parametrize("continuous", [False, True])
def test_a_bad_problem_gets_an_error_record_and_the_rest_go_on(continuous):
    problems = {**random_problems(3, seed=2), "broken": SimProblem([0.2] * 5), "boom": SimProblem([0.2] * 5)}
    policy = _BadImageBackend(problems)

    def verify(pred, gold, choices=None):
        if pred == GOLD and verify.calls_for_boom:
            raise RuntimeError("verifier crashed")
        return pred == gold

    verify.calls_for_boom = False
    records = []
    engine = AnnotationEngine(policy, OmegaConfig(max_rollouts=100), verify, concurrency=8, continuous=continuous)
    engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == set(problems) and len(records) == len(problems)
    assert by_id["broken"]["status"] == "error" and "image unreadable" in by_id["broken"]["message"]
    assert all(by_id[p]["status"] == "annotated" for p in problems if p != "broken")

    verify.calls_for_boom = True
    records = []
    AnnotationEngine(SimulatedPolicy({"boom": problems["boom"]}), OmegaConfig(), verify, continuous=continuous).run(
        [Problem("boom", "q", GOLD)], records.append
    )
    assert records[0]["status"] == "error" and records[0]["message"] == "RuntimeError: verifier crashed"


# -- problems files ----------------------------------------------------------------------------


def test_load_problems_names_file_line_id_and_field(tmp_path):
    Image.new("RGB", (2, 2)).save(tmp_path / "a.png")  # the loader opens every image
    rows = [
        {"id": "ok", "images": ["a.png"], "question": "<image1> Sum?", "answer": "3", "choices": ["1", "3"]},
        {"id": "noans", "images": [], "question": "Sum?"},
        {"id": "noimg", "images": ["missing.png"], "question": "Q", "answer": "1"},
        {"id": "ph", "images": [], "question": "<image1> and <image2>?", "answer": "1"},
        {"id": "ok", "images": [], "question": "dup", "answer": "1"},
    ]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    with pytest.raises(DataError) as err:
        load_problems(path)
    text = "\n".join(err.value.problems)
    assert f"{path}:2: id=noans: answer: missing" in text
    assert f"{path}:3: id=noimg: images[0]: image not found" in text
    assert f"{path}:4: id=ph: images: question has 2 image placeholder(s) but 0 image(s)" in text
    assert f"{path}:5: id=ok: id: duplicated (first on line 1" in text
    assert f"{path}:6: id=?: line: invalid JSON" in text
    path.write_text(json.dumps(rows[0]) + "\n")
    (p,) = load_problems(path)
    assert p.images == [str((tmp_path / "a.png").resolve())] and p.choices == ["1", "3"] and p.answer == "3"


def test_mathv_problems_load_with_their_images(tmp_path):
    from mmprm.data.mathv import read_mathv

    rows = read_mathv(DATA / "mathv")
    # MATH-V as it comes: several placeholders for one composite image are caught row by row
    raw = [json.loads(line) for line in (DATA / "mathv" / "testmini.jsonl").read_text().splitlines()]
    path = tmp_path / "raw.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": r["id"],
                    "images": [str(DATA / "mathv" / r["image"])],
                    "question": r["question"],
                    "answer": r["answer"],
                }
            )
            + "\n"
            for r in raw
        )
    )
    with pytest.raises(DataError) as err:
        load_problems(path)
    assert err.value.problems and all("image placeholder" in line for line in err.value.problems)
    # ... and the MATH-V reader's rows are a valid problems file as they are
    path = tmp_path / "mathv_problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_problems(path)
    assert len(problems) == full_or_subset(full=304, subset=37) and all(Path(p.images[0]).is_file() for p in problems)
    assert sum(p.choices is not None for p in problems) > 0


# -- ranks, tree files, merge, kill -9 ------------------------------------------------------------


def test_rank_world_from_launchers_and_deterministic_shards(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert resolve_rank_world() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert resolve_rank_world() == (3, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank_world() == (1, 2)  # torchrun's variables win over SLURM's
    assert resolve_rank_world(0, 1) == (0, 1)  # explicit config wins over both
    with pytest.raises(ValueError, match="rank 4 is not in"):
        resolve_rank_world(4, 4)
    problems = [Problem(str(i), "q", "1") for i in range(10)]
    shares = [shard(problems, r, 3) for r in range(3)]
    assert sorted(p.id for s in shares for p in s) == sorted(p.id for p in problems)
    assert [p.id for p in shares[1]] == ["1", "4", "7"]


def test_torn_last_line_is_cut_and_finished_ids_are_skipped(tmp_path):
    path = tmp_path / tree_file_name(0, 1)
    trees = TreeFile(path)
    trees.append({"id": "a", "status": "annotated", "question": "2+2?", "answer": "4"})
    trees.append({"id": "b", "status": "no_steps"})
    trees.close()
    with open(path, "a") as f:
        f.write('{"id": "c", "status": "annot')  # what a kill -9 mid-write leaves
    other = tmp_path / tree_file_name(1, 2)
    other.write_text('{"id": "z", "status": "error", "message": "x", "error_kind": "permanent"}\n{"id": "y", "sta')
    trees = TreeFile(path, scan_dir=tmp_path)
    assert set(trees.done) == {"a", "b", "z"}
    # what each tree was made from, for a resumed run to compare with its problems file
    assert trees.done["a"] == problem_fingerprint("2+2?", "4", None) != problem_fingerprint("2+2?", "5", None)
    assert path.read_text().endswith('"no_steps"}\n')  # own torn tail cut off
    assert other.read_text().endswith('"y", "sta')  # another rank's file is never touched
    with pytest.raises(ValueError, match="already has a record"):
        trees.append({"id": "a", "status": "annotated"})
    trees.append({"id": "c", "status": "annotated"})
    trees.close()
    summary = merge_annotations(tmp_path)
    merged = [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()]
    assert [r["id"] for r in merged] == ["a", "b", "c", "z"] and summary["by_status"]["annotated"] == 2
    # the same reader as every append-only file (mmprm.data.store.scan): damage before the last
    # line is named; an unparsable last line is torn, even with its newline
    other.write_text('{"id": "z", "status": "annotated"}\n{"id": "y", "sta\n')
    assert [r["id"] for r in iter_records(other)] == ["z"]
    other.write_text('{"id": "z", "sta\n{"id": "y", "status": "annotated"}\n')
    with pytest.raises(DataError, match=r"rank1-of-2.jsonl:1: id=\?: line: not a JSON row"):
        merge_annotations(tmp_path)


def test_merge_copies_each_chosen_line_as_written(tmp_path):
    """The merge keeps only offsets in memory and copies lines: the chosen record of each id is
    byte-for-byte the line a rank wrote (non-ASCII included), a transient error is superseded by a
    later final record, the first final record wins, and the export streams the merged file."""
    from mmprm.annotate.engine import iter_records
    from mmprm.annotate.export import ExportConfig, export_examples, iter_examples

    err = '{"id": "p1", "status": "error", "message": "timeout", "error_kind": "transient"}\n'
    final = '{"id": "p1", "status": "no_steps", "question": "Wie viele Würfel? ≥ 3"}\n'
    first = '{"id": "p2", "status": "annotated", "question": "q", "nodes": []}\n'
    (tmp_path / tree_file_name(0, 2)).write_text(err + first, encoding="utf-8")
    (tmp_path / tree_file_name(1, 2)).write_text(final + first.replace('"q"', '"later"'), encoding="utf-8")
    summary = merge_annotations(tmp_path)
    assert (tmp_path / "trees.jsonl").read_text(encoding="utf-8") == final + first
    assert summary["duplicates_dropped"] == 2 and summary["retryable_errors"] == 0
    records = list(iter_records(tmp_path / "trees.jsonl"))
    stats: dict = {}
    streamed = list(iter_examples(iter(records), ExportConfig(), stats))
    assert (streamed, stats) == export_examples(records, ExportConfig())


def test_two_ranks_merging_at_once_both_succeed(tmp_path, monkeypatch):
    """Two ranks that finish together both merge: each writes its own temp file, so neither
    truncates the other's nor finds it renamed away. Both hold their rename until both have
    written, which is when one shared temp name fails."""
    import threading

    rows = "".join(json.dumps({"id": str(i), "status": "annotated", "pad": "x" * 200}) + "\n" for i in range(200))
    (tmp_path / tree_file_name(0, 2)).write_text(rows)
    (tmp_path / tree_file_name(1, 2)).write_text(rows.replace('"annotated"', '"no_steps"'))
    both_written = threading.Barrier(2, timeout=30)
    replace = os.replace

    def replace_when_both_wrote(src, dst):
        both_written.wait()
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_when_both_wrote)
    failures = []

    def merge():
        try:
            merge_annotations(tmp_path)
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            failures.append(repr(e))

    ranks = [threading.Thread(target=merge) for _ in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert failures == []
    assert (tmp_path / "trees.jsonl").read_text() == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [tree_file_name(0, 2), tree_file_name(1, 2), "trees.jsonl"]
    )


def test_merge_cli_reports_missing_ids(tmp_path, capsys):
    (tmp_path / tree_file_name(0, 2)).write_text('{"id": "1", "status": "annotated"}\n')
    (tmp_path / tree_file_name(1, 2)).write_text('{"id": "2", "status": "no_steps"}\n{"id": "1", "status": "x"}\n')
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps({"id": i, "question": "q", "answer": "1"}) + "\n" for i in "123"))
    assert cli_merge_annotations([str(tmp_path), "--problems", str(problems)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 2 and out["duplicates_dropped"] == 1 and out["missing"] == 1
    assert cli_merge_annotations([str(tmp_path / "nowhere")]) == 1


WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mmprm.annotate.engine import AnnotationEngine, TreeFile, shard, tree_file_name
    from mmprm.data.problems import load_problems
    from mmprm.annotate.omega import OmegaConfig
    from mmprm.annotate.simulated import SimulatedPolicy, random_problems
    out, delay, rank, world = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    problems = load_problems(sys.argv[5])
    trees = TreeFile(out / tree_file_name(rank, world), scan_dir=out)
    todo = [p for p in shard(problems, rank, world) if p.id not in trees.done]
    policy = SimulatedPolicy(random_problems(len(problems), seed=0), delay_s=delay)
    engine = AnnotationEngine(policy, OmegaConfig(max_rollouts=320), lambda p, g, c: p == g, concurrency=3)
    engine.run(todo, trees.append)
""")


def _problems_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"id": f"sim-{i}", "question": "q", "answer": GOLD}) + "\n" for i in range(n)))
    return path


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("trees.rank*.jsonl")) for line in f.read_text().splitlines()]


def test_kill_9_then_rerun_gives_every_id_exactly_once(tmp_path):
    n = 24
    problems = _problems_file(tmp_path, n)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    straight = tmp_path / "straight"
    subprocess.run([sys.executable, str(worker), str(straight), "0", "0", "1", str(problems)], check=True, env=env)

    killed = tmp_path / "killed"
    killed.mkdir()
    # two ranks, killed at different moments mid-run
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(killed), "0.02", str(r), "2", str(problems)], env=env)
        for r in range(2)
    ]
    deadline = time.time() + 60
    for r, proc in enumerate(procs):
        path = killed / tree_file_name(r, 2)
        while time.time() < deadline and (not path.exists() or path.read_text().count("\n") < 2 + 2 * r):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    partial = _records(killed)
    assert 0 < len(partial) < n, "the kill must land mid-run"
    # the same commands again, to completion
    for r in range(2):
        subprocess.run([sys.executable, str(worker), str(killed), "0", str(r), "2", str(problems)], check=True, env=env)
    ids = [r["id"] for r in _records(killed)]
    assert len(ids) == len(set(ids)) == n
    assert set(ids) == {r["id"] for r in _records(straight)}
    assert merge_annotations(killed)["records"] == n


# -- HF backend on tiny models --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from mmprm.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch) for arch in ("qwen2", "qwen2_vl")}


def test_hf_backend_samples_n_continuations_reproducibly(tiny_dirs, tmp_path):
    from mmprm.generation.hf import HFBackend

    Image.new("RGB", (40, 28), (200, 30, 30)).save(tmp_path / "img.png")
    img = str(tmp_path / "img.png")
    sampling = SamplingConfig(max_new_tokens=6, seed=3)
    backend = HFBackend.from_pretrained(str(tiny_dirs["qwen2_vl"]), sampling, batch_size=5)
    reqs = [
        RolloutRequest("a", "<image1> What is 2 + 3?", [img], ["The bar is 2."], 3),
        RolloutRequest("b", "No image here?", [], [], 4),
    ]
    out = backend.generate(reqs)
    assert [len(o) for o in out] == [3, 4] and all(isinstance(t, str) for o in out for t in o)
    assert backend.stats.sequences == 7 and 7 <= backend.stats.generated_tokens <= 42
    # A random-init model writes no answer tag in 6 tokens: each row that used the whole budget
    # without EOS comes back marked cut at max_new_tokens (and the search never blames it).
    assert any(t.truncated for o in out for t in o)
    again = HFBackend.from_pretrained(str(tiny_dirs["qwen2_vl"]), sampling, batch_size=5).generate(reqs)
    assert again == out
    with pytest.raises(RolloutInputError) as err:
        backend.generate([reqs[1], RolloutRequest("c", "<image1> <image2>", [img], [], 1)])
    assert err.value.index == 1 and "problem c" in str(err.value)
    # A file gone since the problems were checked is the filesystem's doing: an outage, not the problem's error
    with pytest.raises(ImageReadError, match="gone.png: could not read the file"):
        backend.generate([RolloutRequest("d", "Q", [str(tmp_path / "gone.png")], [], 1)])
    text_only = HFBackend.from_pretrained(str(tiny_dirs["qwen2"]), sampling)
    with pytest.raises(RolloutInputError, match="text-only"):
        text_only.generate([RolloutRequest("e", "Q", [img], [], 1)])


def test_inverse_cdf_sampler_draws_the_warped_distribution():
    """The sampler's frequencies are softmax(logits / T), cut by top-k and top-p as generate cuts them."""
    import torch

    from mmprm.generation.hf import InverseCDFSampler

    torch.manual_seed(0)
    rows = 40_000
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0]))  # the last token is impossible

    def frequencies(sampler: InverseCDFSampler) -> torch.Tensor:
        out = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.repeat(rows, 1))
        assert ((out == 0).sum(dim=-1) == 1).all() and torch.isinf(out).sum() == rows * 5  # one token per row
        return torch.bincount(out.argmax(dim=-1), minlength=6).float() / rows

    def close(got, want):  # 4 binomial standard errors
        return torch.all((got - want).abs() <= 4 * (want * (1 - want) / rows).sqrt() + 1e-9)

    assert close(frequencies(InverseCDFSampler(1.0, 0, 1.0)), torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0]))
    # T = 2 takes square roots: 0.5**0.5 = 0.7071 ... over their sum 1.9663
    sq = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0]).sqrt()
    assert close(frequencies(InverseCDFSampler(2.0, 0, 1.0)), sq / sq.sum())
    # top-k 2: 0.5 and 0.2 renormalised: 5/7, 2/7
    assert close(frequencies(InverseCDFSampler(1.0, 2, 1.0)), torch.tensor([5 / 7, 2 / 7, 0, 0, 0, 0]))
    # top-p 0.8: the smallest set reaching 0.8 is 0.5 + 0.2 + 0.15 = 0.85: 10/17, 4/17, 3/17
    assert close(frequencies(InverseCDFSampler(1.0, 0, 0.8)), torch.tensor([10, 4, 3, 0, 0, 0]) / 17)


def test_inverse_cdf_sampler_takes_each_rows_own_temperature():
    """A (rows, 1) temperature tensor samples row i as the one-value sampler at T_i would."""
    import torch

    from mmprm.generation.hf import InverseCDFSampler

    torch.manual_seed(0)
    rows = 20_000
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = torch.log(probs).repeat(2 * rows, 1)
    temps = torch.tensor([0.5] * rows + [2.0] * rows).unsqueeze(1)
    drawn = InverseCDFSampler(temps, 0, 0.9)(torch.zeros(2 * rows, 1, dtype=torch.long), logits).argmax(dim=-1)

    def expected(t: float) -> torch.Tensor:  # softmax(log p / T), then top-p 0.9 renormalised
        w = probs ** (1 / t)
        w = w / w.sum()
        keep = (w.cumsum(0) - w) < 0.9
        return torch.where(keep, w, 0) / w[keep].sum()

    for half, t in ((drawn[:rows], 0.5), (drawn[rows:], 2.0)):
        got = torch.bincount(half, minlength=5).float() / rows
        want = expected(t)
        assert torch.all((got - want).abs() <= 4 * (want * (1 - want) / rows).sqrt() + 1e-9), (t, got, want)
    # T = 0.5 squares the odds: p ** 2 = 0.25, 0.04, ... -> the top token 0.25 / 0.3175 = 0.787 of draws
    assert abs((drawn[:rows] == 0).float().mean().item() - 0.787) < 0.02


def test_repetition_penalty_by_hand():
    """A seen token's logit: positive / penalty, negative x penalty; a row's left padding is not seen."""
    import torch

    from mmprm.generation.hf import InverseCDFSampler, penalize_repeats

    pad = 0
    ids = torch.tensor([[pad, pad, 2, 3], [1, 2, 2, pad]])  # row 1 ends with the pad id: a real token
    scores = torch.tensor([[0.5, 1.0, 2.0, -1.0], [0.5, 1.0, 2.0, -1.0]])
    # row 0 saw 2, 3: 2.0 / 2 = 1.0, -1.0 x 2 = -2.0; token 0 (its padding) keeps 0.5
    # row 1 saw 1, 2, 0: 0.5 / 2 = 0.25, 1.0 / 2 = 0.5, 2.0 / 2 = 1.0; token 3 keeps -1.0
    assert penalize_repeats(ids, scores, 2.0, pad).tolist() == [[0.5, 1.0, 1.0, -2.0], [0.25, 0.5, 1.0, -1.0]]
    assert penalize_repeats(ids, scores, 2.0, None).tolist()[0] == [0.25, 1.0, 1.0, -2.0]  # no pad id: all seen
    # Greedy (top_k 1) after the penalty: token 2 (2.0) wins alone, and loses to token 1 (1.5) at 2.0 / 2
    logits = torch.tensor([[0.5, 1.5, 2.0, -1.0]])
    seen = torch.tensor([[pad, 2]])
    assert InverseCDFSampler(1.0, 1, 1.0)(seen, logits).argmax().item() == 2
    assert InverseCDFSampler(1.0, 1, 1.0, repetition_penalty=2.0, pad_id=pad)(seen, logits).argmax().item() == 1


def test_hf_backend_passes_its_repetition_penalty_and_pad_id(tiny_dirs, monkeypatch):
    from mmprm.generation import hf

    made = []

    class Recording(hf.InverseCDFSampler):
        def __init__(self, *args):
            made.append(args)
            super().__init__(*args)

    monkeypatch.setattr(hf, "InverseCDFSampler", Recording)
    sampling = SamplingConfig(repetition_penalty=1.05, max_new_tokens=2, seed=0)
    backend = hf.HFBackend.from_pretrained(str(tiny_dirs["qwen2"]), sampling)
    backend.generate([RolloutRequest("a", "What is 2 + 2?", [], [], 2)])
    assert made and all(args[3:] == (1.05, backend.tokenizer.pad_token_id) for args in made)
    with pytest.raises(ValueError, match="sampling.repetition_penalty must be > 0"):
        SamplingConfig(repetition_penalty=0.0).validate()


class _TemperatureLog(SimulatedPolicy):
    """Records (prefix length, temperature) of every request it answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, float | None]] = []

    def generate(self, requests):
        self.seen.extend((len(r.prefix_steps), r.temperature) for r in requests)
        return super().generate(requests)


@pytest.mark.parametrize("prefix_temperature", [None, 0.5])
def test_prefix_probes_sample_at_the_prefix_temperature_and_the_root_at_the_backends(prefix_temperature):
    policy = _TemperatureLog(random_problems(6, seed=2), seed=0)
    engine = AnnotationEngine(
        policy, OmegaConfig(max_rollouts=200), exact, concurrency=6, prefix_temperature=prefix_temperature
    )
    records = []
    engine.run([Problem(pid, "q", GOLD) for pid in policy.problems], records.append)
    assert any(r["status"] == "annotated" for r in records)
    roots = {t for depth, t in policy.seen if depth == 0}
    probes = {t for depth, t in policy.seen if depth > 0}
    assert roots == {None} and probes == {prefix_temperature}


def test_hf_backend_samples_each_request_at_its_own_temperature(tiny_dirs):
    """Rows at a near-zero temperature are the greedy text; rows at T = 1 in the same call vary."""
    from mmprm.generation.hf import HFBackend

    backend = HFBackend.from_pretrained(
        str(tiny_dirs["qwen2"]), SamplingConfig(max_new_tokens=8, top_k=0, top_p=1.0, seed=5), batch_size=16
    )
    cold, hot = (
        RolloutRequest("a", "What is 2 + 3?", [], ["It is"], 6, temperature=1e-4),
        RolloutRequest("b", "What is 2 + 3?", [], ["It is"], 6),
    )
    out_cold, out_hot = backend.generate([cold, hot])
    assert len(set(out_cold)) == 1 and len(set(out_hot)) > 1
    (alone,) = backend.generate([RolloutRequest("a", "What is 2 + 3?", [], ["It is"], 1, temperature=1e-4)])
    assert alone == out_cold[:1]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"])
def test_hf_backend_prefills_a_prompt_once_and_samples_its_rows_as_if_apart(tiny_models, tmp_path, arch):
    """A request's n rows run one prefill row (its image encoded once), yet sample bitwise what the
    same prompt sent as n one-row requests samples, each prefilled on its own. Chunks of 5 rows split
    the second request across two `generate` calls; the first request's rows are padded."""
    from mmprm.generation.hf import HFBackend
    from mmprm.models.loading import load_backbone

    model, processor = load_backbone(tiny_models(arch))
    prefill_rows = []

    def record(_module, _args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # the prompt, not one decoded token
            prefill_rows.append(kwargs["input_ids"].shape[0])

    model.register_forward_pre_hook(record, with_kwargs=True)
    images = []
    if arch != "qwen2":
        Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "tile.png")
        images = [str(tmp_path / "tile.png")]
    deep = RolloutRequest("p0", "Add the tiles.", images, ["2 + 3 = 5."], 3)
    root = RolloutRequest("p1", "Add the tiles.", images, [], 4)

    def sample(requests):
        backend = HFBackend(model, processor, SamplingConfig(max_new_tokens=16, seed=3), batch_size=5)
        return [text for texts in backend.generate(requests) for text in texts]

    shared = sample([deep, root])
    assert prefill_rows == [2, 1]  # [p0 x3, p1 x2], then [p1 x2]
    prefill_rows.clear()
    apart = sample([replace(deep, n=1)] * 3 + [replace(root, n=1)] * 4)
    assert prefill_rows == [5, 2]
    assert shared == apart and len(set(shared)) > 1


def test_hf_backend_continues_the_assistant_message(tiny_dirs):
    from mmprm.generation.base import rollout_prompt
    from mmprm.models.loading import load_processor

    proc = load_processor(tiny_dirs["qwen2"])
    text = rollout_prompt(proc, "What is 2 + 3?", 0, ["Two plus three.", "It is 5."])
    # the steps are the start of the assistant turn, not restated in a user turn
    assert text.endswith("<|im_start|>assistant\n<step>Two plus three.</step>\n<step>It is 5.</step>\n")
    assert text.count("<|im_start|>user") == 1 and "Two plus" not in text.split("<|im_start|>assistant")[0]
    blank = rollout_prompt(proc, "What is 2 + 3?", 0, ["Two plus three."], step_mode="blank_lines")
    assert blank.endswith("<|im_start|>assistant\nTwo plus three.\n\n")


def test_engine_over_hf_backend_with_a_random_model_reports_no_steps(tiny_dirs):
    """A random-init model writes no step tags: every problem says so instead of vanishing."""
    from mmprm.generation.hf import HFBackend

    backend = HFBackend.from_pretrained(str(tiny_dirs["qwen2"]), SamplingConfig(max_new_tokens=8), batch_size=32)
    records = []
    stats = AnnotationEngine(backend, OmegaConfig(rollouts_per_estimate=4, max_rollouts=16), concurrency=4).run(
        [Problem(f"p{i}", "What is 2 + 3?", "5") for i in range(5)], records.append
    )
    assert sorted(r["id"] for r in records) == [f"p{i}" for i in range(5)]
    assert stats.by_status == {"no_steps": 5} and stats.sequences_per_call[0] == 16
    assert all(r["stats"]["unparsed_rollouts"] == 4 for r in records)


# -- LLM judge over an OpenAI-compatible endpoint (a real local HTTP server) -----------------------


def test_llm_judge_is_asked_only_when_rules_say_no(monkeypatch, tmp_path):
    from chat_server import ChatServer, free_port_url

    from mmprm.annotate.judge import LLMJudge, judged_verifier
    from mmprm.chat import ChatClient, ChatConfig, ChatError, EndpointUnavailable

    def script(body):
        prompt = body["messages"][0]["content"]
        if "Model's answer: chatty" in prompt:
            return "Well, it depends."
        return "Yes" if "Model's answer: two thirds" in prompt and "Reference answer: 2/3" in prompt else "No."

    with ChatServer(script) as server:
        monkeypatch.setenv("MY_JUDGE_KEY", "sekrit")
        cfg = ChatConfig(url=server.url, model="judge-model", api_key_env="MY_JUDGE_KEY", backoff_s=0)
        judge = LLMJudge(ChatClient(cfg, config_key="verify.judge_chat"))
        verify = judged_verifier(judge)
        assert verify("2/3", "2/3") and judge.calls == 0  # the rules decide: no HTTP call
        assert verify("two thirds", "2/3") and judge.calls == 1
        assert not verify("0.7", "2/3") and judge.calls == 2
        assert not verify(None, "2/3") and judge.calls == 2
        assert server.paths[0] == "/v1/chat/completions" and server.requests[0]["model"] == "judge-model"
        assert server.headers[0]["authorization"] == "Bearer sekrit"
        with pytest.raises(ChatError, match="instead of Yes/No"):
            verify("chatty", "2/3")
        assert len(server.requests) == 2 + 3  # a reply that is not yes/no is asked twice more
    dead = LLMJudge(
        ChatClient(
            ChatConfig(url=free_port_url(), model="m", max_retries=1, backoff_s=0), config_key="verify.judge_chat"
        )
    )
    with pytest.raises(EndpointUnavailable, match="failed 2 times.*verify.judge_chat.url"):
        dead("x", "y")


class _CutBackend(SimulatedPolicy):
    """Marks every wrong blank-line rollout as cut at max_new_tokens (its \\boxed answer is then a
    half-written guess the policy might have revised)."""

    def generate(self, requests):
        from mmprm.generation.base import Completion

        return [[Completion(t, truncated="boxed{-1}" in t) for t in texts] for texts in super().generate(requests)]


def test_rollouts_cut_at_max_new_tokens_are_counted_truncated_and_never_searched():
    problems = {"cut": SimProblem([0.2] * 6)}
    records = []
    AnnotationEngine(
        _CutBackend(problems, step_mode="blank_lines"), OmegaConfig(max_rollouts=100), exact, step_mode="blank_lines"
    ).run([Problem("cut", "q", GOLD)], records.append)
    (rec,) = records
    assert rec["status"] == "annotated" and rec["stats"]["truncated_rollouts"] > 0
    assert rec["first_errors"] == [] and all(n["mc"] > 0 for n in rec["nodes"])


# -- transient errors, outages, and one worker per rank file -----------------------------------------


@pytest.mark.parametrize("continuous", [False, True])
def test_transient_errors_are_retried_on_resume_and_permanent_ones_are_final(tmp_path, continuous):
    problems = {**random_problems(2, seed=2), "broken": SimProblem([0.2] * 5), "flaky": SimProblem([0.2] * 5)}
    policy = _BadImageBackend(problems)  # "broken": unreadable image, a permanent input error
    flaky = {"down": True}

    def verify(pred, gold, choices=None):
        if flaky["down"] and verify.problem == "flaky":
            raise EndpointUnavailable("judge at http://judge/v1 failed 3 times: URLError: connection refused")
        return pred == gold

    class Engine(AnnotationEngine):  # tell the verifier which problem asks (a judge sees the question)
        def _rollout(self, item, text):
            verify.problem = item.problem.id
            return super()._rollout(item, text)

    out = tmp_path / "run"
    trees = TreeFile(out / tree_file_name(0, 1), scan_dir=out)
    Engine(policy, OmegaConfig(max_rollouts=100), verify, concurrency=8, continuous=continuous).run(
        [Problem(pid, "q", GOLD) for pid in problems], trees.append
    )
    trees.close()
    by_id = {r["id"]: r for r in _records(out)}
    assert by_id["flaky"]["status"] == "error" and by_id["flaky"]["error_kind"] == "transient"
    assert by_id["broken"]["status"] == "error" and by_id["broken"]["error_kind"] == "permanent"
    # Before: every error record counted as done, so the judge outage cost "flaky" for good.
    trees = TreeFile(out / tree_file_name(0, 1), scan_dir=out)
    assert "flaky" not in trees.done and "broken" in trees.done
    flaky["down"] = False
    todo = [Problem(pid, "q", GOLD) for pid in problems if pid not in trees.done]
    assert [p.id for p in todo] == ["flaky"]
    Engine(policy, OmegaConfig(max_rollouts=100), verify, continuous=continuous).run(todo, trees.append)
    trees.close()
    summary = merge_annotations(out)
    merged = {r["id"]: r for r in (json.loads(x) for x in (out / "trees.jsonl").read_text().splitlines())}
    assert summary["records"] == 4 and merged["flaky"]["status"] == "annotated"
    assert summary["by_status"] == {"annotated": 3, "error": 1} and summary["retryable_errors"] == 0


@pytest.mark.parametrize("continuous", [False, True])
def test_an_outage_stops_the_run_instead_of_emptying_it(continuous):
    problems = random_problems(40, seed=4)

    def judge_down(pred, gold, choices=None):
        raise EndpointUnavailable("judge at http://judge/v1 failed 3 times: URLError: connection refused")

    records = []
    policy = SimulatedPolicy(problems)
    engine = AnnotationEngine(
        policy,
        OmegaConfig(max_rollouts=100),
        judge_down,
        concurrency=8,
        max_consecutive_failures=5,
        continuous=continuous,
    )
    with pytest.raises(
        AnnotationOutage, match=r"5 problems in a row failed .*EndpointUnavailable.*rerun the same command"
    ):
        engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    assert len(records) == 5 and all(r["error_kind"] == "transient" for r in records)
    assert policy._pending == []  # the probes still out were dropped, not left in the engine


def test_a_request_that_never_finishes_times_out_as_its_problems_transient_error():
    """A continuous backend that never reports one request finished: the run ends, that problem
    gets a transient error record (retried on resume), its request is aborted, the rest annotate."""
    problems = random_problems(6, seed=5)
    stuck = sorted(problems)[2]
    policy = SimulatedPolicy(problems, stuck=[stuck])
    # a timeout well above one scheduler hiccup: on a loaded machine the others' requests must not time out
    engine = AnnotationEngine(
        policy, OmegaConfig(max_rollouts=100), exact, concurrency=3, continuous=True, request_timeout_s=2.0
    )
    records: list[dict] = []
    t0 = time.perf_counter()
    engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    assert time.perf_counter() - t0 < 30
    by_id = {r["id"]: r for r in records}
    assert sorted(by_id) == sorted(problems) and by_id[stuck]["error_kind"] == "transient"
    assert by_id[stuck]["message"].startswith("RequestTimeout: the backend did not finish this problem's request")
    assert "engine.request_timeout_s=2s" in by_id[stuck]["message"]
    assert all(r["status"] != "error" for pid, r in by_id.items() if pid != stuck)
    assert policy._pending == []  # aborted, not left in the engine
    with pytest.raises(ValueError, match="engine.request_timeout_s must be > 0 seconds"):
        AnnotationEngine(policy, OmegaConfig(), exact, continuous=True, request_timeout_s=0)


def test_requests_that_never_finish_stop_the_run_as_an_outage():
    """Every request lost (a hung engine): the timeouts are transient errors in a row, an outage."""
    problems = random_problems(8, seed=6)
    policy = SimulatedPolicy(problems, stuck=list(problems))
    engine = AnnotationEngine(
        policy,
        OmegaConfig(max_rollouts=100),
        exact,
        concurrency=4,
        max_consecutive_failures=3,
        continuous=True,
        request_timeout_s=0.1,
    )
    records: list[dict] = []
    with pytest.raises(AnnotationOutage, match=r"3 problems in a row failed .*RequestTimeout"):
        engine.run([Problem(pid, "q", GOLD) for pid in problems], records.append)
    assert len(records) == 3 and policy._pending == []


class _DeadBackend(SimulatedPolicy):
    def generate(self, requests):
        raise ConnectionError("engine process died")


@pytest.mark.parametrize("continuous", [False, True])
def test_a_failing_backend_call_is_an_outage_not_error_records(continuous):
    records = []
    with pytest.raises(AnnotationOutage, match="backend call failed: ConnectionError: engine process died"):
        AnnotationEngine(
            _DeadBackend(random_problems(3)), OmegaConfig(max_rollouts=100), exact, continuous=continuous
        ).run([Problem(pid, "q", GOLD) for pid in random_problems(3)], records.append)
    assert records == []


HOLDER = textwrap.dedent("""
    import sys, time
    from mmprm.annotate.engine import TreeFile
    trees = TreeFile(sys.argv[1])
    print("holding", flush=True)
    time.sleep(120)
""")


def test_a_second_worker_on_a_held_rank_file_stops_naming_the_holder(tmp_path):
    import socket

    path = tmp_path / tree_file_name(0, 1)
    first = TreeFile(path)
    with pytest.raises(RankBusyError, match=rf"pid {os.getpid()} on {socket.gethostname()}, started 20"):
        TreeFile(path)
    first.close()
    TreeFile(path).close()  # released on close
    # ... and when the holder dies without closing (kill -9): the OS drops the lock with the process.
    holder = tmp_path / "holder.py"
    holder.write_text(HOLDER)
    proc = subprocess.Popen(
        [sys.executable, str(holder), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "holding"
        with pytest.raises(RankBusyError, match=f"pid {proc.pid} "):
            TreeFile(path)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    TreeFile(path).close()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    import errno

    from mmprm.annotate import engine

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(engine.fcntl, "flock", no_locks)
    path = tmp_path / tree_file_name(0, 1)
    trees = TreeFile(path)
    trees.append({"id": "a", "status": "no_steps"})
    trees.close()
    err = capsys.readouterr().err
    assert f"the filesystem of {tmp_path} does not support file locks" in err and "start only one" in err
    assert [r["id"] for r in iter_records(path)] == ["a"]

    def broken(fd, op):  # any other error is still an error
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(engine.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output error"):
        TreeFile(path)


def test_load_image_retries_reads_and_never_retries_decoding(tmp_path, monkeypatch):
    import errno

    from mmprm.data import schema

    good = tmp_path / "good.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(good)
    real_read = Path.read_bytes
    failures = {"left": 2, "calls": 0}

    def flaky_read(self):
        failures["calls"] += 1
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", flaky_read)
    assert schema.load_image(good, wait=0).getpixel((0, 0)) == (1, 2, 3) and failures["calls"] == 3
    failures.update(left=5, calls=0)
    with pytest.raises(schema.ImageReadError, match=r"good.png: could not read the file \(OSError"):
        schema.load_image(good, wait=0)
    assert failures["calls"] == 3
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    failures.update(left=0, calls=0)
    with pytest.raises(OSError) as e:
        schema.load_image(bad, wait=0)
    assert not isinstance(e.value, schema.ImageReadError) and failures["calls"] == 1


def test_an_image_read_error_is_an_outage_and_a_bad_image_a_permanent_error(tiny_dirs, tmp_path, monkeypatch):
    """A flaky filesystem must not cost a problem for good: the run stops with nothing recorded for
    it, and a rerun annotates it; an image that reads but does not decode is the input's fault."""
    import errno

    from mmprm.data import schema
    from mmprm.generation.hf import HFBackend

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG but nothing after")
    Image.new("RGB", (56, 56), (30, 200, 30)).save(tmp_path / "nfs.png")
    real_read, down = Path.read_bytes, {"nfs": True}

    def read(self):
        if self.name == "nfs.png" and down["nfs"]:
            raise OSError(errno.ESTALE, "Stale file handle", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read)
    monkeypatch.setattr(schema.time, "sleep", lambda s: None)
    backend = HFBackend.from_pretrained(str(tiny_dirs["qwen2_vl"]), SamplingConfig(max_new_tokens=8), batch_size=32)
    cfg = OmegaConfig(rollouts_per_estimate=2, max_rollouts=4)
    q = "<image1> What is 2 + 3?"
    problems = [Problem(name, q, "5", [str(tmp_path / f"{name}.png")]) for name in ("ok", "corrupt", "nfs")]
    records = []
    with pytest.raises(AnnotationOutage, match="ImageReadError: .*nfs.png: could not read the file"):
        AnnotationEngine(backend, cfg, concurrency=1).run(problems, records.append)
    by_id = {r["id"]: r for r in records}
    assert by_id["corrupt"]["status"] == "error" and by_id["corrupt"]["error_kind"] == "permanent"
    assert "nfs" not in by_id and by_id["ok"]["status"] == "no_steps"
    down["nfs"] = False  # the filesystem is back: the rerun does the problem
    AnnotationEngine(backend, cfg, concurrency=1).run([problems[2]], records.append)
    assert records[-1]["id"] == "nfs" and records[-1]["status"] == "no_steps"
