"""Tiny random-init presets of every supported backbone, for tests and CPU demos.

    path = build_tiny_model("qwen2_5_vl", "runs/tiny/qwen2_5_vl", seed=0)
    model, processor = mmprm.models.load_backbone(path)     # same call as for a real checkpoint

Each preset is the REAL architecture class built from a small config (by default hidden 64,
2 layers; `hidden_size` / `num_layers` scale the language model for demos; a 2-layer vision tower
on 28-56 px images), saved with `save_pretrained` beside a byte-level BPE
tokenizer trained here on a built-in corpus, the arch's special tokens, a ChatML chat template and
the processor. Nothing is downloaded. mmprm's own STEP_TOKEN is deliberately absent: adding it is
`add_step_token`'s job at train time, and tests must see that step happen.

| arch       | model class                        | image tokens per image                        |
| ---------- | ---------------------------------- | --------------------------------------------- |
| qwen2_vl   | Qwen2VLForConditionalGeneration    | 1-4 (resized to 28*28..56*56 px, aspect kept) |
| qwen2_5_vl | Qwen2_5_VLForConditionalGeneration | 1-4 (same image processor)                    |
| internvl   | InternVLForConditionalGeneration   | 4 per 56 px tile; 1-4 tiles (+ thumbnail)     |
| llava      | LlavaForConditionalGeneration      | 16 (CLIP at 56 px, CLS dropped)               |
| qwen2      | Qwen2ForCausalLM (text only)       | -                                             |

For vLLM, build with `head_dim=64, vllm_ready=True` (`mmprm tiny-model --vllm`): vLLM's attention
kernels refuse 16-dim heads, and it loads the standard processor, video processor included (which
needs torchvision, so the vLLM-ready variant builds only where torchvision imports).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2")
# Archs whose standard processor carries a video processor (saved only by the vLLM-ready variant).
IMAGE_ONLY_ARCHS = ("qwen2_vl", "qwen2_5_vl", "internvl")

VOCAB_SIZE = 1024
# Language-model heads are 16 dims by default (hidden 64 -> 4 heads, 128 -> 8); vLLM needs 64.
HEAD_DIM = 16
VLLM_HEAD_DIM = 64


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen's M-RoPE (temporal, height, width) split of head_dim / 2 rotary pairs: [2, 3, 3] per 16 dims."""
    return [2 * head_dim // 16, 3 * head_dim // 16, 3 * head_dim // 16]


_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Named multimodal tokens each arch's processor reads from its tokenizer (tokenizer.<name>).
_ARCH_TOKENS: dict[str, dict[str, str]] = {
    "qwen2": {},
    "qwen2_vl": {
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "llava": {"image_token": "<image>"},
}
_ARCH_TOKENS["qwen2_5_vl"] = _ARCH_TOKENS["qwen2_vl"]
# What the chat template writes for one image part; the processor expands it to N tokens.
_IMAGE_MARKUP = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "internvl": "<IMG_CONTEXT>",
    "llava": "<image>",
}


def chat_template(arch: str) -> str:
    """ChatML Jinja template for `arch`: string or part-list content, images in place.

    No default system prompt (what you pass is what the model sees). `add_generation_prompt`
    opens the assistant turn; transformers' `continue_final_message` works because assistant text
    is written verbatim. Text-only archs reject image parts instead of dropping them silently.
    """
    image = _IMAGE_MARKUP.get(arch)
    on_image = image if image else "{{ raise_exception('this model is text-only: remove the image parts') }}"
    return (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}" + on_image + "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def _corpus(n: int = 4000) -> list[str]:
    """Deterministic training text: arithmetic, math English, LaTeX bits, our tags, chat roles."""
    rng = random.Random(1234)
    words = (
        "the a an of to and is in that it for on with as by this be are from or at which so we then "
        "find total number each step answer first second third next last finally therefore because "
        "since thus hence given let suppose assume consider note notice recall know need want must "
        "can cannot will would should could may might does do did has have had was were been being "
        "triangle angle area circle square rectangle polygon side sides length width height point "
        "points line lines segment radius diameter degrees sum product difference quotient equal "
        "equals gives value values figure image picture diagram shows shown count how many much what "
        "where when why which who user assistant system question solution correct wrong error check "
        "left right top bottom middle center above below inside outside between parallel perpendicular "
        "vertex vertices edge edges face faces cube sphere cylinder cone volume surface perimeter "
        "fraction decimal percent ratio proportion probability chance random even odd prime divisor "
        "multiple factor integer integers digit digits positive negative zero one two three four five "
        "six seven eight nine ten hundred thousand half quarter twice double triple more less greater "
        "smaller larger largest smallest minimum maximum average mean median mode total remaining "
        "apples oranges coins cars students books pages hours minutes seconds days weeks years money "
        "dollars cents price cost buy sell pay spend save earn speed distance time rate work "
        "function graph slope intercept equation solve variable expression substitute simplify "
        "expand factor compute calculate evaluate determine express write read look color colors "
        "red blue green yellow black white shaded region grid row rows column columns table chart"
    ).split()
    latex = ["\\frac{1}{2}", "\\sqrt{2}", "x^2", "\\pi", "\\angle ABC", "\\boxed{7}", "\\cdot", "\\times"]
    ops = ["+", "-", "*", "/"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op = rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2)}[op]
        prose = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(f"<step>{prose.capitalize()}: {a} {op} {b} = {value}, {rng.choice(latex)}.</step>\n")
        if rng.random() < 0.3:
            lines.append(f"<answer>{value}</answer>\n")
    return lines


