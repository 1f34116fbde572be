"""Colour-tile arithmetic: a synthetic multimodal task a tiny VLM learns in minutes on a CPU.

Each image is a small grid of solid square tiles (default 2x2 cells of 28 px = 56x56 px, which
every tiny preset in `mmprm.models.tiny` takes without resizing). A tile's COLOUR is a digit
through the fixed `PALETTE`; grey tiles are distractors, white cells are empty. Tiles are read
in reading order (left to right, then top to bottom), skipping grey ones. The question says
what to compute but never a digit, so only a model that reads the image can answer::

    image:     [blue][yellow]        question: "Multiply tile 1 by tile 2, then subtract tile 3."
               [red ][ white]
    steps:     Tile 1 is 3. / Tile 2 is 4. / Tile 3 is 1. / 3 * 4 = 12. / 12 - 1 = 11.
    answer:    11

Why this shape: a tile covers whole 14 px patches, so each patch is one flat colour that a
linear patch embedding separates at once; the work left to learn is which tile a step is
about, the colour -> digit map, and one-digit arithmetic. Every solution starts with one read
step per tile, so a misread tile is a wrong step a PRM can only catch by looking at the image.

    problems = generate(SyntheticConfig(num_problems=200, seed=0))
    write_split(problems, "runs/demo/data", "train")   # PNGs + three JSONL files
    mmprm synthetic --out runs/demo/data --train 2000 --test 200 --seed 0

`describe()` returns the palette and the question templates as Markdown for docs;
`style="human"` draws each digit on its tile so people can check an image by eye (train on the
default `style="tiles"`: text would make patches non-uniform).
"""

from __future__ import annotations

import argparse
import math
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mmprm.steps import render_solution

if TYPE_CHECKING:
    from PIL import Image

# Digit -> RGB. Saturated, pairwise far apart (RGB distance > 120) and far from grey and white.
PALETTE: dict[int, tuple[int, int, int]] = {
    0: (0, 0, 0),  # black
    1: (255, 0, 0),  # red
    2: (0, 170, 0),  # green
    3: (0, 0, 255),  # blue
    4: (255, 230, 0),  # yellow
    5: (255, 0, 255),  # magenta
    6: (0, 230, 230),  # cyan
    7: (255, 140, 0),  # orange
    8: (120, 0, 170),  # purple
    9: (140, 70, 20),  # brown
}
COLOUR_NAMES = ("black", "red", "green", "blue", "yellow", "magenta", "cyan", "orange", "purple", "brown")
DISTRACTOR_RGB = (128, 128, 128)  # grey: "ignore grey tiles"
BACKGROUND_RGB = (255, 255, 255)  # white: an empty cell
# Slot k's mark (`marks=True`): pale tints, far apart from each other, drawn only in a cell's top half.
SLOT_MARKS: tuple[tuple[int, int, int], ...] = (
    (255, 190, 190),
    (190, 255, 190),
    (190, 190, 255),
    (255, 255, 170),
    (255, 190, 255),
    (170, 255, 255),
    (215, 215, 215),
    (60, 60, 60),
    (230, 170, 120),
)
OPS = ("+", "-", "*", "cmp")
IGNORE_GREY = " Ignore grey tiles."


