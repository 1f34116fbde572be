"""What prefilling each prompt once saves the HF backend: n rollouts of a prompt, one prefill row.

    python benchmarks/shared_prefill.py            # ~30 s on 2 CPU cores
    python benchmarks/shared_prefill.py --quick    # smoke test

`HFBackend.generate` encodes a request's prompt and runs its prefill (the vision tower and the
prompt's tokens) once, then decodes its n rows (`mmprm.generation.hf.prompt_prefilled_once`).
The baseline is the same prompts sent as n one-row requests: every row encoded and prefilled on its
own, as the backend did before. Both sides sample the same rows from the same seed, so their
rollouts must be equal (checked every round). The model is the demo's (a tiny Qwen2-VL, hidden 128,
4 layers, one thread); 8 prompts of the demo's task x 8 rows, one 64-row `generate` call, at the
demo's image size and at 448 x 448 pixels (256 image tokens, as a real screenshot or chart gives);
new tokens: 1 (the prefill alone), 40 (a search step) and 128 (a whole rollout). The sides alternate
for `--rounds` rounds; each keeps its fastest.

Prints ONE JSON line: seconds of each side and the ratio (apart / once), per setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hf_sampling import demo_model_and_problems  # noqa: E402  (beside this script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="rows (rollouts) per prompt")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 40, 128], help="max new tokens per setting")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 prompts x 2 rows, 4 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.n, args.tokens, args.rounds = 2, 2, [4], 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-shared-prefill-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def measure(args: argparse.Namespace, work: Path) -> dict:
    from dataclasses import replace

    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.hf import HFBackend

    model, processor, problems = demo_model_and_problems(work, args.prompts)
    out = {"benchmark": "shared_prefill", "prompts": args.prompts, "rows_per_prompt": args.n}
    for size in ("demo", "448px"):
        requests = []
        for p in problems:
            image = p.image if size == "demo" else p.image.resize((448, 448))
            path = work / f"{p.id}-{size}.png"
            image.save(path)
            requests.append(RolloutRequest(p.id, p.question, [str(path)], [], args.n))
        apart = [replace(r, n=1) for r in requests for _ in range(args.n)]
        for tokens in args.tokens:
            sampling = SamplingConfig(max_new_tokens=tokens, top_k=0, top_p=1.0, seed=0)
            best = {"once": float("inf"), "apart": float("inf")}
            for _ in range(args.rounds):
                texts = {}
                for side, sent in (("once", requests), ("apart", apart)):
                    backend = HFBackend(model, processor, sampling, batch_size=args.prompts * args.n)
                    start = time.perf_counter()
                    texts[side] = [t for rows in backend.generate(sent) for t in rows]
                    best[side] = min(best[side], time.perf_counter() - start)
                if texts["once"] != texts["apart"]:
                    raise SystemExit(f"{size}, {tokens} tokens: the rollouts differ with the prompt prefilled once")
            out[f"{size}_{tokens}_tokens"] = {
                "seconds": {side: round(s, 4) for side, s in best.items()},
                "ratio": round(best["apart"] / best["once"], 2),
                "rollouts_equal": texts["once"] == texts["apart"],  # every round's (it exits otherwise)
            }
    return out


if __name__ == "__main__":
    main()