def train_bpe(special_tokens: list[str], extra_text: Sequence[str] = ()) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE of VOCAB_SIZE trained here on `_corpus()` plus
    `extra_text`, with `special_tokens` first; every byte is in the base alphabet, so any text
    tokenizes.

    Normalizer and pre-tokenizer are Qwen2's (NFC, Qwen's split regex, byte-level): transformers
    rebuilds a `qwen2` checkpoint's tokenizer as `Qwen2Tokenizer` from vocab + merges, and this
    keeps that rebuild token-for-token identical to the tokenizer trained here.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([*_corpus(), *extra_text], trainer)
    return bpe


def _train_tokenizer(arch: str, extra_text: Sequence[str] = ()) -> Any:
    """The tiny preset's tokenizer (`train_bpe`) with ChatML and the arch's image/video tokens."""
    from transformers import PreTrainedTokenizerFast

    named = _ARCH_TOKENS[arch]
    # Qwen-style: no BOS is prepended; <|endoftext|> pads; <|im_end|> ends a chat turn.
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(_CHATML + list(named.values()), extra_text),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(named),
        chat_template=chat_template(arch),
        model_max_length=4096,
    )


def corpus_text(path: str | Path) -> list[str]:
    """Tokenizer training text from a JSONL of mmprm rows: each row's question, then its steps and
    answer as the policy writes them (`mmprm.steps.render_solution`); rows without steps add the
    question only. A line that is not a JSON object is a ValueError naming the file and line."""
    from mmprm.data.schema import iter_jsonl
    from mmprm.steps import render_solution

    texts = []
    for line_no, row, error in iter_jsonl(path):
        if error is not None:  # not UTF-8, not JSON, or not an object: iter_jsonl says which
            raise ValueError(f"{path}:{line_no}: {error}: give a JSONL of problems or solutions")
        texts.append(str(row.get("question", "")))
        if row.get("steps"):
            texts.append(render_solution([str(s) for s in row["steps"]], row.get("answer")))
    return [t for t in texts if t]


def _text_config(tok: Any, hidden_size: int, num_layers: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    heads = hidden_size // head_dim
    size = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    ids = dict(
        vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return {**size, **ids, **extra}


def _build(
    arch: str, tok: Any, hidden_size: int = 64, num_layers: int = 2, head_dim: int = HEAD_DIM, vllm_ready: bool = False
) -> tuple[Any, Any]:
    """(model, processor) of `arch` with every special-token id taken from `tok`.

    The model is built first, then the processor, so weight init draws the same random numbers
    for every arch. vllm_ready: the standard processor with its video processor (vLLM loads
    nothing less); otherwise the image-only subclass, which needs no torchvision.
    """
    import transformers as tf

    template = tok.chat_template or chat_template(arch)
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_text_config(tok, hidden_size, num_layers, head_dim))), tok
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        model = _qwen_vl_model(arch, tok, hidden_size, num_layers, head_dim)
        return model, _qwen_vl_processor(arch, tok, template, vllm_ready)
    if arch == "internvl":
        model = _internvl_model(tok, hidden_size, num_layers, head_dim)
        return model, _internvl_processor(tok, template, vllm_ready)
    if arch == "llava":
        model = _llava_model(tok, hidden_size, num_layers, head_dim)
        return model, _llava_processor(tok, template)
    raise AssertionError(arch)  # unreachable: build_tiny_model validated arch