@dataclass
class SyntheticConfig:
    """Knobs of the colour-tile task.

    Attributes:
        num_problems: problems to generate.
        seed: the same seed (and config) gives the same problems and byte-identical files.
        min_tiles, max_tiles: digit tiles per problem (2-4); a template is used only when one of
            its tile counts lies in this range.
        ops: operations a template may use: "+", "-", "*", "cmp" (a comparison).
        max_ops: most arithmetic/comparison steps per solution (read steps not counted).
        distractors: most grey tiles per problem; each problem draws 0..distractors of them,
            and when this is > 0 every question ends with "Ignore grey tiles."
        tile_px: tile side in pixels; a multiple of 14 so a tile covers whole ViT patches.
        grid: (rows, cols) of cells; rows * cols must hold max_tiles + distractors.
        digits: (lowest, highest) digit drawn, within 0-9.
        templates: names of question templates to use (None = all of `DEFAULT_TEMPLATES` that fit;
            "running_sum", one step per tile that reads it and updates a total, "running_total",
            the same then a step "The total is N.", and "running_digit", running_total keeping
            only the total's last digit, must be named).
        style: "tiles" = solid tiles (train on this); "human" = digits drawn on the tiles.
        marks: paint the top half of each cell in a colour that names its slot (`SLOT_MARKS`),
            like the labels of a figure's panels; the digit colour fills the bottom half.
        id_prefix: problem ids are f"{id_prefix}-{index:05d}"; use one prefix per split.
    """

    num_problems: int = 100
    seed: int = 0
    min_tiles: int = 2
    max_tiles: int = 4
    ops: tuple[str, ...] = OPS
    max_ops: int = 3
    distractors: int = 0
    tile_px: int = 28
    grid: tuple[int, int] = (2, 2)
    digits: tuple[int, int] = (0, 9)
    templates: tuple[str, ...] | None = None
    style: Literal["tiles", "human"] = "tiles"
    marks: bool = False
    id_prefix: str = "syn"

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what to do."""
        if self.num_problems < 0:
            raise ValueError(f"synthetic.num_problems: {self.num_problems} is negative (use 0 or more)")
        if not 2 <= self.min_tiles <= self.max_tiles <= 4:
            raise ValueError(
                f"synthetic.min_tiles/max_tiles: need 2 <= min_tiles <= max_tiles <= 4, "
                f"got {self.min_tiles}/{self.max_tiles}"
            )
        bad = [op for op in self.ops if op not in OPS]
        if bad:
            raise ValueError(f"synthetic.ops: unknown {bad} (choose from {list(OPS)})")
        if self.max_ops < 1:
            raise ValueError(f"synthetic.max_ops: {self.max_ops} (need at least 1)")
        if self.distractors < 0:
            raise ValueError(f"synthetic.distractors: {self.distractors} is negative (use 0 or more)")
        if self.tile_px <= 0 or self.tile_px % 14:
            raise ValueError(
                f"synthetic.tile_px: {self.tile_px} is not a positive multiple of 14 "
                "(tiles must cover whole 14 px patches; use 14, 28, 56)"
            )
        rows, cols = self.grid
        if rows < 1 or cols < 1 or rows * cols < self.max_tiles + self.distractors:
            raise ValueError(
                f"synthetic.grid: {rows}x{cols} cells cannot hold max_tiles + distractors = "
                f"{self.max_tiles + self.distractors} tiles (enlarge the grid)"
            )
        if self.marks and self.grid[0] * self.grid[1] > len(SLOT_MARKS):
            raise ValueError(
                f"synthetic.marks: {self.grid[0]}x{self.grid[1]} cells but only {len(SLOT_MARKS)} slot marks "
                "(use a smaller grid or marks=false)"
            )
        lo, hi = self.digits
        if not 0 <= lo <= hi <= 9:
            raise ValueError(f"synthetic.digits: need 0 <= low <= high <= 9, got {list(self.digits)}")
        if self.templates is not None:
            unknown = [t for t in self.templates if t not in TEMPLATES]
            if unknown:
                raise ValueError(f"synthetic.templates: unknown {unknown} (choose from {list(TEMPLATES)})")
        if self.style not in ("tiles", "human"):
            raise ValueError(f"synthetic.style: {self.style!r} (use 'tiles' or 'human')")
        if not _choices(self):
            raise ValueError(
                "synthetic: no question template fits min_tiles/max_tiles, ops, max_ops and "
                "templates (widen ops or the tile range; see mmprm.data.synthetic.describe())"
            )


@dataclass
class SyntheticProblem:
    """One generated problem: the image, the question, the gold steps and answer.

    meta holds `template`, `tiles` (the digits in reading order), `cells` (every drawn tile in
    reading order, None for grey) and `source`="synthetic".
    """

    id: str
    image: Image.Image
    question: str
    steps: list[str]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def solution(self) -> str:
        """The gold solution in the policy format (`<step>...</step>` then `<answer>`)."""
        return render_solution(self.steps, self.answer)


# ---------------------------------------------------------------------------------------------
# Question templates. `solve` gets the digits in reading order and returns the arithmetic steps
# (after the read steps) and the answer. Question texts hold no digit values: only which tiles.


@dataclass(frozen=True)
class Template:
    """A question with a fixed recipe; `tile_counts` lists the tile counts it accepts."""

    name: str
    question: str
    tile_counts: tuple[int, ...]
    ops: frozenset[str]
    solve: Callable[[list[int]], tuple[list[str], int]]
    reads_tiles: bool = False  # True: `solve` writes the read steps itself (no separate "Tile i is d.")

    def num_ops(self, n_tiles: int) -> int:
        return len(self.solve([0] * n_tiles)[0])

    def steps(self, digits: list[int]) -> tuple[list[str], int]:
        """All steps of the gold solution (read steps included) and the answer."""
        arithmetic, answer = self.solve(digits)
        reads = [] if self.reads_tiles else [f"Tile {i} is {d}." for i, d in enumerate(digits, start=1)]
        return reads + arithmetic, answer


def _add_all(d: list[int]) -> tuple[list[str], int]:
    steps, total = [], d[0]
    for x in d[1:]:
        steps.append(f"{total} + {x} = {total + x}.")
        total += x
    return steps, total


def _running_sum(d: list[int], slips: dict[int, int] | None = None, last_digit: bool = False) -> tuple[list[str], int]:
    # One step per tile: read it and update the total. A step is checked against the image and
    # the previous step alone, but a slip anywhere carries into every later total.
    # slips: step (1-based, >= 2) -> offset added to the total it carries over (`add_slips`).
    # last_digit: a sum of 10 or more goes on as its last digit (", keep k"), so every line adds
    # two one-digit numbers: with whole totals the sums grow with each tile (up to 27 + 9) and a
    # late line is the one a small PRM checks worst (docs/experiments/2026-12-04-last-digit-task.md).
    steps, total = [f"Tile 1 is {d[0]}. Total {d[0]}."], d[0]
    for i, x in enumerate(d[1:], start=2):
        carried = total + (slips or {}).get(i, 0)
        line, total = f"Tile {i} is {x}. Total {carried} + {x} = {carried + x}", carried + x
        if last_digit and total >= 10:
            total %= 10
            line += f", keep {total}"
        steps.append(line + ".")
    return steps, total


def _running_total(
    d: list[int], slips: dict[int, int] | None = None, last_digit: bool = False
) -> tuple[list[str], int]:
    # running_sum, then a step that states the result: the answer follows a short line that only
    # copies the last total, not the last tile's line, where the demo's PRMs learned the tile
    # check worst with the answer appended (docs/experiments/2026-12-04-why-best-of-n-falls.md).
    steps, total = _running_sum(d, slips, last_digit)
    return steps + [f"The total is {total}."], total


def _running_digit(d: list[int], slips: dict[int, int] | None = None) -> tuple[list[str], int]:
    return _running_total(d, slips, last_digit=True)


def _mul(d: list[int]) -> tuple[list[str], int]:
    return [f"{d[0]} * {d[1]} = {d[0] * d[1]}."], d[0] * d[1]


def _gap(d: list[int]) -> tuple[list[str], int]:
    hi, lo = max(d), min(d)
    return [f"{hi} - {lo} = {hi - lo}."], hi - lo


def _mul_sub(d: list[int]) -> tuple[list[str], int]:
    p = d[0] * d[1]
    return [f"{d[0]} * {d[1]} = {p}.", f"{p} - {d[2]} = {p - d[2]}."], p - d[2]


def _add_mul(d: list[int]) -> tuple[list[str], int]:
    s = d[0] + d[1]
    return [f"{d[0]} + {d[1]} = {s}.", f"{s} * {d[2]} = {s * d[2]}."], s * d[2]


def _compare(d: list[int]) -> tuple[list[str], int]:
    s, last = d[0] + d[1], d[2]
    sign = ">" if s > last else "<" if s < last else "="
    return [
        f"{d[0]} + {d[1]} = {s}.",
        f"{s} {sign} {last}.",
        f"{max(s, last)} - {min(s, last)} = {abs(s - last)}.",
    ], abs(s - last)


def _pair_diff(d: list[int]) -> tuple[list[str], int]:
    s, t = d[0] + d[1], d[2] + d[3]
    return [f"{d[0]} + {d[1]} = {s}.", f"{d[2]} + {d[3]} = {t}.", f"{s} - {t} = {s - t}."], s - t


def _range(d: list[int]) -> tuple[list[str], int]:
    hi, lo = max(d), min(d)
    return [f"The largest is {hi}.", f"The smallest is {lo}.", f"{hi} - {lo} = {hi - lo}."], hi - lo


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in [
        Template("add", "Add up all the tiles.", (2, 3, 4), frozenset({"+"}), _add_all),
        Template("mul", "Multiply the two tiles.", (2,), frozenset({"*"}), _mul),
        Template("gap", "Subtract the smaller tile from the larger.", (2,), frozenset({"-", "cmp"}), _gap),
        Template("mul_sub", "Multiply tile 1 by tile 2, then subtract tile 3.", (3,), frozenset({"*", "-"}), _mul_sub),
        Template("add_mul", "Add tiles 1 and 2, then multiply by tile 3.", (3,), frozenset({"+", "*"}), _add_mul),
        Template(
            "compare",
            "Which is larger: tile 1 plus tile 2, or tile 3? Give the difference.",
            (3,),
            frozenset({"+", "-", "cmp"}),
            _compare,
        ),
        Template(
            "pair_diff",
            "Subtract the sum of tiles 3 and 4 from the sum of tiles 1 and 2.",
            (4,),
            frozenset({"+", "-"}),
            _pair_diff,
        ),
        Template("range", "Subtract the smallest tile from the largest.", (3, 4), frozenset({"-", "cmp"}), _range),
        Template(
            "running_sum",
            "Add up the tiles one by one, keeping a running total.",
            (2, 3, 4),
            frozenset({"+"}),
            _running_sum,
            reads_tiles=True,
        ),
        Template(
            "running_total",
            "Add up the tiles one by one, keeping a running total.",
            (2, 3, 4),
            frozenset({"+"}),
            _running_total,
            reads_tiles=True,
        ),
        Template(
            "running_digit",
            "Add up the tiles one by one, keeping only the last digit of the total.",
            (2, 3, 4),
            frozenset({"+"}),
            _running_digit,
            reads_tiles=True,
        ),
    ]
}
# Templates that carry a running total over one step per tile, with the solver `add_slips` calls
# to slip one of their carries.
RUNNING_TEMPLATES: dict[str, Callable[..., tuple[list[str], int]]] = {
    "running_sum": _running_sum,
    "running_total": _running_total,
    "running_digit": _running_digit,
}
# The running templates whose total wraps: only its last digit is carried.
KEEPS_LAST_DIGIT = frozenset({"running_digit"})
# `templates=None` draws from these; the running ones are opt-in, so existing seeds keep their problems.
DEFAULT_TEMPLATES: tuple[str, ...] = tuple(name for name in TEMPLATES if name not in RUNNING_TEMPLATES)


def _choices(cfg: SyntheticConfig) -> list[tuple[Template, tuple[int, ...]]]:
    """Templates allowed by the config, each with the tile counts it may use."""
    names = cfg.templates if cfg.templates is not None else DEFAULT_TEMPLATES
    out = []
    for name in names:
        t = TEMPLATES[name]
        if not t.ops <= set(cfg.ops):
            continue
        counts = tuple(n for n in t.tile_counts if cfg.min_tiles <= n <= cfg.max_tiles and t.num_ops(n) <= cfg.max_ops)
        if counts:
            out.append((t, counts))
    return out


# ---------------------------------------------------------------------------------------------
# Images


def _contrast(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    # Rec. 601 luma: dark tiles get white text, light tiles black.
    return (0, 0, 0) if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140 else (255, 255, 255)


def render_image(
    cells: Sequence[int | None],
    grid: tuple[int, int] = (2, 2),
    tile_px: int = 28,
    style: Literal["tiles", "human"] = "tiles",
    marks: bool = False,
) -> Image.Image:
    """Draw tiles in reading order into a `grid` (rows, cols); None is a grey distractor.

    Returns an RGB image of (cols * tile_px) x (rows * tile_px) px; cells past the last tile
    stay white. style="human" outlines each tile and writes its digit (a dash on grey) in the centre.
    """
    from PIL import Image, ImageDraw, ImageFont

    rows, cols = grid
    if len(cells) > rows * cols:
        raise ValueError(f"{len(cells)} tiles do not fit a {rows}x{cols} grid")
    image = Image.new("RGB", (cols * tile_px, rows * tile_px), BACKGROUND_RGB)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(8, tile_px * 2 // 3)) if style == "human" else None
    for k, digit in enumerate(cells):
        x, y = (k % cols) * tile_px, (k // cols) * tile_px
        rgb = DISTRACTOR_RGB if digit is None else PALETTE[digit]
        draw.rectangle([x, y, x + tile_px - 1, y + tile_px - 1], fill=rgb)
        if marks:
            # Why: a tiny VLM finds "tile 3" by what a patch looks like far sooner than by where it is.
            draw.rectangle([x, y, x + tile_px - 1, y + tile_px // 2 - 1], fill=SLOT_MARKS[k])
        if font is not None:
            # A white outline keeps equal neighbours apart for the eye (never in training images).
            draw.rectangle([x, y, x + tile_px - 1, y + tile_px - 1], outline=BACKGROUND_RGB)
            label = "-" if digit is None else str(digit)
            draw.text((x + tile_px / 2, y + tile_px / 2), label, fill=_contrast(rgb), font=font, anchor="mm")
    return image


# ---------------------------------------------------------------------------------------------
# Generation


def problem_key(template: str, cells: Sequence[int | None]) -> str:
    """Identity of a problem (question recipe + drawn tiles) used to keep splits disjoint."""
    return template + ":" + ",".join("g" if c is None else str(c) for c in cells)


def generate(config: SyntheticConfig, exclude: set[str] | frozenset[str] = frozenset()) -> list[SyntheticProblem]:
    """Generate `config.num_problems` problems, deterministically from `config.seed`.

    Args:
        config: the task knobs (validated here).
        exclude: `problem_key`s not to generate (e.g. the train split's, to get a disjoint test
            split); excluded draws are redrawn, so a split that excludes many keys has fewer
            problems from the small templates (2 tiles have only 100 digit pairs).

    Returns:
        The problems, ids f"{config.id_prefix}-00000", ...
    """
    config.validate()
    rng = random.Random(config.seed)
    choices = _choices(config)
    lo, hi = config.digits
    problems: list[SyntheticProblem] = []
    attempts = 0
    while len(problems) < config.num_problems:
        attempts += 1
        if attempts > 100 * config.num_problems + 1000:
            raise ValueError(
                f"synthetic: could only draw {len(problems)} of {config.num_problems} problems "
                f"not in `exclude` (ask for fewer, or allow more tiles/templates)"
            )
        template, counts = rng.choice(choices)
        n = rng.choice(counts)
        digits = [rng.randint(lo, hi) for _ in range(n)]
        n_grey = rng.randint(0, config.distractors)
        grey_at = set(rng.sample(range(n + n_grey), n_grey))
        it = iter(digits)
        cells = [None if k in grey_at else next(it) for k in range(n + n_grey)]
        key = problem_key(template.name, cells)
        if key in exclude:
            continue
        steps, answer = template.steps(digits)
        question = template.question + (IGNORE_GREY if config.distractors > 0 else "")
        problems.append(
            SyntheticProblem(
                id=f"{config.id_prefix}-{len(problems):05d}",
                image=render_image(cells, config.grid, config.tile_px, config.style, config.marks),
                question=question,
                steps=steps,
                answer=str(answer),
                meta={"source": "synthetic", "template": template.name, "tiles": digits, "cells": cells},
            )
        )
    return problems


def add_slips(problems: Sequence[SyntheticProblem], rate: float, seed: int = 0) -> list[SyntheticProblem]:
    """Copies of `problems` where a share `rate` of the solutions carries one careless slip.

    The slip is the one human solvers make most: one running total carried from the step before
    (chosen uniformly among the carries) is off by 1-3, and the solution goes on correctly from
    what it wrote, so its answer is wrong. A policy fine-tuned on these solutions makes such slips
    when it samples, and each one is visible from the step before it alone - the kind of error a
    process reward model is for. Every later step goes on from the written total, yet a policy
    trained on them still sometimes repairs a slip at the next step (it carries the true total
    again), so a slip's Monte Carlo value is not always 0 (measured in docs/experiments/).
    One slip per slipped solution, not one chance per carry: at 0.3 per carry, two in three 4-tile
    solutions would slip, one in five more than once.
    Only the running templates' problems get slips (a kept last digit slips to another digit);
    `answer` and `steps` become the slipped solution's, meta gains `slip_steps` (1-based) and
    `gold_answer`.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"synthetic.slip_rate: {rate} is not in [0, 1]")
    rng = random.Random(seed)
    out = []
    for p in problems:
        tiles = p.meta["tiles"]
        if p.meta["template"] not in RUNNING_TEMPLATES or len(tiles) < 2 or not rng.random() < rate:
            out.append(p)
            continue
        step = rng.randint(2, len(tiles))  # the step whose carried total is miscopied
        carried, highest = sum(tiles[: step - 1]), math.inf
        if p.meta["template"] in KEEPS_LAST_DIGIT:  # a kept digit slips to another digit
            carried, highest = carried % 10, 9
        offset = rng.choice([o for o in (-3, -2, -1, 1, 2, 3) if 0 <= carried + o <= highest])
        steps, answer = RUNNING_TEMPLATES[p.meta["template"]](tiles, {step: offset})
        meta = {**p.meta, "slip_steps": [step], "gold_answer": p.answer}
        out.append(SyntheticProblem(p.id, p.image, p.question, steps, str(answer), meta))
    return out


