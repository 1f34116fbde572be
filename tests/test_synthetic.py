"""The colour-tile task: correct arithmetic, images that encode the digits, no text leak, reproducible files."""

import hashlib
import operator
import re

import pytest

from mmprm.config import ConfigError, load_config
from mmprm.data.schema import load_examples, read_jsonl
from mmprm.data.synthetic import (
    BACKGROUND_RGB,
    DEFAULT_TEMPLATES,
    DISTRACTOR_RGB,
    PALETTE,
    SLOT_MARKS,
    TEMPLATES,
    SyntheticConfig,
    cli_synthetic,
    describe,
    generate,
    problem_key,
    render_image,
    text_only_accuracy,
    write_split,
)
from mmprm.steps import parse_solution

_ARITH = re.compile(r"^(-?\d+) ([-+*]) (-?\d+) = (-?\d+)\.$")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.mark.parametrize(
    "name, digits, steps, answer",
    [
        ("add", [3, 5, 2, 4], ["3 + 5 = 8.", "8 + 2 = 10.", "10 + 4 = 14."], 14),
        ("add", [9, 0], ["9 + 0 = 9."], 9),
        ("mul", [7, 6], ["7 * 6 = 42."], 42),
        ("gap", [2, 9], ["9 - 2 = 7."], 7),
        ("mul_sub", [0, 4, 9], ["0 * 4 = 0.", "0 - 9 = -9."], -9),
        ("add_mul", [2, 3, 4], ["2 + 3 = 5.", "5 * 4 = 20."], 20),
        ("compare", [3, 5, 2], ["3 + 5 = 8.", "8 > 2.", "8 - 2 = 6."], 6),
        ("compare", [1, 2, 9], ["1 + 2 = 3.", "3 < 9.", "9 - 3 = 6."], 6),
        ("compare", [4, 4, 8], ["4 + 4 = 8.", "8 = 8.", "8 - 8 = 0."], 0),
        ("pair_diff", [1, 2, 8, 7], ["1 + 2 = 3.", "8 + 7 = 15.", "3 - 15 = -12."], -12),
        ("range", [4, 9, 1, 6], ["The largest is 9.", "The smallest is 1.", "9 - 1 = 8."], 8),
        (
            "running_sum",
            [3, 5, 2],
            ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 3 + 5 = 8.", "Tile 3 is 2. Total 8 + 2 = 10."],
            10,
        ),
        (
            "running_total",
            [3, 5, 2],
            [
                "Tile 1 is 3. Total 3.",
                "Tile 2 is 5. Total 3 + 5 = 8.",
                "Tile 3 is 2. Total 8 + 2 = 10.",
                "The total is 10.",
            ],
            10,
        ),
        (
            "running_digit",
            [7, 5, 9, 6],
            [
                "Tile 1 is 7. Total 7.",
                "Tile 2 is 5. Total 7 + 5 = 12, keep 2.",
                "Tile 3 is 9. Total 2 + 9 = 11, keep 1.",
                "Tile 4 is 6. Total 1 + 6 = 7.",
                "The total is 7.",
            ],
            7,
        ),
    ],
)
def test_templates_compute_hand_checked_solutions(name, digits, steps, answer):
    assert TEMPLATES[name].solve(digits) == (steps, answer)