def _qwen_vl_model(arch: str, tok: Any, hidden_size: int, num_layers: int, head_dim: int) -> Any:
    """Random-init Qwen2-VL or Qwen2.5-VL: M-RoPE text model and a 2-block vision tower."""
    import transformers as tf

    tid = tok.convert_tokens_to_ids
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(head_dim)}
    text = _text_config(tok, hidden_size, num_layers, head_dim, rope_parameters=rope)
    ids = dict(
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=hidden_size)
        return tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    # window_size is in pixels (2 merged patches = 56 px); block 1 attends to the full image.
    vision.update(
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=hidden_size,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))


def _qwen_vl_processor(arch: str, tok: Any, template: str, vllm_ready: bool) -> Any:
    """Qwen2-VL / Qwen2.5-VL processor: the standard one with video when vllm_ready, else image-only."""
    import transformers as tf

    from mmprm.models.loading import IMAGE_ONLY_PROCESSORS

    # Images are resized to 28*28..56*56 px (multiples of 28): 1-4 merged 28 px patches, 1-4 tokens.
    sizes = dict(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2)
    image_processor = tf.Qwen2VLImageProcessorPil(**sizes)
    if vllm_ready:
        full = tf.Qwen2VLProcessor if arch == "qwen2_vl" else tf.Qwen2_5_VLProcessor
        return full(
            image_processor=image_processor,
            tokenizer=tok,
            chat_template=template,
            video_processor=tf.Qwen2VLVideoProcessor(**sizes),
        )
    return IMAGE_ONLY_PROCESSORS[arch](image_processor=image_processor, tokenizer=tok, chat_template=template)


