"""The PRM as a GRPO reward: TRL's reward-function form, batched scoring, and a tiny GRPO run."""

from __future__ import annotations

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
