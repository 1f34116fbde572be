"""The PRM as a GRPO reward: TRL's reward-function form, batched scoring, and a tiny GRPO run."""

from __future__ import annotations

import math

import pytest

from mmprm.search.reward import PRMReward, completion_text


class ScriptedPRM:
    def __init__(self, table: dict[str, float]):
        self.table, self.batches = table, []

    def score(self, examples):
        self.batches.append(examples)
        return [[self.table.get(s, 0.5) for s in ex["steps"]] for ex in examples]


def test_reward_parses_steps_attaches_the_answer_and_aggregates():
    prm = ScriptedPRM({"a": 0.9, "b\n<answer>3</answer>": 0.2, "c\n<answer>4</answer>": 0.8})
    reward = PRMReward(prm, aggregator="min", empty_reward=-1.0)
    completions = [
        "<step>a</step>\n<step>b</step>\n<answer>3</answer>",
        [{"role": "assistant", "content": "<step>a</step>\n<step>c</step>\n<answer>4</answer>"}],
        "no steps here",
    ]
    out = reward(
        prompts=["q1", "q1", "q2"],
        completions=completions,
        completion_ids=None,
        question=["Q", "Q", "Q2"],
        images=[["x.png"], ["x.png"], []],
        trainer_state=None,
    )
    assert out == pytest.approx([0.2, 0.8, -1.0])
    assert len(prm.batches) == 1 and [ex["steps"] for ex in prm.batches[0]] == [
        ["a", "b\n<answer>3</answer>"],
        ["a", "c\n<answer>4</answer>"],
    ]
    assert prm.batches[0][0]["images"] == ["x.png"] and reward.__name__ == "prm_min"
    # no question column: the last user message of a conversational prompt is the question
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "Add."}]}]
    PRMReward(prm, aggregator="last")(prompts=[prompt], completions=["<step>a</step>"])
    assert prm.batches[-1][0]["question"] == "Add." and completion_text("x") == "x"
    with pytest.raises(ValueError, match="aggregator"):
        PRMReward(prm, aggregator="mean")


class CuttingPRM(ScriptedPRM):
    """A scorer whose context holds `fits` steps: later ones come back NaN, as PRMScorer's do."""

    def __init__(self, table: dict[str, float], fits: int):
        super().__init__(table)
        self.fits = fits

    def score(self, examples):
        return [[p if k < self.fits else float("nan") for k, p in enumerate(row)] for row in super().score(examples)]


def test_a_completion_the_prm_cut_gets_the_lowest_reward():
    # Completion 0's third step does not fit: on its prefix `last` would read its middle step b (0.9)
    # and beat completion 1 (last step 0.3); it gets empty_reward instead, below every complete one.
    prm = CuttingPRM({"a": 0.6, "b": 0.9, "c\n<answer>1</answer>": 0.05, "d\n<answer>2</answer>": 0.3}, fits=2)
    comps = [
        "<step>a</step><step>b</step><step>c</step><answer>1</answer>",
        "<step>a</step><step>d</step><answer>2</answer>",
    ]
    for aggregator, complete in (("last", 0.3), ("min", 0.3), ("average", 0.45)):
        reward = PRMReward(prm, aggregator=aggregator)
        assert reward(prompts=["p", "p"], completions=comps) == pytest.approx([0.0, complete]), aggregator
        assert reward.truncated == 1
    # Log-scale aggregators have no floor: an empty or cut completion's reward must be given.
    with pytest.raises(ValueError, match="'sum_logpr' scores completions on an unbounded log scale: give empty_reward"):
        PRMReward(prm, aggregator="sum_logpr")
    reward = PRMReward(prm, aggregator="sum_logpr", empty_reward=-100.0)
    assert reward(prompts=["p", "p"], completions=comps) == pytest.approx([-100.0, math.log(0.6) + math.log(0.3)])


def test_reward_scores_with_a_real_prm_sharing_the_prompt(tiny_models):
    from PIL import Image

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    scorer = PRMScorer(build_prm(backbone, processor, PRMSpec()), processor)
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    reward = PRMReward(scorer)
    comps = ["<step>Tile 1 is 1.</step>\n<answer>1</answer>", "<step>Tile 1 is 2.</step>\n<answer>2</answer>"]
    got = reward(prompts=["p", "p"], completions=comps, question=["Read tile 1."] * 2, image=[image, image])
    plain = [
        min(p)
        for p in scorer.score(
            [
                {
                    "question": "Read tile 1.",
                    "images": [image],
                    "steps": [c.split("</step>")[0][6:] + "\n" + c.split("\n")[1]],
                }
                for c in comps
            ],
            share_prefix=False,
        )
    ]
    assert got == pytest.approx(plain, abs=1e-5) and all(0.0 < r < 1.0 for r in got)


def test_a_real_prm_cut_at_max_length_gives_the_lowest_reward(tiny_models):
    """A real PRMScorer whose max_length holds the short completion but not the long one's steps."""
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    backbone, processor = load_backbone(tiny_models("qwen2"))
    prm = build_prm(backbone, processor, PRMSpec())
    short = "<step>One.</step>\n<answer>1</answer>"
    long = "<step>One.</step>\n" + "<step>More words here, and more.</step>\n" * 6 + "<answer>1</answer>"
    ex = {"question": "Q", "images": [], "steps": ["One.\n<answer>1</answer>"]}
    fits = len(PRMScorer(prm, processor).tokenize(ex).input_ids)
    scorer = PRMScorer(prm, processor, max_length=fits + 8)
    reward = PRMReward(scorer, aggregator="last")
    got = reward(prompts=["Q", "Q"], completions=[long, short], question=["Q", "Q"])
    assert got[0] == 0.0 and 0.0 < got[1] < 1.0 and reward.truncated == 1


@pytest.mark.slow
def test_tiny_grpo_run_with_the_prm_reward(tiny_models, tmp_path):
    """GRPOTrainer (trl, CPU) takes the PRM reward and runs a few optimizer steps on a tiny policy."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    policy, tokenizer = load_backbone(tiny_models("qwen2"))
    prm_backbone, prm_tok = load_backbone(tiny_models("qwen2"))
    # blank_lines: a random policy writes no <step> tags, but its text is still a step to score, so the
    # rewards of a group differ and GRPO has an advantage to follow.
    reward = PRMReward(
        PRMScorer(build_prm(prm_backbone, prm_tok, PRMSpec()), prm_tok), aggregator="min", step_mode="blank_lines"
    )
    questions = ["What is 2 + 3?", "What is 4 + 1?"] * 4
    ds = Dataset.from_list([{"prompt": q, "question": q} for q in questions])
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=policy, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tokenizer
    )
    before = {k: v.clone() for k, v in policy.named_parameters() if v.requires_grad}
    trainer.train()
    assert reward.calls >= 2
    logged = [h for h in trainer.state.log_history if "rewards/prm_min/mean" in h]
    assert logged and any(float(h["reward_std"]) > 0 for h in logged), trainer.state.log_history
    assert any(not (v == before[k]).all() for k, v in policy.named_parameters() if k in before)
