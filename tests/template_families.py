"""Tiny checkpoints of every chat-template family mmprm claims, built the way a real one is shaped.

Each family in `fixtures/chat_templates/families.json` gets a byte-level BPE trained here with the
family's special tokens and settings (bos/eos/pad/unk, whether the tokenizer adds a BOS, padding
side) and its real chat template, beside a tiny random-init model of the matching class, saved as an
HF directory. Used by the token-by-token template tests and by the recipe runs on real templates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmprm.models.tiny import _ARCH_TOKENS, build_tiny_model, train_bpe

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES: dict[str, dict] = json.loads((FIXTURES / "families.json").read_text(encoding="utf-8"))
NAMES = sorted(FAMILIES)
TEXT_ARCHS = ("qwen2", "llama", "mistral")
# Named tokens each processor reads from its tokenizer: the tiny presets' archs, plus the two
# LLaVA generations built here (tiny.py has no preset for them).
NAMED_TOKENS = {
    **_ARCH_TOKENS,
    "llava_next": {"image_token": "<image>"},
    "llava_onevision": {"image_token": "<image>", "video_token": "<video>"},
}


def family_tokenizer(name: str):
    """A byte-level BPE trained here (`train_bpe`) with the family's special tokens, settings and real template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    named = dict(NAMED_TOKENS.get(fam["arch"], {}))
    roles = [fam[k] for k in ("bos", "eos", "pad", "unk") if fam[k]]
    bpe = train_bpe(list(dict.fromkeys([*fam["special_tokens"], *roles, *named.values()])))
    if fam["add_bos_token"]:  # Llama 3, Mistral, LLaVA-1.5/NeXT tokenizers prepend BOS themselves
        bos = fam["bos"]
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
        )
    template = (FIXTURES / fam["template"]).read_text(encoding="utf-8")
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=fam["bos"],
        eos_token=fam["eos"],
        pad_token=fam["pad"],
        unk_token=fam["unk"],
        extra_special_tokens=named,
        chat_template=template,
        padding_side=fam["padding_side"],
        model_max_length=4096,
    )


def text_model(arch: str, tok, tie: bool = False, hidden_size: int = 64, heads: int = 4, kv_heads: int = 2):
    """A tiny random-init decoder of `arch` for `tok` (2 layers, MLP twice as wide, seed 0)."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_cls(config)


def _llava_anyres_model(arch: str, tok):
    """Tiny LLaVA-NeXT (Mistral LM) or LLaVA-OneVision (Qwen2 LM): CLIP at 56 px, anyres grids of 56 px tiles."""
    import transformers as tf

    from mmprm.models.loading import LlavaOnevisionImageOnlyProcessor

    text = {
        "model_type": "mistral" if arch == "llava_next" else "qwen2",
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 32,
    }
    grids = [[56, 56], [56, 112], [112, 56]]
    image_id = tok.convert_tokens_to_ids("<image>")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if arch == "llava_next":
            model = tf.LlavaNextForConditionalGeneration(
                tf.LlavaNextConfig(
                    text_config=text,
                    vision_config=vision,
                    image_token_index=image_id,
                    image_grid_pinpoints=grids,
                    vision_feature_layer=-2,
                    vision_feature_select_strategy="default",
                )
            )
            images = tf.LlavaNextImageProcessorPil(
                size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, image_grid_pinpoints=grids
            )
            processor = tf.LlavaNextProcessor(
                image_processor=images,
                tokenizer=tok,
                patch_size=14,
                vision_feature_select_strategy="default",
                num_additional_image_tokens=1,
                image_token="<image>",
                chat_template=tok.chat_template,
            )
        else:
            model = tf.LlavaOnevisionForConditionalGeneration(
                tf.LlavaOnevisionConfig(
                    text_config=text,
                    vision_config=vision,
                    image_token_index=image_id,
                    video_token_index=tok.convert_tokens_to_ids("<video>"),
                    image_grid_pinpoints=grids,
                    vision_feature_layer=-1,
                    vision_feature_select_strategy="default",
                )
            )
            images = tf.LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56}, image_grid_pinpoints=grids)
            # 16 patch tokens + CLS, which the "default" strategy drops
            processor = LlavaOnevisionImageOnlyProcessor(
                image_processor=images,
                tokenizer=tok,
                num_image_tokens=17,
                vision_feature_select_strategy="default",
                chat_template=tok.chat_template,
            )
    return model, processor


def build_family_checkpoint(name: str, out: Path, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Save family NAME's tiny checkpoint (model, tokenizer or processor, real template) to OUT.

    HIDDEN_SIZE and NUM_LAYERS apply to the archs with a tiny preset (the VLMs a recipe run trains); the text
    and LLaVA-NeXT/OneVision models here stay at 64.
    """
    fam = FAMILIES[name]
    tok = family_tokenizer(name)
    if fam["arch"] in TEXT_ARCHS:
        text_model(fam["arch"], tok, fam["tie_word_embeddings"]).save_pretrained(out)
        tok.save_pretrained(out)
    elif fam["arch"] in ("llava_next", "llava_onevision"):
        model, processor = _llava_anyres_model(fam["arch"], tok)
        model.save_pretrained(out)
        processor.save_pretrained(out)
    else:
        build_tiny_model(fam["arch"], out, seed=0, hidden_size=hidden_size, num_layers=num_layers, tokenizer=tok)
    return out