def write_split(problems: Sequence[SyntheticProblem], out_dir: str | Path, name: str) -> Path:
    """Write one split: PNGs and three JSONL files, image paths relative to the JSONL files.

    Files under `out_dir`:
        images/{name}_{id}.png
        {name}_problems.jsonl    id, images, question, answer, meta (annotation / Best-of-N input)
        {name}_sft.jsonl         id, images, question, steps, answer, meta (policy SFT input)
        {name}_gold_steps.jsonl  the step-labelled schema with exact labels: 1.0 each, except from a
                                 slip on (`add_slips`); `load_examples` reads it

    Returns:
        `out_dir` as a Path.
    """
    from mmprm.data.schema import write_jsonl

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    problem_rows, sft_rows, gold_rows = [], [], []
    for p in problems:
        rel = f"images/{name}_{p.id}.png"
        # No PNG metadata is written, so equal pixels give equal bytes (reproducible files).
        p.image.save(out / rel, format="PNG")
        base = {"id": p.id, "images": [rel], "question": p.question}
        gold = p.meta.get("gold_answer", p.answer)  # a slipped solution (`add_slips`) answers wrongly
        labels = [float(ok) for ok in check_steps(p.meta["tiles"], p.steps)]  # 1.0 each unless slipped
        problem_rows.append({**base, "answer": gold, "meta": p.meta})
        sft_rows.append({**base, "steps": p.steps, "answer": p.answer, "meta": p.meta})
        gold_rows.append({**base, "steps": p.steps, "labels": labels, "answer": gold, "meta": p.meta})
    write_jsonl(out / f"{name}_problems.jsonl", problem_rows)
    write_jsonl(out / f"{name}_sft.jsonl", sft_rows)
    write_jsonl(out / f"{name}_gold_steps.jsonl", gold_rows)
    return out


