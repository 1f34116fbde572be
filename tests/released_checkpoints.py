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
- MM-PRM (Cierra0506/MM-PRM-8B) and VisualPRM (OpenGVLab/VisualPRM-8B): InternVL chat models, here
  in transformers' `InternVLForConditionalGeneration` format (what `mmprm convert-internvl` writes)
  with InternVL's tokens and `<prm>`; the prompts their remote code builds (MM-PRM's `prm()`,
  VisualPRM's `generate_steps_with_soft_score()`), written out as strings, images expanded as
  `<img>` + `<IMG_CONTEXT>` x tokens-per-tile x tiles + `</img>`.
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


# ---- InternVL PRMs: MM-PRM, VisualPRM ---------------------------------------------------------

# InternVL's "internvl2_5" conversation template: its system message and its MPT-style turns.
INTERNVL_SYSTEM_MESSAGE = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)


def figure():
    """A 100x60 figure: two tiles and a thumbnail at the tiny processor's 56 px."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(60, 100, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels)


def image_examples() -> list[dict]:
    """The text examples with one figure for the first question's candidates."""
    image = figure()
    return [{**r, "images": [image]} if r["question"] == QUESTION else r for r in examples()]


def build_internvl_prm(out: Path, head_dim: int | None = None, vllm_ready: bool = False) -> Path:
    """A tiny InternVL3-format checkpoint shaped as MM-PRM's and VisualPRM's (`as_internvl_prm`).
    `head_dim` and `vllm_ready` as `mmprm.models.tiny.build_tiny_model` takes them (the vLLM tier)."""
    from template_families import family_tokenizer

    from mmprm.models.tiny import HEAD_DIM, build_tiny_model

    tok = family_tokenizer("internvl3_hf")
    build_tiny_model("internvl", out, seed=0, head_dim=head_dim or HEAD_DIM, vllm_ready=vllm_ready, tokenizer=tok)
    return as_internvl_prm(out)


def as_internvl_prm(out: Path) -> Path:
    """The InternVL checkpoint in `out` given what MM-PRM's and VisualPRM's prompts read: `<prm>`
    added as a special token (as MM-PRM's training adds it), "Yes" and "No" single tokens, and
    ImageNet's statistics for the tiles (InternVL's, which its converted checkpoints carry)."""
    from transformers import InternVLForConditionalGeneration

    from mmprm.models.loading import load_processor

    processor = load_processor(out)
    processor.image_processor.image_mean = list(IMAGENET_MEAN)
    processor.image_processor.image_std = list(IMAGENET_STD)
    processor.tokenizer.add_tokens(["<prm>"], special_tokens=True)
    processor.tokenizer.add_tokens(["Yes", "No"])
    model = InternVLForConditionalGeneration.from_pretrained(out)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def internvl_tiles(image, tile: int, max_num: int, min_num: int = 1) -> list:
    """InternVL's `dynamic_preprocess`: the tile grid (columns, rows) of at most `max_num` tiles
    whose aspect ratio is closest to the image's (on a tie the later grid, if the image has more
    than half its pixels), the image resized to it and cut row by row, then a thumbnail."""
    width, height = image.size
    grids = sorted(
        {
            (i, j)
            for n in range(min_num, max_num + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_num <= i * j <= max_num
        },
        key=lambda g: g[0] * g[1],
    )
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(width / height - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    cols, rows = best
    resized = image.resize((tile * cols, tile * rows))
    tiles = [
        resized.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)
    ]
    return tiles + [image.resize((tile, tile))] if len(tiles) > 1 else tiles


def internvl_pixel_values(image, tile: int, max_num: int) -> torch.Tensor:
    """InternVL's `load_image`: the tiles as floats in [0, 1], normalized by ImageNet's statistics."""
    import numpy as np

    tiles = [
        torch.from_numpy(np.asarray(t.convert("RGB"), dtype=np.float32) / 255.0)
        for t in internvl_tiles(image, tile, max_num)
    ]
    x = torch.stack(tiles).permute(0, 3, 1, 2)
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def _internvl_inputs(path, query: str, images: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """InternVL's own image handling: each image tiled (`internvl_pixel_values`, the checkpoint's
    tile size and tile limit) and its `<image>` written as `<img>`, `<IMG_CONTEXT>` x tokens per
    tile x tiles, `</img>`; the tokenizer then runs on the whole string."""
    from transformers import AutoTokenizer, InternVLConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    pixel_values = None
    if images:
        config = InternVLConfig.from_pretrained(path)
        settings = json.loads((Path(path) / "processor_config.json").read_text())["image_processor"]
        per_image = [internvl_pixel_values(im, settings["size"]["height"], settings["max_patches"]) for im in images]
        pixel_values = torch.cat(per_image)
        for tiles in per_image:
            context = "<IMG_CONTEXT>" * (config.image_seq_length * len(tiles))
            query = query.replace("<image>", f"<img>{context}</img>", 1)
    return tokenizer(query, return_tensors="pt")["input_ids"], pixel_values


def mm_prm_authors(path, question: str, steps: list[str], images: list = ()) -> list[float]:
    """MM-PRM's `prm()`: "Question: ...\nProcess: " and the steps joined by `<prm>` (one after the
    last), "<image>\n" before it, as the assistant's message after an empty user message (which
    the MPT template leaves without its `<|im_end|>`); softmax over the "Yes"/"No" logits at every
    `<prm>`, the "Yes" share."""
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = InternVLForConditionalGeneration.from_pretrained(path).eval()
    message = f"Question: {question}\nProcess: " + "<prm>".join(steps) + "<prm>"
    if images:
        message = "<image>\n" + message
    query = (
        f"<|im_start|>system\n{INTERNVL_SYSTEM_MESSAGE}<|im_end|>\n"
        "<|im_start|>user\n"  # the empty user message: role only
        f"<|im_start|>assistant\n{message}<|im_end|>\n"
    )
    input_ids, pixel_values = _internvl_inputs(path, query, list(images))
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixel_values).logits
    selected = logits[input_ids == tokenizer.convert_tokens_to_ids("<prm>")]
    selected = selected[:, tokenizer.convert_tokens_to_ids(["Yes", "No"])]
    return selected.softmax(dim=-1)[:, 0].tolist()


def visualprm_authors(path, question: str, steps: list[str], images: list = ()) -> list[float]:
    """VisualPRM's `generate_steps_with_soft_score()`: one forward per step; the first user message
    is "### Question:\n<image>\n{question}\n\n### Solution Process:\n{step}", each later step a
    user message, every earlier one answered "+"; the "+"/"-" logits at the last token of the
    prompt, the "+" share."""
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = InternVLForConditionalGeneration.from_pretrained(path).eval()
    candidates = tokenizer.convert_tokens_to_ids(["+", "-"])
    if images:
        question = "<image>\n" + question
    history, scores = [], []
    for k, step in enumerate(steps):
        if k == 0:
            step = f"### Question:\n{question}\n\n### Solution Process:\n{step}"
        query = f"<|im_start|>system\n{INTERNVL_SYSTEM_MESSAGE}<|im_end|>\n"
        for asked, answered in history:
            query += f"<|im_start|>user\n{asked}<|im_end|>\n<|im_start|>assistant\n{answered}<|im_end|>\n"
        query += f"<|im_start|>user\n{step}<|im_end|>\n<|im_start|>assistant\n"
        input_ids, pixel_values = _internvl_inputs(path, query, list(images))
        with torch.no_grad():
            logits = model(input_ids=input_ids, pixel_values=pixel_values).logits[:, -1, candidates]
        scores.append(logits.softmax(dim=-1)[0, 0].item())
        history.append((step, "+"))
    return scores


# ---- InternLM2's tokenizer (MM-PRM-8B, VisualPRM-8B) ------------------------------------------

# Where InternLM2's chat tokens stand: pieces of the sentencepiece model that tokenizer_config.json
# renames (InternLM2's [UNUSED_TOKEN_145] and [UNUSED_TOKEN_146]).
INTERNLM2_CHAT_TOKENS = {"[UNUSED_TOKEN_145]": "<|im_end|>", "[UNUSED_TOKEN_146]": "<|im_start|>"}
INTERNVL_ADDED_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]
# Text beyond the tiny corpus: Chinese (InternLM2's other language), full-width letters (user-defined
# pieces in InternLM2's model), characters rare enough to fall back to bytes.
WIDER_TEXT = [
    "你好，世界。这是一个测试：三角形的面积是多少？",
    "如图所示，圆的半径为 5 厘米，求周长。答案是 10π 厘米。",
    "ＡＢＣ ｘ＋ｙ＝１０",
    "Café naïve façade ∑ ∫ √2 ≤ ≥ ∞ 🙂 ⅔",
]


