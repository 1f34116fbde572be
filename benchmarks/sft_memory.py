"""Peak memory of one policy-SFT step with chunked LM-head logits against full logits.

    python benchmarks/sft_memory.py            # ~1 min and ~8 GB of RAM on CPU
    python benchmarks/sft_memory.py --quick    # smoke test: 32,000-token vocabulary, 512 tokens, chunks of 128

One SFT step (forward + backward, as `recipes/policy_sft.py` takes it through
`mmprm.training.lm_loss.next_token_loss_sum`) of the demo's tiny Qwen2-VL (hidden 128, 4 layers)
resized to Qwen2-VL's 151,936-token vocabulary, on one row of 4,096 tokens, every position
labelled (the chunked side's worst case). Each side runs in its own process, so the peaks do not
mix: "full" forces one chunk (the old full-logits loss), "chunked" takes the default chunk size
(`CHUNK_LOGITS` logits) or `--chunk`. Memory is the process's peak RSS (CPU torch allocates from
the system), and the step's rise above the RSS just before it (model, inputs and the Python runtime
excluded). Both sides' losses must agree, or the script stops.

Prints ONE JSON line: each side's peak RSS and step rise in MiB, and the ratios chunked / full.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_mib() -> float:
    """Resident set size now (Linux /proc), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def one_step(model_dir: str, tokens: int, chunk: int | None) -> dict:
    """Forward and backward of one row of `tokens` labelled tokens; memory in MiB."""
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.training.lm_loss import next_token_loss_sum

    torch.manual_seed(0)
    model, _ = load_backbone(model_dir)
    model.train()
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (1, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    before = rss_mib()
    loss, n = next_token_loss_sum(model, batch, chunk)
    (loss / n).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_rss_mib": round(peak, 1), "step_rise_mib": round(peak - before, 1), "loss": loss.item() / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk; default: CHUNK_LOGITS / vocab")
    parser.add_argument("--quick", action="store_true", help="smoke test: vocabulary 32,000, 512 tokens, chunks of 128")
    parser.add_argument("--side", choices=["full", "chunked"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.tokens, args.chunk = 32_000, 512, args.chunk or 128
    if args.side:
        chunk = 10**12 if args.side == "full" else args.chunk
        print(json.dumps(one_step(args.model, args.tokens, chunk)))
        return

    from mmprm.models.loading import load_backbone
    from mmprm.models.tiny import build_tiny_model
    from mmprm.training.lm_loss import CHUNK_LOGITS

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model("qwen2_vl", Path(tmp) / "tiny", seed=0, hidden_size=128, num_layers=4)
        model, processor = load_backbone(tiny)
        model.resize_token_embeddings(args.vocab, mean_resizing=False)
        model.save_pretrained(Path(tmp) / "wide")
        processor.save_pretrained(Path(tmp) / "wide")
        del model
        sides = {}
        for side in ("full", "chunked"):
            cmd = [sys.executable, __file__, "--side", side, "--model", str(Path(tmp) / "wide")]
            cmd += ["--vocab", str(args.vocab), "--tokens", str(args.tokens)]
            cmd += ["--chunk", str(args.chunk)] if args.chunk else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            sides[side] = json.loads(out.strip().splitlines()[-1])
    full, chunked = sides["full"], sides["chunked"]
    if abs(full["loss"] - chunked["loss"]) > 1e-4 * max(1.0, abs(full["loss"])):
        sys.exit(f"sft_memory: the losses differ: full {full['loss']}, chunked {chunked['loss']}")
    print(
        json.dumps(
            {
                "vocab": args.vocab,
                "tokens": args.tokens,
                "chunk_tokens": args.chunk or CHUNK_LOGITS // args.vocab,
                "full": full,
                "chunked": chunked,
                "peak_rss_ratio": round(chunked["peak_rss_mib"] / full["peak_rss_mib"], 3),
                "step_rise_ratio": round(chunked["step_rise_mib"] / full["step_rise_mib"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