def _tile_pixel(image, k, cols, tile_px):
    x, y = (k % cols) * tile_px, (k // cols) * tile_px
    return image.getpixel((x + tile_px // 2, y + tile_px // 2))


def test_problems_are_self_consistent_and_the_image_holds_the_digits():
    problems = generate(SyntheticConfig(num_problems=300, seed=1))
    assert {p.meta["template"] for p in problems} == set(DEFAULT_TEMPLATES)
    for p in problems:
        tiles, cells = p.meta["tiles"], p.meta["cells"]
        assert p.image.size == (56, 56) and 2 <= len(tiles) <= 4
        for k, c in enumerate(cells):
            assert _tile_pixel(p.image, k, 2, 28) == PALETTE[c]
        for k in range(len(cells), 4):
            assert _tile_pixel(p.image, k, 2, 28) == BACKGROUND_RGB
        assert p.steps[: len(tiles)] == [f"Tile {i + 1} is {d}." for i, d in enumerate(tiles)]
        for step in p.steps[len(tiles) :]:
            m = _ARITH.match(step)
            if m:  # every equation in a gold step is true
                a, op, b, c = m.groups()
                assert _OPS[op](int(a), int(b)) == int(c), (p.id, step)
        assert p.answer == str(TEMPLATES[p.meta["template"]].solve(tiles)[1])
        assert re.findall(r"-?\d+", p.steps[-1])[-1] == p.answer
        parsed = parse_solution(p.solution())
        assert (parsed.steps, parsed.answer) == (p.steps, p.answer)


def test_questions_name_tile_positions_but_never_values():
    for p in generate(SyntheticConfig(num_problems=200, seed=2)):
        assert not re.search(r"\d", re.sub(r"tiles? [1-4]( and [1-4])?", "", p.question)), p.question


def test_text_only_predictor_is_near_chance_while_reading_the_image_solves_everything():
    train = generate(SyntheticConfig(num_problems=2000, seed=0))
    test = generate(SyntheticConfig(num_problems=500, seed=1, id_prefix="test"))
    text_only = text_only_accuracy(train, test)
    assert text_only < 0.2, text_only

    def read(image, n_cells):  # nearest palette colour at each tile centre
        colours = {rgb: d for d, rgb in PALETTE.items()}
        return [colours[_tile_pixel(image, k, 2, 28)] for k in range(n_cells)]

    solved = sum(
        str(TEMPLATES[p.meta["template"]].solve(read(p.image, len(p.meta["cells"])))[1]) == p.answer for p in test
    )
    assert solved == len(test)


def test_text_only_accuracy_on_a_hand_made_split():
    train = generate(SyntheticConfig(num_problems=40, seed=0, templates=("mul",)))
    # Make "3" the most common train answer by hand; the test gets it right exactly once.
    for p in train[:30]:
        p.answer = "3"
    test = generate(SyntheticConfig(num_problems=4, seed=1, templates=("mul",)))
    for p, a in zip(test, ["3", "4", "5", "3x"]):
        p.answer = a
    assert text_only_accuracy(train, test) == 0.25


def test_tiles_cover_whole_patches_and_fit_the_tiny_qwen_processor_unresized():
    from transformers import Qwen2VLImageProcessorPil

    image = render_image([1, 2, 3], grid=(2, 2), tile_px=28)
    for px in range(0, 56, 14):
        for py in range(0, 56, 14):
            patch = {image.getpixel((px + i, py + j)) for i in range(14) for j in range(14)}
            assert len(patch) == 1, (px, py)
    # Same settings as the tiny qwen2_vl preset: one merged image token per 28 px tile.
    processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    assert processor(images=[image], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_human_style_draws_digits_only_on_top_of_the_same_tiles():
    plain = render_image([0, 4, None], grid=(1, 3), tile_px=56)
    human = render_image([0, 4, None], grid=(1, 3), tile_px=56, style="human")
    assert plain.size == human.size == (168, 56)
    assert plain.tobytes() != human.tobytes()
    assert human.getpixel((4, 4)) == PALETTE[0] and human.getpixel((116, 4)) == DISTRACTOR_RGB


def test_slot_marks_paint_the_top_half_of_each_cell_and_leave_the_digit_below():
    plain = render_image([3, 7, None], grid=(2, 2), tile_px=28)
    marked = render_image([3, 7, None], grid=(2, 2), tile_px=28, marks=True)
    # top half: slot k's mark; bottom half: the digit (or grey), exactly as without marks
    for k, (x, y) in enumerate([(0, 0), (28, 0), (0, 28)]):
        assert marked.getpixel((x + 5, y + 5)) == SLOT_MARKS[k]
        assert marked.getpixel((x + 5, y + 20)) == plain.getpixel((x + 5, y + 20))
    assert marked.getpixel((30, 30)) == plain.getpixel((30, 30)) == BACKGROUND_RGB  # an empty cell stays white
    # the top half is a whole 14 px patch row: each Qwen2-VL patch is one flat colour
    assert marked.crop((0, 0, 28, 14)).getcolors() == [(28 * 14, SLOT_MARKS[0])]
    # marks change only the pictures: same seed, same problems and steps
    with_marks = generate(SyntheticConfig(num_problems=20, seed=3, marks=True))
    without = generate(SyntheticConfig(num_problems=20, seed=3))
    assert [(p.question, p.steps) for p in with_marks] == [(p.question, p.steps) for p in without]
    assert len(set(SLOT_MARKS)) == len(SLOT_MARKS) and not set(SLOT_MARKS) & {*PALETTE.values(), DISTRACTOR_RGB}


def test_distractors_are_grey_skipped_by_the_steps_and_announced_in_every_question():
    problems = generate(SyntheticConfig(num_problems=200, seed=3, distractors=2, grid=(2, 3)))
    assert all(p.question.endswith("Ignore grey tiles.") for p in problems)
    with_grey = [p for p in problems if None in p.meta["cells"]]
    assert 0 < len(with_grey) < len(problems)
    for p in with_grey:
        cells = p.meta["cells"]
        assert [c for c in cells if c is not None] == p.meta["tiles"]
        for k, c in enumerate(cells):
            assert _tile_pixel(p.image, k, 3, 28) == (DISTRACTOR_RGB if c is None else PALETTE[c])


def test_knobs_restrict_templates_tiles_ops_and_digits():
    only_add = generate(SyntheticConfig(num_problems=50, seed=0, ops=("+",)))
    assert {p.meta["template"] for p in only_add} == {"add"}
    two = generate(SyntheticConfig(num_problems=50, seed=0, max_tiles=2))
    assert {len(p.meta["tiles"]) for p in two} == {2}
    one_op = generate(SyntheticConfig(num_problems=50, seed=0, max_ops=1))
    assert all(len(p.steps) - len(p.meta["tiles"]) == 1 for p in one_op)
    ones = generate(SyntheticConfig(num_problems=20, seed=0, digits=(1, 1)))
    assert {d for p in ones for d in p.meta["tiles"]} == {1}


@pytest.mark.parametrize(
    "override, field",
    [
        ("tile_px=20", "tile_px"),
        ("grid=[1,3]", "grid"),
        ("ops=[+,/]", "ops"),
        ("min_tiles=3", "min_tiles"),
        ("digits=[5,12]", "digits"),
        ("templates=[sum]", "templates"),
        ("marks=true;grid=[4,4]", "marks"),
    ],
)
def test_bad_config_fails_early_naming_the_field(override, field):
    # min_tiles=3 with max_tiles=2 is impossible; the rest are out of range.
    overrides = override.split(";") + (["max_tiles=2"] if field == "min_tiles" else [])
    with pytest.raises(ConfigError, match=f"synthetic.{field}"):
        load_config(SyntheticConfig, None, overrides)


def test_config_with_no_fitting_template_says_so():
    with pytest.raises(ValueError, match="no question template fits"):
        generate(SyntheticConfig(ops=("*",), min_tiles=3))


def _digests(folder):
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def test_same_seed_gives_byte_identical_files_and_gold_steps_load(tmp_path):
    cfg = SyntheticConfig(num_problems=30, seed=7, distractors=1, grid=(2, 3))
    write_split(generate(cfg), tmp_path / "a", "train")
    write_split(generate(cfg), tmp_path / "b", "train")
    write_split(generate(SyntheticConfig(num_problems=30, seed=8, distractors=1, grid=(2, 3))), tmp_path / "c", "train")
    a, b, c = _digests(tmp_path / "a"), _digests(tmp_path / "b"), _digests(tmp_path / "c")
    assert a == b and len(a) == 33
    assert a != c

    gold = load_examples(tmp_path / "a" / "train_gold_steps.jsonl", require_labels=True)
    assert len(gold) == 30 and all(e.labels == [1.0] * len(e.steps) for e in gold)
    assert gold[0].images == [str((tmp_path / "a" / "images" / "train_syn-00000.png").resolve())]
    sft = load_examples(tmp_path / "a" / "train_sft.jsonl")
    assert [(e.steps, e.answer) for e in sft] == [(e.steps, e.answer) for e in gold]
    problems = read_jsonl(tmp_path / "a" / "train_problems.jsonl")
    assert set(problems[0]) == {"id", "images", "question", "answer", "meta"}
    assert [r["answer"] for r in problems] == [e.answer for e in gold]


def test_cli_writes_disjoint_train_and_test_splits(tmp_path, capsys):
    assert (
        cli_synthetic(["--out", str(tmp_path), "--train", "150", "--test", "40", "--seed", "3", "--max-tiles", "2"])
        == 0
    )
    assert "text-only ceiling" in capsys.readouterr().out
    train = read_jsonl(tmp_path / "train_problems.jsonl")
    test = read_jsonl(tmp_path / "test_problems.jsonl")
    assert (len(train), len(test)) == (150, 40)
    keys = lambda rows: {problem_key(r["meta"]["template"], r["meta"]["cells"]) for r in rows}  # noqa: E731
    assert not keys(train) & keys(test)
    assert len(load_examples(tmp_path / "test_gold_steps.jsonl", require_labels=True)) == 40
    with pytest.raises(SystemExit):
        cli_synthetic(["--out", str(tmp_path), "--grid", "2by2"])


def test_describe_lists_every_digit_and_template():
    text = describe()
    assert all(f"| {d} |" in text for d in range(10))
    assert all(f"| {name} |" in text for name in TEMPLATES)


def test_check_steps_hand_cases():
    from mmprm.data.synthetic import check_steps

    assert check_steps([3, 5], ["Tile 1 is 3.", "Tile 2 is 5.", "3 + 5 = 8."], "8") == [True, True, True]
    # misread tile 2: that step and all after it are off track, even though 3 + 6 = 9 is true
    assert check_steps([3, 5], ["Tile 1 is 3.", "Tile 2 is 6.", "3 + 6 = 9."], "9") == [True, False, False]
    assert check_steps([3, 5], ["Tile 1 is 3.", "Tile 2 is 5.", "3 + 5 = 9."], "9") == [True, True, False]
    assert check_steps([3, 5], ["Tile 1 is 3.", "Tile 2 is 5.", "3 + 5 = 8."], "7") == [True, True, False]
    assert check_steps([3, 5], ["Tile 1 is 3.", "garbled"]) == [True, False]
    # skipping tile 3: every line is true, but the answer is off track
    assert check_steps([7, 8, 8], ["Tile 1 is 7.", "Tile 2 is 8.", "7 + 8 = 15."], "15", gold="23") == [
        True,
        True,
        False,
    ]
    assert check_steps([7, 8], ["Tile 1 is 7.", "Tile 2 is 8.", "7 + 8 = 15."], "15", gold="15") == [True] * 3
    assert (
        check_steps(
            [2, 9, 4],
            ["Tile 1 is 2.", "Tile 2 is 9.", "Tile 3 is 4.", "The largest is 9.", "The smallest is 2.", "9 - 2 = 7."],
            "7",
        )
        == [True] * 6
    )


def test_check_steps_running_total_hand_cases():
    from mmprm.data.synthetic import check_steps

    gold = ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 3 + 5 = 8.", "Tile 3 is 2. Total 8 + 2 = 10."]
    assert check_steps([3, 5, 2], gold, "10", gold="10") == [True, True, True]
    # misread tile 2: the read is wrong though the sum on that line is true
    assert check_steps(
        [3, 5, 2],
        ["Tile 1 is 3. Total 3.", "Tile 2 is 6. Total 3 + 6 = 9.", "Tile 3 is 2. Total 9 + 2 = 11."],
        "11",
        gold="10",
    ) == [True, False, False]
    # a slip in the sum, and a carried total that is not the previous one
    assert check_steps([3, 5, 2], ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 3 + 5 = 9."]) == [True, False]
    assert check_steps([3, 5, 2], ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 4 + 5 = 9."]) == [True, False]
    # a skipped tile, or a first total that is not the tile
    assert check_steps([3, 5, 2], ["Tile 1 is 3. Total 3.", "Tile 3 is 2. Total 3 + 2 = 5."]) == [True, False]
    assert check_steps([3, 5], ["Tile 1 is 3. Total 4."]) == [False]


def test_running_sum_is_opt_in_and_its_gold_solutions_check():
    from mmprm.data.synthetic import check_steps

    assert "running_sum" not in DEFAULT_TEMPLATES
    problems = generate(SyntheticConfig(num_problems=50, seed=4, templates=("running_sum",), max_ops=4))
    assert {len(p.steps) for p in problems} == {2, 3, 4}
    for p in problems:
        assert len(p.steps) == len(p.meta["tiles"]) and p.answer == str(sum(p.meta["tiles"]))
        assert all(check_steps(p.meta["tiles"], p.steps, p.answer, gold=p.answer))


def test_running_total_slips_like_running_sum_and_states_the_slipped_total():
    from mmprm.data.synthetic import _running_total, add_slips, check_steps

    assert _running_total([3, 5, 2], slips={3: 1}) == (
        [
            "Tile 1 is 3. Total 3.",
            "Tile 2 is 5. Total 3 + 5 = 8.",
            "Tile 3 is 2. Total 9 + 2 = 11.",
            "The total is 11.",
        ],
        11,
    )
    problems = generate(SyntheticConfig(num_problems=200, seed=4, templates=("running_total",), max_ops=5))
    assert {len(p.steps) for p in problems} == {3, 4, 5}
    for p in problems:
        assert all(check_steps(p.meta["tiles"], p.steps, p.answer, gold=p.answer))
    for q in add_slips(problems, rate=1.0, seed=1):
        (k,) = q.meta["slip_steps"]
        assert q.steps[-1] == f"The total is {q.answer}." and q.answer != q.meta["gold_answer"]
        assert check_steps(q.meta["tiles"], q.steps) == [i < k - 1 for i in range(len(q.steps))]


def test_running_digit_checks_the_kept_digit_and_slips_to_another_digit():
    from mmprm.data.synthetic import add_slips, step_verdicts

    tiles = [7, 5, 9, 6]
    gold, _ = TEMPLATES["running_digit"].solve(tiles)
    assert step_verdicts(tiles, gold, "7", gold="7") == ["right"] * 5
    # a false sum, a wrong kept digit, a kept digit miscopied into the next line
    for line, kind in [
        ("Tile 2 is 5. Total 7 + 5 = 13, keep 3.", "arithmetic"),
        ("Tile 2 is 5. Total 7 + 5 = 12, keep 1.", "arithmetic"),
        ("Tile 2 is 5. Total 7 + 5 = 12, keep 2.", "right"),
    ]:
        assert step_verdicts(tiles, [gold[0], line])[1] == kind, line
    assert step_verdicts(tiles, [*gold[:2], "Tile 3 is 9. Total 3 + 9 = 12, keep 2."]) == ["right", "right", "carry"]
    # the whole total carried on instead of its last digit is a miscopy
    assert step_verdicts(tiles, [*gold[:2], "Tile 3 is 9. Total 12 + 9 = 21, keep 1."])[-1] == "carry"
    problems = generate(SyntheticConfig(num_problems=200, seed=4, templates=("running_digit",), max_ops=5))
    for p in problems:
        assert p.answer == str(sum(p.meta["tiles"]) % 10)
        assert step_verdicts(p.meta["tiles"], p.steps, p.answer, gold=p.answer) == ["right"] * len(p.steps)
    for q in add_slips(problems, rate=1.0, seed=1):
        (k,) = q.meta["slip_steps"]
        carried = int(q.steps[k - 1].split("Total ")[1].split(" ")[0])
        assert 0 <= carried <= 9 and q.answer != q.meta["gold_answer"]
        assert step_verdicts(q.meta["tiles"], q.steps)[k - 2 : k] == ["right", "carry"]


def test_slipped_solutions_miscopy_running_totals_and_go_on_from_what_they_wrote(tmp_path):
    from mmprm.data.synthetic import _running_sum, add_slips, check_steps

    # hand case: tiles 3, 5, 2; step 3 carries 8 + 1 = 9 and goes on from it
    assert _running_sum([3, 5, 2], slips={3: 1}) == (
        ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 3 + 5 = 8.", "Tile 3 is 2. Total 9 + 2 = 11."],
        11,
    )

    problems = generate(SyntheticConfig(num_problems=600, seed=4, templates=("running_sum",), max_ops=4))
    slipped = add_slips(problems, rate=1.0, seed=1)
    for p, q in zip(problems, slipped):
        tiles = p.meta["tiles"]
        (k,) = q.meta["slip_steps"]  # one slip per slipped solution
        assert 2 <= k <= len(tiles) and q.meta["gold_answer"] == p.answer and q.steps[: k - 1] == p.steps[: k - 1]
        written = tiles[0]
        for i, step in enumerate(q.steps[1:], start=2):
            carried, x, result = map(int, re.search(r"Total (\d+) \+ (\d+) = (\d+)", step).groups())
            # the slip's carried total is 1-3 off what the step before wrote; every other one is
            # copied; the sum on the line is always true, so the solution goes on from the slip
            off = carried - written
            assert (1 <= abs(off) <= 3 and carried >= 0) if i == k else off == 0
            assert x == tiles[i - 1] and result == carried + x
            written = result
        assert q.answer == str(written) != p.answer
        assert check_steps(tiles, q.steps) == [i < k - 1 for i in range(len(tiles))]
    assert {q.meta["slip_steps"][0] for q in slipped} == {2, 3, 4}  # every carry can slip

    # a share `rate` of the solutions slips, reproducibly; rate 0 and other templates are left alone
    some = add_slips(problems, rate=0.2, seed=2)
    assert 0.15 < sum("slip_steps" in q.meta for q in some) / len(problems) < 0.25
    assert add_slips(problems, 0.2, seed=2) == some
    assert add_slips(problems, 0.0) == problems
    others = generate(SyntheticConfig(num_problems=20, seed=4))
    assert add_slips(others, 1.0) == others
    with pytest.raises(ValueError, match="slip_rate"):
        add_slips(problems, 1.5)

    # written out: the SFT row is the slipped solution, the problem keeps its gold answer and the
    # step-labelled rows mark the first slip and everything after it wrong
    write_split(some[:40], tmp_path, "train")
    rows = zip(
        some,
        read_jsonl(tmp_path / "train_sft.jsonl"),
        read_jsonl(tmp_path / "train_problems.jsonl"),
        read_jsonl(tmp_path / "train_gold_steps.jsonl"),
    )
    for q, sft, prob, gold in rows:
        assert sft["steps"] == q.steps and sft["answer"] == q.answer
        assert prob["answer"] == gold["answer"] == q.meta.get("gold_answer", q.answer)
        first = q.meta.get("slip_steps", [len(q.steps) + 1])[0]
        assert gold["labels"] == [float(i < first - 1) for i in range(len(q.steps))]


def test_step_verdicts_name_the_kind_of_the_first_error():
    from mmprm.data.synthetic import ERROR_KINDS, check_steps, step_verdicts

    tiles = [3, 5, 2]
    good = ["Tile 1 is 3. Total 3.", "Tile 2 is 5. Total 3 + 5 = 8.", "Tile 3 is 2. Total 8 + 2 = 10."]
    assert step_verdicts(tiles, good, "10", gold="10") == ["right"] * 3
    cases = {  # (which step is replaced, by what) -> verdicts
        (1, "Tile 2 is 5. Total 4 + 5 = 9."): ["right", "carry", "after"],  # miscopied total
        (1, "Tile 2 is 5. Total 3 + 6 = 9."): ["right", "carry", "after"],  # miscopied digit
        (1, "Tile 2 is 5. Total 3 + 5 = 9."): ["right", "arithmetic", "after"],
        (1, "Tile 2 is 6. Total 3 + 6 = 9."): ["right", "misread", "after"],
        (1, "Tile 3 is 2. Total 3 + 2 = 5."): ["right", "order", "after"],  # skips tile 2
        (0, "Tile 1 is 3. Total 4."): ["arithmetic", "after", "after"],
        (1, "Tile 2 is 5. Total 8."): ["right", "carry", "after"],  # drops the carried total
        (2, "Tile 3 is two."): ["right", "right", "unparsed"],
    }
    for (k, step), verdicts in cases.items():
        steps = good[:k] + [step] + good[k + 1 :]
        assert step_verdicts(tiles, steps) == verdicts, step
        assert check_steps(tiles, steps) == [v == "right" for v in verdicts]
    # the answer: every line holds, yet it is not the last result, or not the gold answer
    assert step_verdicts(tiles, good, "11") == ["right", "right", "answer"]
    assert step_verdicts(tiles[:2], good[:2], "8", gold="10") == ["right", "answer"]
    # other templates: a false sum, an operand no line established, a misread extreme
    assert step_verdicts([4, 2], ["Tile 1 is 4.", "Tile 2 is 2.", "4 + 2 = 7."]) == ["right", "right", "arithmetic"]
    assert step_verdicts([4, 2], ["Tile 1 is 4.", "Tile 2 is 2.", "4 + 3 = 7."]) == ["right", "right", "carry"]
    assert step_verdicts([4, 2], ["Tile 1 is 4.", "Tile 2 is 2.", "The largest is 2."])[-1] == "misread"
    # running_total's last step states the last total: another number is a miscopy
    stated = [*good, "The total is 10."]
    assert step_verdicts(tiles, stated, "10", gold="10") == ["right"] * 4
    assert step_verdicts(tiles, [*good, "The total is 11."], "11") == ["right"] * 3 + ["carry"]
    slipped = [good[0], "Tile 2 is 5. Total 4 + 5 = 9.", "Tile 3 is 2. Total 9 + 2 = 11.", "The total is 11."]
    assert step_verdicts(tiles, slipped) == ["right", "carry", "after", "after"]
    assert set(ERROR_KINDS) >= {v for case in cases.values() for v in case} - {"right", "after"}


def test_gold_solutions_check_as_all_correct():
    from mmprm.data.synthetic import SyntheticConfig, check_steps, generate

    for p in generate(SyntheticConfig(num_problems=200, seed=3)):
        assert all(check_steps(p.meta["tiles"], p.steps, p.answer)), (p.question, p.steps)


def test_labelled_examples_plant_exactly_the_first_error(tmp_path):
    from mmprm.data.schema import load_examples, write_jsonl
    from mmprm.data.synthetic import SyntheticConfig, check_steps, generate, labelled_examples, write_split

    probs = generate(SyntheticConfig(num_problems=60, seed=5))
    write_split(probs, tmp_path, "train")
    rows = labelled_examples(probs, "train", seed=5)
    write_jsonl(tmp_path / "train_labelled.jsonl", rows)
    ex = load_examples(tmp_path / "train_labelled.jsonl", require_labels=True)
    assert len(ex) == 60
    n_err = 0
    for p, r in zip(probs, rows):
        truth = [1.0 if ok else 0.0 for ok in check_steps(p.meta["tiles"], r["steps"])]
        assert truth == r["labels"], (r["steps"], r["labels"])
        n_err += 0.0 in r["labels"]
    assert 15 < n_err < 45