def internlm2_style_sentencepiece() -> bytes:
    """A sentencepiece BPE trained here with the settings InternLM2's released tokenizer.model
    holds (BPE, byte fallback, split digits, identity normalization, extra whitespace kept, no
    dummy prefix), and user-defined pieces where InternLM2 has them (its chat tokens, full-width
    letters)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([*_corpus(1500), *WIDER_TEXT * 20]),
        model_writer=model,
        vocab_size=900,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=0.999,
        user_defined_symbols=[*INTERNLM2_CHAT_TOKENS, "Ａ", "Ｂ"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def write_internlm2_tokenizer(out: Path) -> Path:
    """`out/tokenizer.model` and the tokenizer_config.json InternVL2.5-8B ships with it: chat
    tokens renamed in place, InternVL's tokens after the vocabulary, BOS added, `</s>` padding."""
    from mmprm.models.sentencepiece_bpe import parse_model

    model = internlm2_style_sentencepiece()
    pieces = [p for p, _, _ in parse_model(model).pieces]
    added = {0: "<unk>", 1: "<s>", 2: "</s>"}
    added |= {pieces.index(piece): token for piece, token in INTERNLM2_CHAT_TOKENS.items()}
    added |= {len(pieces) + i: token for i, token in enumerate(INTERNVL_ADDED_TOKENS)}
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in sorted(added.items())
        },
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "pad_token": "</s>",
        "tokenizer_class": "InternLM2Tokenizer",
        "unk_token": "<unk>",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def build_internlm2_internvl_prm(out: Path, head_dim: int = 16, vllm_ready: bool = False) -> Path:
    """A tiny InternVL as MM-PRM-8B and VisualPRM-8B convert: a Llama language model with grouped
    key/value heads (4 query heads over 2, InternLM2's shape), and the InternLM2-style tokenizer
    rebuilt from its sentencepiece file by `mmprm convert-internvl`'s own loader (the file stays
    beside), then `as_internvl_prm`."""
    from mmprm.models.internvl_convert import CHAT_TEMPLATE, internvl_tokenizer
    from mmprm.models.tiny import _internvl_model, _internvl_processor

    tok = internvl_tokenizer(write_internlm2_tokenizer(out), None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _internvl_model(tok, hidden_size=4 * head_dim, num_layers=2, head_dim=head_dim, text_model="llama")
    model.save_pretrained(out)
    _internvl_processor(tok, CHAT_TEMPLATE, vllm_ready=vllm_ready).save_pretrained(out)
    return as_internvl_prm(out)