def _internvl_model(tok: Any, hidden_size: int, num_layers: int, head_dim: int, text_model: str = "qwen2") -> Any:
    """Random-init InternVL: a Qwen2 text model (or `text_model`: "llama", the shape InternLM2
    converts to) and a 2-layer vision tower on 56 px tiles."""
    import transformers as tf

    # 56 px tile = 4x4 patches of 14 px; pixel shuffle (0.5) leaves 2x2 = 4 tokens per tile.
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=[56, 56],
        patch_size=[14, 14],
    )
    config = tf.InternVLConfig(
        text_config={"model_type": text_model, **_text_config(tok, hidden_size, num_layers, head_dim)},
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    return tf.InternVLForConditionalGeneration(config)


def _internvl_processor(tok: Any, template: str, vllm_ready: bool) -> Any:
    """InternVL processor, 1-4 tiles of 56 px: the standard one with video when vllm_ready, else image-only."""
    import transformers as tf

    from mmprm.models.loading import IMAGE_ONLY_PROCESSORS

    image_processor = tf.GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    if vllm_ready:
        video_processor = tf.InternVLVideoProcessor(size={"height": 56, "width": 56})
        return tf.InternVLProcessor(
            image_processor=image_processor,
            tokenizer=tok,
            image_seq_length=4,
            video_processor=video_processor,
            chat_template=template,
        )
    return IMAGE_ONLY_PROCESSORS["internvl"](
        image_processor=image_processor, tokenizer=tok, image_seq_length=4, chat_template=template
    )


def _llava_model(tok: Any, hidden_size: int, num_layers: int, head_dim: int) -> Any:
    """Random-init LLaVA: a Llama text model and a 2-layer CLIP vision tower at 56 px."""
    import transformers as tf

    # CLIP at 56 px: 4x4 patches + CLS; the "default" strategy drops CLS -> 16 image tokens.
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
        projection_dim=32,
    )
    config = tf.LlavaConfig(
        text_config={"model_type": "llama", **_text_config(tok, hidden_size, num_layers, head_dim)},
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return tf.LlavaForConditionalGeneration(config)


def _llava_processor(tok: Any, template: str) -> Any:
    """LLaVA processor (no video processor in any variant): 16 image tokens per image."""
    import transformers as tf

    image_processor = tf.LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=template,
    )


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = HEAD_DIM,
    vllm_ready: bool = False,
    tokenizer: Any | None = None,
    corpus: Sequence[str] = (),
) -> Path:
    """Build, save and return the directory of a tiny random-init model of `arch`.

    Args:
        arch: one of `TINY_ARCHS`.
        out_dir: created if missing; existing files of the same names are overwritten.
        seed: weight init seed; the same seed gives identical weights (the caller's RNG state is
            left untouched).
        hidden_size: language-model width, a multiple of head_dim; 64 for tests, 128-256 learns
            the synthetic demo task faster.
        num_layers: language-model decoder layers.
        head_dim: language-model head width, a multiple of 16; vLLM needs 64 (`VLLM_HEAD_DIM`).
        vllm_ready: save the standard processor with its video processor, which vLLM requires of
            Qwen2-VL, Qwen2.5-VL and InternVL (needs torchvision); LLaVA and qwen2 are unchanged.
        tokenizer: a tokenizer to use instead of the one trained here (tests of real chat templates
            and special-token settings); it must hold this arch's named tokens (`_ARCH_TOKENS`), and
            its chat template, when set, becomes the processor's.
        corpus: more tokenizer training text, e.g. a task's own questions and solutions
            (`corpus_text`). A real tokenizer holds common English words as single tokens; the
            built-in corpus alone splits a task's words into pieces ("Tile" -> T, i, le), which
            makes every sequence longer than a real model's and every stage slower.

    Returns:
        `out_dir` as a Path, loadable with `load_backbone` / `from_pretrained`.
    """
    from transformers import GenerationConfig

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}: choose one of {', '.join(TINY_ARCHS)}")
    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"tiny head_dim={head_dim}: use a multiple of 16 (16 by default; vLLM needs {VLLM_HEAD_DIM})")
    if hidden_size < head_dim or hidden_size % head_dim:
        raise ValueError(
            f"tiny hidden_size={hidden_size}: use a positive multiple of head_dim={head_dim} "
            f"(e.g. {head_dim}, {2 * head_dim}, {4 * head_dim})"
        )
    if num_layers < 1:
        raise ValueError(f"tiny num_layers={num_layers}: use 1 or more")
    if vllm_ready and arch in IMAGE_ONLY_ARCHS:
        from transformers.utils import is_torchvision_available

        if not is_torchvision_available():
            raise ValueError(
                f"a vLLM-ready tiny {arch} saves its video processor, which needs torchvision; it does "
                "not import here: build it in the vLLM environment (make test-vllm sets one up)"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None and corpus:
        raise ValueError("give either a tokenizer or a corpus to train one on, not both")
    tok = tokenizer if tokenizer is not None else _train_tokenizer(arch, corpus)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = _build(arch, tok, hidden_size, num_layers, head_dim, vllm_ready)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.pad_token_id,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[i for i in dict.fromkeys([tok.eos_token_id, tok.pad_token_id]) if i is not None],
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def cli_tiny_model(argv: list[str]) -> int:
    """`mmprm tiny-model --arch ARCH --out DIR [--seed N] [--hidden-size H] [--layers L] [--head-dim D] [--vllm]`:
    build one tiny preset."""
    parser = argparse.ArgumentParser(prog="mmprm tiny-model", description=cli_tiny_model.__doc__)
    parser.add_argument("--arch", required=True, choices=TINY_ARCHS)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=64,
        help="language-model width, a multiple of 16 (default 64; 128-256 for the demo)",
    )
    parser.add_argument("--layers", type=int, default=2, help="language-model layers (default 2)")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help=f"language-model head width, a multiple of 16 (default {HEAD_DIM}; {VLLM_HEAD_DIM} with --vllm)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help=f"vLLM-ready: head_dim {VLLM_HEAD_DIM} unless given, full processor with its video "
        "processor (needs torchvision)",
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="JSONL of problems or solutions whose text the tokenizer also trains on, so that the "
        "task's words become single tokens as in a real tokenizer (default: the built-in corpus only)",
    )
    args = parser.parse_args(argv)
    head_dim = args.head_dim or (VLLM_HEAD_DIM if args.vllm else HEAD_DIM)
    try:
        corpus = corpus_text(args.corpus) if args.corpus else ()
        path = build_tiny_model(
            args.arch,
            args.out,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            head_dim=head_dim,
            vllm_ready=args.vllm,
            corpus=corpus,
        )
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(f"tiny {args.arch} model written to {path}")
    return 0