# ---------------------------------------------------------------------------------------------
# Checks and documentation


def text_only_accuracy(train: Sequence[SyntheticProblem], test: Sequence[SyntheticProblem]) -> float:
    """Test accuracy of the best predictor that sees only the question text.

    It answers each test question with the most common train answer for that exact question
    (ties: the smallest answer string); an unseen question counts as wrong. A model that
    cannot read the image can do no better than this in expectation.
    """
    by_question: dict[str, Counter[str]] = defaultdict(Counter)
    for p in train:
        by_question[p.question][p.answer] += 1
    best = {q: min(c, key=lambda a: (-c[a], a)) for q, c in by_question.items()}
    if not test:
        return 0.0
    return sum(best.get(p.question) == p.answer for p in test) / len(test)


def describe() -> str:
    """The task, the palette and the question templates as Markdown (for docs)."""
    lines = [
        "Each image is a grid of solid square tiles read left to right, top to bottom. A tile's "
        'colour is a digit; grey tiles are distractors (questions then say "Ignore grey tiles."), '
        'white cells are empty. A solution reads every tile ("Tile 1 is 3.") and then computes.',
        "",
        "| digit | colour | RGB |",
        "| --- | --- | --- |",
        *(f"| {d} | {COLOUR_NAMES[d]} | {rgb} |" for d, rgb in PALETTE.items()),
        f"| - | grey (distractor) | {DISTRACTOR_RGB} |",
        f"| - | white (empty) | {BACKGROUND_RGB} |",
        "",
        "| template | tiles | ops | question | example steps |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in TEMPLATES.values():
        n = t.tile_counts[-1]
        steps, answer = t.steps([3, 5, 2, 4][:n])
        lines.append(
            f"| {t.name} | {', '.join(map(str, t.tile_counts))} | {' '.join(sorted(t.ops))} | "
            f"{t.question} | {' '.join(steps)} -> {answer} |"
        )
    return "\n".join(lines)


def cli_synthetic(argv: list[str]) -> int:
    """`mmprm synthetic --out DIR --train N --test N --seed S`: write a train and a test split.

    The test split draws from seed S + 1 and never repeats a train problem (same template and
    tiles), so test accuracy measures reading and arithmetic, not memory.
    """
    parser = argparse.ArgumentParser(prog="mmprm synthetic", description=cli_synthetic.__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=1000, help="train problems (default 1000)")
    parser.add_argument("--test", type=int, default=200, help="test problems (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tiles", type=int, default=2)
    parser.add_argument("--max-tiles", type=int, default=4)
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--max-ops", type=int, default=3)
    parser.add_argument("--distractors", type=int, default=0, help="most grey tiles per problem")
    parser.add_argument("--grid", default="2x2", help="ROWSxCOLS of cells (default 2x2)")
    parser.add_argument("--tile-px", type=int, default=28)
    parser.add_argument("--style", choices=["tiles", "human"], default="tiles")
    parser.add_argument(
        "--labelled",
        action="store_true",
        help="also write {split}_labelled.jsonl: half the solutions with one planted error",
    )
    args = parser.parse_args(argv)
    try:
        rows, cols = (int(x) for x in args.grid.lower().split("x"))
    except ValueError:
        parser.error(f"--grid {args.grid!r}: write it as ROWSxCOLS, e.g. 2x2")
    common = dict(
        min_tiles=args.min_tiles,
        max_tiles=args.max_tiles,
        max_ops=args.max_ops,
        ops=tuple(o.strip() for o in args.ops.split(",") if o.strip()),
        distractors=args.distractors,
        grid=(rows, cols),
        tile_px=args.tile_px,
        style=args.style,
    )
    try:
        train = generate(SyntheticConfig(num_problems=args.train, seed=args.seed, id_prefix="train", **common))
        seen = {problem_key(p.meta["template"], p.meta["cells"]) for p in train}
        test = generate(
            SyntheticConfig(num_problems=args.test, seed=args.seed + 1, id_prefix="test", **common), exclude=seen
        )
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    write_split(train, out, "train")
    write_split(test, out, "test")
    if args.labelled:
        from mmprm.data.schema import write_jsonl

        for name, split in (("train", train), ("test", test)):
            write_jsonl(out / f"{name}_labelled.jsonl", labelled_examples(split, name, seed=args.seed))
    print(
        f"wrote {len(train)} train and {len(test)} test problems to {out} "
        f"(text-only ceiling on test: {text_only_accuracy(train, test):.1%})"
    )
    return 0


# ---------------------------------------------------------------------------------------------
# Ground-truth step labels (for evaluating a PRM on the demo task)

_READ_RE = re.compile(r"^Tile (\d+) is (-?\d+)\.$")
_ARITH_RE = re.compile(r"^(-?\d+) ([-+*]) (-?\d+) = (-?\d+)\.$")
_EXTREME_RE = re.compile(r"^The (largest|smallest) is (-?\d+)\.$")
_TOTAL_RE = re.compile(r"^The total is (-?\d+)\.$")
_CMP_RE = re.compile(r"^(-?\d+) ([<>=]) (-?\d+)\.$")
_RUNNING_RE = re.compile(r"^Tile (\d+) is (-?\d+)\. Total (?:(-?\d+) \+ (-?\d+) = )?(-?\d+)(?:, keep (-?\d+))?\.$")


RIGHT, AFTER = "right", "after"
# Why the first wrong step of a solution is wrong (`step_verdicts`), most local first.
ERROR_KINDS: dict[str, str] = {
    "carry": "a number carried from an earlier line is miscopied",
    "arithmetic": "the line's own sum or comparison is false",
    "misread": "a tile read as the wrong digit",
    "order": "a tile skipped, repeated or out of range",
    "unparsed": "not a step of the task's form",
    "answer": "every line holds, but the answer is not the last result, or not the gold answer",
}


def step_verdicts(
    tiles: Sequence[int], steps: Sequence[str], answer: str | None = None, gold: str | None = None
) -> list[str]:
    """Per step: "right", the kind of error of the first wrong step (`ERROR_KINDS`), then "after".

    A step is right when its claim is true and it only uses values already established (the
    tiles it read correctly and earlier results); once a step is wrong every later step is wrong
    too ("still on track" labels, the quantity a PRM estimates). An unparsable step is wrong.
    When `answer` is given, the last step is also wrong unless the answer equals its result, and,
    when `gold` is given too, unless it equals the gold answer (a solution that skips a tile is
    off track at its answer even if every line it wrote is true).

    Example: tiles 3, 5, 2 and "Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 4 + 5 = 9.",
    "Tile 3 is 2. Total 9 + 2 = 11." -> right, carry, after.
    """
    known: set[int] = set()
    out: list[str] = []
    last_value: int | None = None
    running = 0  # running-total steps so far
    for step in steps:
        text = step.strip().split("\n")[0].strip()
        error: str | None = "unparsed"
        value: int | None = None
        if m := _RUNNING_RE.match(text):
            # "Tile i is d. Total a + d = c.": the read, the carried total and the sum must all hold.
            i, d, c = int(m.group(1)), int(m.group(2)), int(m.group(5))
            # ", keep k" (running_digit) claims k is the sum's last digit, and k is carried on
            keep = None if m.group(6) is None else int(m.group(6))
            running += 1
            if not i == running <= len(tiles):  # tiles in order, none skipped
                error = "order"
            elif tiles[i - 1] != d:
                error = "misread"
            elif m.group(3) is None:
                error = "carry" if last_value is not None else None if c == d else "arithmetic"
            else:
                a, b = int(m.group(3)), int(m.group(4))
                true = a + b == c and (keep is None or keep == c % 10)
                error = "carry" if (a != last_value or b != d) else None if true else "arithmetic"
            value = c if keep is None else keep
        elif m := _READ_RE.match(text):
            i, d = int(m.group(1)), int(m.group(2))
            error = "order" if not 1 <= i <= len(tiles) else None if tiles[i - 1] == d else "misread"
            value = d
        elif m := _ARITH_RE.match(text):
            a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
            true = a + b if op == "+" else a - b if op == "-" else a * b
            error = "carry" if not (a in known and b in known) else None if true == c else "arithmetic"
            value = c
        elif m := _EXTREME_RE.match(text):
            d = int(m.group(2))
            true = max(tiles) if m.group(1) == "largest" else min(tiles)
            error = "misread" if d != true else None if d in known else "carry"
            value = d
        elif m := _TOTAL_RE.match(text):
            value = int(m.group(1))
            error = None if value == last_value else "carry"
        elif m := _CMP_RE.match(text):
            a, sign, b = int(m.group(1)), m.group(2), int(m.group(3))
            true_sign = ">" if a > b else "<" if a < b else "="
            error = "carry" if not (a in known and b in known) else None if sign == true_sign else "arithmetic"
        on_track = not out or out[-1] == RIGHT
        out.append(AFTER if not on_track else error or RIGHT)
        if value is not None:
            known.add(value)
            last_value = value
    if answer is not None and out and out[-1] == RIGHT:
        try:
            ok = last_value is not None and int(answer.strip()) == last_value
        except ValueError:
            ok = False
        if not ok or (gold is not None and answer.strip() != gold.strip()):
            out[-1] = "answer"
    return out


def check_steps(
    tiles: Sequence[int], steps: Sequence[str], answer: str | None = None, gold: str | None = None
) -> list[bool]:
    """True per-step correctness (still on track) of a solution to a synthetic problem whose
    digits are `tiles`: `step_verdicts` is "right". See `step_verdicts` for the rules."""
    return [v == RIGHT for v in step_verdicts(tiles, steps, answer, gold)]


def corrupt_step(step: str, rng: random.Random) -> str:
    """The same step with one number changed (a misread tile or an arithmetic slip)."""
    numbers = list(re.finditer(r"-?\d+", step))
    m = numbers[-1]
    wrong = int(m.group()) + rng.choice([-2, -1, 1, 2])
    return step[: m.start()] + str(wrong) + step[m.end() :]


def labelled_examples(
    problems: Sequence[SyntheticProblem], name: str, seed: int = 0, error_rate: float = 0.5
) -> list[dict]:
    """Step-labelled rows with planted first errors: a toy PRM training set with exact labels.

    With probability `error_rate` one step gets a wrong number; it and every later step are
    labelled 0.0 (later steps are kept as written, so the error is the only tell), earlier ones 1.0.
    Images are referenced as `write_split(problems, out_dir, name)` writes them.
    """
    rng = random.Random(seed * 7919 + 17)
    rows = []
    for p in problems:
        steps, labels = list(p.steps), [1.0] * len(p.steps)
        if rng.random() < error_rate:
            # a comparison ("8 > 2.") can stay true with another number: corrupt a stated value instead
            k = rng.choice([i for i, st in enumerate(steps) if not _CMP_RE.match(st)])
            steps[k] = corrupt_step(steps[k], rng)
            labels = [1.0] * k + [0.0] * (len(steps) - k)
        rows.append(
            {
                "id": p.id,
                "images": [f"images/{name}_{p.id}.png"],
                "question": p.question,
                "steps": steps,
                "labels": labels,
                "answer": p.answer,
                "meta": p.meta,
            }
        )
    return rows
