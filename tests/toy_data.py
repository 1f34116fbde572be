"""A learnable toy step-labelled set for recipe tests: arithmetic steps, wrong ones labelled low."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

COLOURS = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48)]


def write_toy_prm_data(
    out_dir: Path, n: int = 32, seed: int = 0, images: bool = True, name: str = "toy.jsonl", soft: bool = True
) -> Path:
    """n examples of 2-3 arithmetic steps; a wrong step and all after it get label 0 (or 0.2 when soft)."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        img_names = []
        if images:
            size = (28 + 14 * (i % 3), 28)
            img = Image.new("RGB", size, COLOURS[i % len(COLOURS)])
            img_names = [f"img_{seed}_{i}.png"]
            img.save(out_dir / img_names[0])
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong_at = rng.choice([None, 0, 1]) if i % 2 else None
        steps, labels, ok = [], [], True
        for k, (x, y) in enumerate([(a, b), (a + b, 1)][:2]):
            res = x + y + (rng.randint(1, 3) if wrong_at == k else 0)
            ok = ok and wrong_at != k
            steps.append(f"{x} + {y} = {res}.")
            labels.append(1.0 if ok else (0.2 if soft else 0.0))
        rows.append(
            {
                "id": f"toy-{seed}-{i}",
                "images": img_names,
                "question": "Add the numbers.",
                "steps": steps,
                "labels": labels,
            }
        )
    path = out_dir / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_uneven_tree_data(out_dir: Path, n: int) -> Path:
    """n toy problems whose trees hold 1 to 4 rows (2, 3, 5 and 7 step tokens per pack), so the
    ranks of a global batch get packs of different sizes."""
    src = write_toy_prm_data(out_dir, n, 0)
    rows = []
    for i, r in enumerate(map(json.loads, src.read_text().splitlines())):
        first = r["steps"][0]
        tree = [
            r,
            {**r, "id": r["id"] + "/prefix", "steps": [first], "labels": r["labels"][:1]},
            {**r, "id": r["id"] + "/branch", "steps": [first, "So it is 7."], "labels": [r["labels"][0], 0.4]},
            {**r, "id": r["id"] + "/other", "steps": [first, "So it is 8."], "labels": [r["labels"][0], 0.6]},
        ]
        rows += tree[: i % 4 + 1]
    train = out_dir / "uneven_tree.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train
