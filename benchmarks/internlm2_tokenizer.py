"""InternLM2's tokenizer as `mmprm convert-internvl` rebuilds it, against sentencepiece.

    python benchmarks/internlm2_tokenizer.py --model tokenizer.model [--tokenizer-config FILE]
        [--internvl-code PATH] [--random 3000] [--seed 0]

`--model` is InternLM2's sentencepiece file: the `tokenizer.model` of MM-PRM-8B, VisualPRM-8B or
InternVL2.5-8B, or InternEvo's `tools/tokenizer_internlm2.model` (github.com/InternLM/InternEvo),
the same vocabulary. `--tokenizer-config` is the checkpoint's tokenizer_config.json; without it,
the added tokens InternVL2.5-8B ships (InternLM2's chat tokens renamed in place, InternVL's after
the vocabulary). The texts: the problems and solutions shipped in data/ and `--random` strings of
the model's own pieces and awkward characters (spaces, tabs, NUL, emoji, added tokens).

Each text is encoded by the rebuilt tokenizer and by the slow tokenizer's procedure written out
(the text cut at the added tokens, sentencepiece encoding each stretch, BOS in front); with
`--internvl-code` (a checkout holding InternVL's `internvl` package, e.g. MM-PRM's repository)
also by InternLM2's own remote-code `InternLM2Tokenizer`. Prints one JSON line: the texts, the
mismatches against each, and the speed of the rebuilt tokenizer over the slow one (a ratio).
Needs `sentencepiece` (a dev dependency).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# InternVL2.5-8B's tokenizer_config.json: InternLM2-chat's tokens at the ids of the pieces they
# rename, InternVL's image and grounding tokens after the 92,544 pieces.
CHAT_TOKENS = {
    92538: "<|plugin|>",
    92539: "<|interpreter|>",
    92540: "<|action_end|>",
    92541: "<|action_start|>",
    92542: "<|im_end|>",
    92543: "<|im_start|>",
}
INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]


def default_config() -> dict:
    added = {0: "<unk>", 1: "<s>", 2: "</s>", **CHAT_TOKENS}
    added |= {92544 + i: t for i, t in enumerate(INTERNVL_TOKENS)}
    return {
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in added.items()},
        "add_bos_token": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "InternLM2Tokenizer",
    }


def shipped_texts() -> list[str]:
    texts = [json.loads(line)["question"] for line in (ROOT / "data/mathv/testmini.jsonl").open()]
    for line in (ROOT / "data/gsm8k/example_model_solutions.jsonl").open():
        row = json.loads(line)
        texts += [row["question"], row["ground_truth"]]
    return texts


def random_texts(pieces: list[str], added: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = [*pieces, " ", "  ", "\n", "\t", "\r\n", "\0", "é", "€", "🙂", *added]
    return [
        "".join(rng.choice(pool).replace("▁", rng.choice(" ▁")) for _ in range(rng.randint(1, 30))) for _ in range(n)
    ]


def slow_ids(sp, text: str, added: dict[str, int], bos_id: int) -> list[int]:
    """The slow tokenizer's encoding: cut at added tokens (the longest at a position), sentencepiece
    between, BOS in front."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
    ids, pos = [bos_id], 0
    for match in pattern.finditer(text):
        ids += sp.encode(text[pos : match.start()]) + [added[match.group()]]
        pos = match.end()
    return ids + sp.encode(text[pos:])


def remote_tokenizer(code: Path, model: Path, config: dict):
    """InternLM2's own slow tokenizer from `code`, with the config's added tokens."""
    from transformers import AddedToken

    sys.path.insert(0, str(code))
    from internvl.model.internlm2.tokenization_internlm2 import InternLM2Tokenizer

    decoder = {
        int(i): AddedToken(t["content"], special=t.get("special", True), normalized=False)
        for i, t in config["added_tokens_decoder"].items()
    }
    return InternLM2Tokenizer(vocab_file=str(model), added_tokens_decoder=decoder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokenizer-config", type=Path)
    parser.add_argument("--internvl-code", type=Path)
    parser.add_argument("--random", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import sentencepiece as spm

    from mmprm.models.internvl_convert import sentencepiece_tokenizer
    from mmprm.models.sentencepiece_bpe import read_model

    config = json.loads(args.tokenizer_config.read_text()) if args.tokenizer_config else default_config()
    added = {t["content"]: int(i) for i, t in config["added_tokens_decoder"].items()}
    ours = sentencepiece_tokenizer(args.model, config, {})
    sp = spm.SentencePieceProcessor(model_file=str(args.model))
    # the renamed pieces' old names are left out: sentencepiece gives them the new token's id
    renamed = {int(i) for i in config["added_tokens_decoder"]}
    pieces = [p for i, (p, _, _) in enumerate(read_model(args.model).pieces) if i not in renamed]
    texts = shipped_texts() + random_texts(pieces, list(added), args.random, args.seed)

    start = time.perf_counter()
    our_ids = [ours(t)["input_ids"] for t in texts]
    ours_s = time.perf_counter() - start
    result = {
        "texts": len(texts),
        "chars": sum(map(len, texts)),
        "mismatches_vs_sentencepiece": sum(a != slow_ids(sp, t, added, sp.bos_id()) for a, t in zip(our_ids, texts)),
    }
    if args.internvl_code:
        remote = remote_tokenizer(args.internvl_code, args.model, config)
        start = time.perf_counter()
        remote_ids = [remote(t)["input_ids"] for t in texts]
        remote_s = time.perf_counter() - start
        result["mismatches_vs_internlm2_tokenizer"] = sum(a != b for a, b in zip(our_ids, remote_ids))
        result["speed_vs_internlm2_tokenizer"] = round(remote_s / ours_s, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
