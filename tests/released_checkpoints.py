"""Tiny checkpoints shaped like released PRMs, and their authors' scoring procedures.

Each builder writes a random-init HF directory of the released model's shape (architecture class,
special tokens, tokenizer kind, chat template); each `*_authors` function is that PRM's published
scoring procedure, re-expressed from its model card or repository, run on such a directory:
- Math-Shepherd (peiyi9979/math-shepherd-mistral-7b-prm): Mistral with a sentencepiece-style
  tokenizer; "question step ки\\nstep ки", softmax over the "+"/"-" logits at each "ки".
- Qwen2.5-Math-PRM (Qwen/Qwen2.5-Math-PRM-7B): `Qwen2ForProcessRewardModel`, a Qwen2 decoder with a
  linear-ReLU-linear two-class head; the chat template with its system prompt, steps joined by
  `<extra_0>`, softmax class 1 at each `<extra_0>`.
- RLHFlow (RLHFlow/Llama3.1-8B-PRM-Deepseek-Data): Llama 3.1 and its real chat template; each step a
  user turn answered "+", one forward per step prefix, the "+"/"-" logits at index -3.
Used by tests/test_released_prms.py (HF) and tests/test_vllm_scorer.py (vLLM tier, head_dim 64).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from template_families import family_tokenizer, text_model
from torch import nn

from mmprm.models.tiny import _corpus

QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"
SOLUTIONS = [
    ["He starts with 3 apples.", "3 + 5 = 8.", "The answer is 8."],
    ["He starts with 3 apples.", "3 + 5 = 9.", "The answer is 9."],
    ["3 * 5 = 15.", "The answer is 15."],
    ["He buys 5 more, so 3 + 5 = 8 apples in total."],
]
OTHER = ("What is 12 / 4?", ["12 / 4 = 3.", "The answer is 3."])
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def examples() -> list[dict]:
    """Candidates sharing one question (scored as a group) and a single other problem."""
    rows = [{"id": f"a{i}", "question": QUESTION, "steps": s} for i, s in enumerate(SOLUTIONS)]
    return [*rows, {"id": "b", "question": OTHER[0], "steps": OTHER[1]}]


def released_model(arch: str, tok, head_dim: int):
    """A tiny decoder of `arch` with two heads of `head_dim` and one KV head (vLLM takes head_dim 64)."""
    return text_model(arch, tok, hidden_size=2 * head_dim, heads=2, kv_heads=1)


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


def build_math_shepherd(out: Path, head_dim: int = 16) -> Path:
    tok = sentencepiece_style_tokenizer()
    released_model("mistral", tok, head_dim).save_pretrained(out)
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


# ---- Qwen2.5-Math-PRM ------------------------------------------------------------------------


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


def build_qwen_math_prm(out: Path, head_dim: int = 16) -> tuple[Path, nn.Module]:
    """The directory and the model in memory (the authors' procedure runs their class)."""
    tok = family_tokenizer("qwen2_5_instruct")
    tok.add_tokens(["<extra_0>"], special_tokens=True)
    lm = released_model("qwen2", tok, head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = qwen_process_reward_model_class()(lm.config).eval()
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


# ---- RLHFlow ---------------------------------------------------------------------------------


def build_rlhflow(out: Path, head_dim: int = 16) -> Path:
    tok = family_tokenizer("llama3_1_instruct")
    released_model("llama", tok, head_dim).save_pretrained(out)
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
