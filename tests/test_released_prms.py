"""Released PRMs load and score as their authors score them.

For each convention in `mmprm.models.spec.RELEASED_CONVENTIONS` a tiny random-init checkpoint of
the released model's shape is built here (its architecture class, special tokens, tokenizer kind and
chat template), and mmprm's scores are compared with the authors' documented scoring procedure,
written out below from their model cards and code, step for step:
- Math-Shepherd (peiyi9979/math-shepherd-mistral-7b-prm): Mistral with a sentencepiece-style
  tokenizer; "question step ки\\nstep ки", softmax over the "+"/"-" logits at each "ки".
- Qwen2.5-Math-PRM (Qwen/Qwen2.5-Math-PRM-7B): `Qwen2ForProcessRewardModel`, a Qwen2 decoder with a
  linear-ReLU-linear two-class head; the chat template with its system prompt, steps joined by
  `<extra_0>`, softmax class 1 at each `<extra_0>`.
- RLHFlow (RLHFlow/Llama3.1-8B-PRM-Deepseek-Data): Llama 3.1 and its real chat template; each step a
  user turn answered "+", one forward per step prefix, the "+"/"-" logits at index -3.
"""

from __future__ import annotations

import json

import pytest
import torch
from template_families import _text_model, family_tokenizer
from torch import nn

from mmprm import load_prm
from mmprm.models.spec import RELEASED_CONVENTIONS
from mmprm.models.tiny import _corpus
from mmprm.steps import StepTokenError

QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"
SOLUTIONS = [
    ["He starts with 3 apples.", "3 + 5 = 8.", "The answer is 8."],
    ["He starts with 3 apples.", "3 + 5 = 9.", "The answer is 9."],
    ["3 * 5 = 15.", "The answer is 15."],
    ["He buys 5 more, so 3 + 5 = 8 apples in total."],
]
OTHER = ("What is 12 / 4?", ["12 / 4 = 3.", "The answer is 3."])


def examples() -> list[dict]:
    """Candidates sharing one question (scored as a group) and a single other problem."""
    rows = [{"id": f"a{i}", "question": QUESTION, "steps": s} for i, s in enumerate(SOLUTIONS)]
    return [*rows, {"id": "b", "question": OTHER[0], "steps": OTHER[1]}]


def assert_scores_equal(ours: list[list[float]], theirs: list[list[float]]) -> None:
    assert [len(s) for s in ours] == [len(s) for s in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), (a, b)


# ---- Math-Shepherd ---------------------------------------------------------------------------


def sentencepiece_style_tokenizer():
    """A tiny BPE shaped like Mistral's sentencepiece tokenizer: "▁" marks a word start (a space
    before the first word too), newlines are their own pieces, BOS is prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        ]
    )
    bpe.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    shepherd = [f"Step {i}: {a} + {b} = {a + b}. ки\n" for i, (a, b) in enumerate(zip(range(50), range(7, 57)))]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator([*_corpus(1500), *shepherd, *["+ - ки"] * 50], trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def math_shepherd_dir(tmp_path_factory):
    tok = sentencepiece_style_tokenizer()
    out = tmp_path_factory.mktemp("math_shepherd")
    _text_model("mistral", tok, tie=False).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def math_shepherd_authors(path, question: str, steps: list[str]) -> list[float]:
    """The model card's procedure: candidate tokens from "+ -", the tag id from "ки"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    candidate_tokens = tokenizer.encode("+ -")[1:]
    step_tag_id = tokenizer.encode("ки")[-1]
    output = "".join(f"{step} ки\n" for step in steps).rstrip("\n")
    input_id = torch.tensor([tokenizer.encode(f"{question} {output}")])
    with torch.no_grad():
        logits = model(input_id).logits[:, :, candidate_tokens]
    scores = logits.softmax(dim=-1)[:, :, 0]
    return scores[input_id == step_tag_id].tolist()


def test_math_shepherd_tokenizer_has_the_released_shape(math_shepherd_dir):
    """What the model card relies on holds for the tiny one too: "+ -" is BOS and two tokens,
    "ки" one token, the same one as after a step."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(math_shepherd_dir)
    assert len(tok.encode("+ -")) == 3 and tok.encode("+ -")[0] == tok.bos_token_id
    assert len(tok.encode("ки", add_special_tokens=False)) == 1
    assert tok.encode("2 = 2. ки", add_special_tokens=False)[-1] == tok.encode("ки")[-1]


def test_math_shepherd_scores_equal_the_authors_procedure(math_shepherd_dir):
    scorer = load_prm(math_shepherd_dir, convention="math_shepherd")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [math_shepherd_authors(math_shepherd_dir, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)
    assert_scores_equal(scorer.score(rows, share_prefix=False), theirs)  # grouping changes nothing


# ---- Qwen2.5-Math-PRM ------------------------------------------------------------------------

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def qwen_process_reward_model_class():
    """The released model's class, as its modeling file defines it: a Qwen2 decoder and a
    linear-ReLU-linear head with two labels, applied to every position."""
    from transformers import Qwen2Model, Qwen2PreTrainedModel

    class Qwen2ForProcessRewardModel(Qwen2PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.model = Qwen2Model(config)
            self.score = nn.Sequential(
                nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, 2)
            )
            self.post_init()

        def forward(self, input_ids, attention_mask=None):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return (self.score(hidden),)

    return Qwen2ForProcessRewardModel


@pytest.fixture(scope="module")
def qwen_math_prm(tmp_path_factory):
    tok = family_tokenizer("qwen2_5_instruct")
    tok.add_tokens(["<extra_0>"], special_tokens=True)
    out = tmp_path_factory.mktemp("qwen_math_prm")
    cls = qwen_process_reward_model_class()
    lm = _text_model("qwen2", tok, tie=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = cls(lm.config).eval()
    model.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        for p in model.score.parameters():  # weights big enough that the two classes differ
            p.normal_(0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"}  # as released
    (out / "config.json").write_text(json.dumps(config))
    return out, model


def qwen_math_authors(model, path, question: str, steps: list[str]) -> list[float]:
    """The model card's procedure: the whole conversation, probabilities of class 1 at <extra_0>."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": QWEN_MATH_SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
    ]
    conversation = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    input_ids = tokenizer.encode(conversation, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=input_ids)[0]
    probabilities = torch.softmax(logits, dim=-1)  # (1, S, 2)
    mask = input_ids == tokenizer.encode("<extra_0>")[0]
    return probabilities[mask][:, 1].tolist()


def test_qwen_math_prm_scores_equal_the_authors_procedure(qwen_math_prm):
    path, model = qwen_math_prm
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForProcessRewardModel"]
    scorer = load_prm(path, convention="qwen2_5_math_prm")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [qwen_math_authors(model, path, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)
    assert scorer.model.spec.system_prompt == QWEN_MATH_SYSTEM


# ---- RLHFlow ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rlhflow_dir(tmp_path_factory):
    tok = family_tokenizer("llama3_1_instruct")
    out = tmp_path_factory.mktemp("rlhflow")
    _text_model("llama", tok, tie=False).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def rlhflow_authors(path, question: str, steps: list[str]) -> list[float]:
    """The repository's procedure: one conversation per step prefix, every step answered "+",
    the "+"/"-" logits at index -3 (the token before the last "+" and <|eot_id|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    candidate_tokens = [tokenizer.encode("+")[-1], tokenizer.encode("-")[-1]]
    conversation, scores = [], []
    for k, step in enumerate(steps):
        conversation.append({"content": question + " " + step if k == 0 else step, "role": "user"})
        conversation.append({"content": "+", "role": "assistant"})
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids).logits[:, -3, candidate_tokens]
        scores.append(logits.softmax(dim=-1)[:, 0].item())
    return scores


def test_rlhflow_scores_equal_the_authors_procedure(rlhflow_dir):
    scorer = load_prm(rlhflow_dir, convention="rlhflow")
    rows = examples()
    ours = scorer.score(rows)
    theirs = [rlhflow_authors(rlhflow_dir, r["question"], r["steps"]) for r in rows]
    assert_scores_equal(ours, theirs)


def test_rlhflow_input_carries_the_templates_default_system_prompt(rlhflow_dir):
    """Llama 3.1's template writes its own system header; the steps are read after it."""
    scorer = load_prm(rlhflow_dir, convention="rlhflow")
    tok = scorer.tokenize({"question": QUESTION, "steps": SOLUTIONS[0]})
    text = scorer.tokenizer.decode(tok.input_ids)
    assert "Cutting Knowledge Date" in text
    assert len(tok.step_positions) == 3
    plus = scorer.tokenizer.encode("+", add_special_tokens=False)[-1]
    assert all(tok.input_ids[p + 1] == plus for p in tok.step_positions[:-1])


# ---- errors ----------------------------------------------------------------------------------


def test_a_released_checkpoint_without_convention_is_refused_naming_the_conventions(rlhflow_dir):
    with pytest.raises(FileNotFoundError, match="convention") as err:
        load_prm(rlhflow_dir)
    assert all(name in str(err.value) for name in RELEASED_CONVENTIONS)


def test_a_wrong_convention_is_refused_before_scoring(rlhflow_dir, math_shepherd_dir):
    with pytest.raises(StepTokenError, match="not one token"):
        load_prm(rlhflow_dir, convention="math_shepherd")  # Llama 3's vocabulary has no "ки" token
    with pytest.raises(ValueError, match="classifier head"):
        load_prm(math_shepherd_dir, convention="qwen2_5_math_prm")  # no score.* weights
    with pytest.raises(ValueError, match="convention: 'visualprm'"):
        load_prm(math_shepherd_dir, convention="visualprm")


def test_released_prms_score_on_hf_only(math_shepherd_dir):
    with pytest.raises(ValueError, match="score the released math_shepherd with 'hf'"):
        load_prm(math_shepherd_dir, convention="math_shepherd", backend="vllm")


# ---- in a recipe -----------------------------------------------------------------------------


def test_bon_rerank_scores_candidates_with_a_released_prm(qwen_math_prm, tmp_path):
    """`scoring.convention` reaches the recipe's scorer: the step scores it writes are the authors'."""
    import importlib.util
    import sys

    from recipe_runs import REPO

    from mmprm.data.schema import read_jsonl
    from mmprm.rerank.candidates import Candidate, Problem, write_candidates

    path, model = qwen_math_prm
    problems = [
        Problem(
            id="p0",
            question=QUESTION,
            answer="8",
            candidates=[
                Candidate(text=None, steps=SOLUTIONS[0], answer="8", correct=True),
                Candidate(text=None, steps=SOLUTIONS[1], answer="9", correct=False),
            ],
        )
    ]
    write_candidates(tmp_path / "c.jsonl", problems)
    spec = importlib.util.spec_from_file_location("bon_rerank_released", REPO / "recipes" / "bon_rerank.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.main(
        [
            "--config",
            str(REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml"),
            f"prm={path}",
            "scoring.convention=qwen2_5_math_prm",
            f"candidates_file={tmp_path / 'c.jsonl'}",
            f"output_dir={tmp_path / 'out'}",
            "report.resamples=10",
        ]
    )
    (row,) = read_jsonl(tmp_path / "out" / "scored.jsonl")
    ours = [c["step_probs"] for c in row["candidates"]]
    theirs = [qwen_math_authors(model, path, QUESTION, c.steps) for c in problems[0].candidates]
    assert_scores_equal(ours, theirs)
