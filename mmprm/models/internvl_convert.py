"""Convert an InternVL chat checkpoint (remote code, `InternVLChatModel`) into transformers' own
`InternVLForConditionalGeneration` format, without running the checkpoint's code.

MM-PRM's and VisualPRM's releases are InternVL chat models: their weights and config.json follow
InternVL's repository (`vision_model.*`, `mlp1.*`, `language_model.*`, an `llm_config` and a
`vision_config`), which transformers reads only through `trust_remote_code`. mmprm reads the files
themselves: the config is mapped field by field, the weights renamed (and fused projections split)
one safetensors shard at a time, so an 8B checkpoint never sits in memory whole. The written
directory loads with `from_pretrained` like InternVL3's `-hf` checkpoints and scores with
`mmprm.load_prm(..., convention="mm_prm" | "visualprm")` (docs/released-prms.md).

Language models: Qwen2 (InternVL3, InternVL2.5 1B/4B/38B/78B), Llama, and InternLM2 (InternVL2.5
8B/26B, hence MM-PRM-8B and VisualPRM-8B) as a Llama model with its fused `wqkv` split per head
group. InternLM2's tokenizer is remote code too: it is rebuilt as a fast tokenizer from its
sentencepiece file (mmprm/models/sentencepiece_bpe.py), or `tokenizer=` gives an HF-format one of
the same vocabulary, whose ids for the checkpoint's added tokens are checked.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

# What one image of a chat message becomes in the text: InternVL's `-hf` chat template writes its
# context token, which the processor expands to <img>, a token per patch feature, </img>.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
# transformers' InternVL processor also names a video token; a vocabulary without one (InternVL2.5's)
# gets it after every existing id (never written by mmprm, which sends images only).
NAMED_TOKENS = {**IMAGE_TOKENS, "video_token": "<video>"}
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
TEXT_MODELS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "InternLM2ForCausalLM": "internlm2"}
INDEX = "model.safetensors.index.json"
# Remote-code tokenizers rebuilt from their sentencepiece file, and their default special tokens
SENTENCEPIECE_TOKENIZERS = ("InternLM2Tokenizer", "InternLM2TokenizerFast")
SENTENCEPIECE_ROLES = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
# llm_config entries that describe the training run or the remote code, not the model: passed on,
# an "attn_implementation: flash_attention_2" would stop a CPU load.
DROPPED_LLM_KEYS = (
    "_name_or_path auto_map architectures model_type transformers_version torch_dtype attn_implementation "
    "_attn_implementation_autoset use_bfloat16 use_flash_attn"
).split()

# InternVL's names -> transformers' (regex, applied in order to the part after the prefix).
VISION_NAMES = [
    (r"^embeddings\.class_embedding$", "embeddings.cls_token"),
    (r"^embeddings\.position_embedding$", "embeddings.position_embeddings"),
    (r"^embeddings\.patch_embedding\.", "embeddings.patch_embeddings.projection."),
    (r"^encoder\.layers\.(\d+)\.ls1$", r"encoder.layer.\1.lambda_1"),
    (r"^encoder\.layers\.(\d+)\.ls2$", r"encoder.layer.\1.lambda_2"),
    (r"^encoder\.layers\.(\d+)\.attn\.proj\.", r"encoder.layer.\1.attention.projection_layer."),
    (r"^encoder\.layers\.(\d+)\.attn\.(q_norm|k_norm|qkv)\.", r"encoder.layer.\1.attention.\2."),
    (r"^encoder\.layers\.(\d+)\.mlp\.", r"encoder.layer.\1.mlp."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"encoder.layer.\1.layernorm_before."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"encoder.layer.\1.layernorm_after."),
]
PROJECTOR_NAMES = [
    (r"^0\.", "layer_norm."),
    (r"^1\.", "linear_1."),
    (r"^3\.", "linear_2."),
]
INTERNLM2_NAMES = [
    (r"^tok_embeddings\.", "embed_tokens."),
    (r"^layers\.(\d+)\.attention\.wqkv\.", r"layers.\1.self_attn.qkv."),
    (r"^layers\.(\d+)\.attention\.wo\.", r"layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"layers.\1.post_attention_layernorm."),
    (r"^norm\.", "norm."),
]


class ConversionError(ValueError):
    """A checkpoint this converter cannot map faithfully; the message says what and why."""


def _rename(name: str, rules: list[tuple[str, str]]) -> str | None:
    for pattern, repl in rules:
        if re.search(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConversionError(f"{path}: missing") from e
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not JSON ({e})") from e


def _read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.exists():
        raise ConversionError(f"{src}: no config.json; give the directory of an InternVL chat checkpoint")
    config = _read_json(path)
    if config.get("model_type") == "internvl":
        raise ConversionError(f"{path}: already transformers' InternVL format: load it as it is")
    if "llm_config" not in config or "vision_config" not in config:
        raise ConversionError(
            f"{path}: no llm_config/vision_config: not an InternVL chat checkpoint (model_type "
            f"{config.get('model_type')!r})"
        )
    return config


def text_kind(config: dict[str, Any]) -> str:
    """qwen2, llama or internlm2: the language model an InternVL chat config names."""
    arch = (config["llm_config"].get("architectures") or ["?"])[0]
    if arch not in TEXT_MODELS:
        raise ConversionError(f"llm_config.architectures: {arch!r} is not one of {sorted(TEXT_MODELS)}")
    return TEXT_MODELS[arch]


def text_config(config: dict[str, Any]) -> Any:
    """transformers' config of the language model: Qwen2 or Llama (InternLM2 is a Llama with a
    fused attention projection, split when the weights are converted)."""
    import transformers as tf

    llm = dict(config["llm_config"])
    kind = text_kind(config)
    if kind == "internlm2":
        if llm.get("bias"):
            raise ConversionError("llm_config.bias: InternLM2 with biased projections has no Llama counterpart")
        keys = (
            "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
            "hidden_act max_position_embeddings rms_norm_eps rope_theta rope_scaling bos_token_id eos_token_id "
            "pad_token_id initializer_range"
        ).split()
        return tf.LlamaConfig(**{k: llm[k] for k in keys if k in llm}, tie_word_embeddings=False)
    cls = tf.Qwen2Config if kind == "qwen2" else tf.LlamaConfig
    for key in DROPPED_LLM_KEYS:
        llm.pop(key, None)
    llm["tie_word_embeddings"] = False  # InternVL unties them whatever the LM's own config says
    llm["use_cache"] = True  # a training run's "use_cache: false" would only slow generation down
    return cls(**llm)


def vision_config(config: dict[str, Any]) -> Any:
    import transformers as tf

    vis = config["vision_config"]
    size = config.get("force_image_size") or vis["image_size"]
    return tf.InternVLVisionConfig(
        hidden_size=vis["hidden_size"],
        num_hidden_layers=vis["num_hidden_layers"],
        num_attention_heads=vis["num_attention_heads"],
        intermediate_size=vis["intermediate_size"],
        hidden_act=vis.get("hidden_act", "gelu"),
        layer_norm_eps=vis.get("layer_norm_eps", 1e-6),
        norm_type=vis.get("norm_type", "rms_norm"),
        attention_bias=vis.get("qkv_bias", False),
        use_qk_norm=vis.get("qk_normalization", False),
        image_size=[size, size],
        patch_size=[vis["patch_size"], vis["patch_size"]],
        num_channels=vis.get("num_channels", 3),
        use_absolute_position_embeddings=True,
    )


def internvl_config(config: dict[str, Any], image_token_id: int) -> Any:
    """transformers' `InternVLConfig` for an InternVL chat config (pixel shuffle v2 only: v1
    orders the patch features differently and transformers implements v2)."""
    import transformers as tf

    if config.get("ps_version", "v1") != "v2":
        raise ConversionError(f"ps_version: {config.get('ps_version', 'v1')!r}; only 'v2' has a transformers form")
    vision = vision_config(config)
    ratio = config.get("downsample_ratio", 0.5)
    per_tile = int((vision.image_size[0] // vision.patch_size[0]) ** 2 * ratio**2)
    out = tf.InternVLConfig(
        text_config=text_config(config),
        vision_config=vision,
        image_token_id=image_token_id,
        downsample_ratio=ratio,
        vision_feature_layer=config.get("select_layer", -1),
        image_seq_length=per_tile,
        tie_word_embeddings=False,  # InternVL chat models keep their own output layer
    )
    out.architectures = ["InternVLForConditionalGeneration"]
    if config.get("torch_dtype"):  # the weights keep their dtype; dtype="auto" should find it
        out.dtype = config["torch_dtype"]
    return out


def split_wqkv(weight: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """InternLM2's fused projection -> (q, k, v). Its rows hold, for each key/value head, that
    head's group of query heads, then its key, then its value."""
    rows, hidden = weight.shape
    group = heads // kv_heads
    head_dim = rows // (kv_heads * (group + 2))
    blocks = weight.view(kv_heads, group + 2, head_dim, hidden)
    q = blocks[:, :group].reshape(heads * head_dim, hidden)
    return (
        q.contiguous(),
        blocks[:, -2].reshape(-1, hidden).contiguous(),
        blocks[:, -1].reshape(-1, hidden).contiguous(),
    )


def convert_weights(
    names: Iterable[str], read: Callable[[str], torch.Tensor], kind: str, heads: int, kv_heads: int
) -> Iterable[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) for every InternVL weight named in `names` (`read` loads one);
    a weight no rule maps is an error naming it."""
    for name in names:
        prefix, _, rest = name.partition(".")
        new: str | None = None
        if prefix == "vision_model":
            new = _rename(rest, VISION_NAMES)
            new = new and "model.vision_tower." + new
        elif prefix == "mlp1":
            new = _rename(rest, PROJECTOR_NAMES)
            new = new and "model.multi_modal_projector." + new
        elif prefix == "language_model":
            if rest in ("lm_head.weight", "output.weight"):
                new = "lm_head.weight"
            elif rest.startswith("model."):
                inner = rest[len("model.") :]
                new = _rename(inner, INTERNLM2_NAMES) if kind == "internlm2" else inner
                new = new and "model.language_model." + new
        if new is None:
            raise ConversionError(f"weight {name!r}: no transformers counterpart known ({kind} language model)")
        tensor = read(name)
        if ".attention.qkv." in new:  # the vision tower's fused q, k, v: equal thirds
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                yield new.replace(".qkv.", f".{part}."), piece.contiguous()
        elif ".self_attn.qkv." in new:
            if not new.endswith(".weight"):
                raise ConversionError(f"weight {name!r}: a biased fused projection is not supported")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), split_wqkv(tensor, heads, kv_heads)):
                yield new.replace(".qkv.", f".{part}."), piece
        else:
            yield new, tensor


def _weight_map(src: Path) -> dict[str, str]:
    from safetensors import safe_open

    if (src / INDEX).exists():
        return dict(json.loads((src / INDEX).read_text())["weight_map"])
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{src}: no *.safetensors weights (a .bin checkpoint: save it as safetensors first)")
    names: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update({k: f.name for k in st.keys()})
    return names


def _tokenizer_config(src: Path) -> dict[str, Any]:
    path = src / "tokenizer_config.json"
    return _read_json(path) if path.exists() else {}


def rebuilds_tokenizer(src: Path, tokenizer_config: dict[str, Any]) -> bool:
    """Whether `src`'s own tokenizer is one rebuilt from its sentencepiece file (InternLM2's)."""
    return tokenizer_config.get("tokenizer_class") in SENTENCEPIECE_TOKENIZERS and (src / "tokenizer.model").exists()


def internvl_tokenizer(src: Path, tokenizer: str | Path | None) -> Any:
    """The checkpoint's tokenizer with InternVL's image tokens named. InternLM2's remote-code
    tokenizer is rebuilt from its sentencepiece file; `tokenizer` replaces the checkpoint's, and
    must give every token the checkpoint added (`added_tokens.json`) the same id."""
    from transformers import AutoTokenizer

    added_file = src / "added_tokens.json"
    added: dict[str, int] = _read_json(added_file) if added_file.exists() else {}
    tokenizer_config = _tokenizer_config(src) if tokenizer is None else {}
    if tokenizer is None and rebuilds_tokenizer(src, tokenizer_config):
        tok = sentencepiece_tokenizer(src / "tokenizer.model", tokenizer_config, added)
    elif tokenizer is None:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # it reads config.json too, and would warn about internvl_chat
        try:  # trust_remote_code stated, so that transformers does not ask whether to run it
            tok = AutoTokenizer.from_pretrained(str(src), extra_special_tokens=NAMED_TOKENS, trust_remote_code=False)
        except (ValueError, OSError) as e:
            cls = tokenizer_config.get("tokenizer_class", "?")
            raise ConversionError(
                f"{src}: its tokenizer ({cls}) loads only as remote code, which mmprm does not run: give an "
                "HF-format tokenizer of the same vocabulary with --tokenizer (see docs/released-prms.md)"
            ) from e
        finally:
            hf_logging.set_verbosity(verbosity)
    else:
        tok = AutoTokenizer.from_pretrained(str(tokenizer), extra_special_tokens=NAMED_TOKENS)
        missing = [t for t in added if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
        tok.add_tokens(missing, special_tokens=True)
    wrong = {t: (i, tok.convert_tokens_to_ids(t)) for t, i in added.items() if tok.convert_tokens_to_ids(t) != i}
    if wrong:
        shown = ", ".join(f"{t!r}: {a} in the checkpoint, {b} here" for t, (a, b) in sorted(wrong.items())[:5])
        raise ConversionError(f"the tokenizer gives added tokens other ids than the checkpoint's ({shown})")
    for token in IMAGE_TOKENS.values():
        if len(tok.encode(token, add_special_tokens=False)) != 1:
            raise ConversionError(f"the tokenizer has no {token!r} token: is this an InternVL checkpoint's tokenizer?")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json token entry: a string, or an AddedToken's fields."""
    return value.get("content") if isinstance(value, dict) else value


def sentencepiece_tokenizer(model_file: Path, tokenizer_config: dict[str, Any], added: dict[str, int]) -> Any:
    """InternLM2's tokenizer as a fast one: the sentencepiece model rebuilt, the added tokens of
    `tokenizer_config.json` (and `added_tokens.json`) at their ids, BOS/EOS as its settings say."""
    from transformers import PreTrainedTokenizerFast

    from mmprm.models.sentencepiece_bpe import SentencePieceError, read_model, rebuild_tokenizer

    decoder = {int(i): dict(t) for i, t in tokenizer_config.get("added_tokens_decoder", {}).items()}
    for content, i in added.items():
        decoder.setdefault(i, {"content": content, "special": True})
    roles = {k: _token_text(tokenizer_config.get(k, d)) for k, d in SENTENCEPIECE_ROLES.items()}
    try:
        backend = rebuild_tokenizer(
            read_model(model_file),
            decoder,
            bos_token=roles["bos_token"] if tokenizer_config.get("add_bos_token", True) else None,
            eos_token=roles["eos_token"] if tokenizer_config.get("add_eos_token", False) else None,
        )
    except SentencePieceError as e:
        raise ConversionError(f"{model_file}: {e}; give an HF-format tokenizer with --tokenizer") from e
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **roles,
        extra_special_tokens=NAMED_TOKENS,
        clean_up_tokenization_spaces=tokenizer_config.get("clean_up_tokenization_spaces", False),
        model_max_length=tokenizer_config.get("model_max_length", 32768),
    )


def _processor(config: dict[str, Any], tok: Any, hf_config: Any, max_patches: int | None) -> Any:
    """InternVL's tiling as transformers' image processor: tiles of the ViT's size (`hf_config`'s),
    at most `max_dynamic_patch` of them (or `max_patches`) and a thumbnail, ImageNet statistics."""
    import transformers as tf

    from mmprm.models.loading import IMAGE_ONLY_PROCESSORS

    dynamic = bool(config.get("dynamic_image_size", False))
    if dynamic and not config.get("use_thumbnail", False):
        raise ConversionError("use_thumbnail: false with dynamic tiles; transformers' InternVL always adds one")
    size = hf_config.vision_config.image_size[0]
    image_processor = tf.GotOcr2ImageProcessorPil(
        size={"height": size, "width": size},
        crop_to_patches=dynamic,
        min_patches=config.get("min_dynamic_patch", 1),
        max_patches=max_patches or config.get("max_dynamic_patch", 12),
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )
    return IMAGE_ONLY_PROCESSORS["internvl"](
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_length=hf_config.image_seq_length,
        chat_template=CHAT_TEMPLATE,
    )


def convert_internvl(
    src: str | Path, out: str | Path, tokenizer: str | Path | None = None, max_patches: int | None = None
) -> Path:
    """Write `src` (an InternVL chat checkpoint directory) to `out` in transformers' format.

    Weights keep their dtype and are written one source shard at a time; afterwards every weight
    transformers' model expects must have been written with its shape, else the conversion fails
    naming what is missing or extra. `max_patches` overrides the checkpoint's tile limit (MM-PRM's
    evaluation scripts use 6). Returns `out`.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import InternVLForConditionalGeneration

    src, out = Path(src), Path(out)
    config = _read_config(src)
    kind = text_kind(config)
    if out.resolve() == src.resolve():
        raise ConversionError(f"{out}: write the conversion to a directory of its own")
    tok = internvl_tokenizer(src, tokenizer)
    try:
        hf_config = internvl_config(config, tok.convert_tokens_to_ids(IMAGE_TOKENS["context_image_token"]))
    except KeyError as e:
        raise ConversionError(f"{src / 'config.json'}: no {e.args[0]!r} in llm_config or vision_config") from e
    text = hf_config.text_config
    out.mkdir(parents=True, exist_ok=True)

    weight_map = _weight_map(src)
    written: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(src / file), framework="pt") as st:
            names = [n for n, f in weight_map.items() if f == file]
            tensors = dict(
                convert_weights(names, st.get_tensor, kind, text.num_attention_heads, text.num_key_value_heads)
            )
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        written.update({name: (file, tuple(t.shape)) for name, t in tensors.items()})
        del tensors

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in InternVLForConditionalGeneration(hf_config).state_dict().items()}
    missing = sorted(set(expected) - set(written))
    extra = sorted(set(written) - set(expected))
    wrong = sorted(k for k in set(expected) & set(written) if expected[k] != written[k][1])
    if missing or extra or wrong:
        raise ConversionError(
            f"{src}: the converted weights do not fit transformers' InternVL: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shape {[(k, written[k][1], expected[k]) for k in wrong[:5]]}"
        )
    (out / INDEX).write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for k, (f, _) in sorted(written.items())}}, indent=2) + "\n"
    )
    hf_config.save_pretrained(out)
    _processor(config, tok, hf_config, max_patches).save_pretrained(out)
    if (src / "generation_config.json").exists():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    return out


def cli_convert_internvl(argv: list[str]) -> int:
    """`mmprm convert-internvl SRC OUT [--tokenizer DIR] [--max-patches N]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="mmprm convert-internvl",
        description="Write an InternVL chat checkpoint (remote code) in transformers' InternVL format, "
        "without running its code; docs/released-prms.md.",
    )
    parser.add_argument("src", help="the InternVL chat checkpoint directory (e.g. MM-PRM-8B, VisualPRM-8B)")
    parser.add_argument("out", help="where to write the transformers-format checkpoint")
    parser.add_argument(
        "--tokenizer",
        help="an HF-format tokenizer of the same vocabulary, to use instead of the checkpoint's own "
        "(which is rebuilt from its sentencepiece file where it is InternLM2's remote code)",
    )
    parser.add_argument("--max-patches", type=int, help="tile limit per image (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        out = convert_internvl(args.src, args.out, tokenizer=args.tokenizer, max_patches=args.max_patches)
    except ConversionError as e:
        parser.exit(2, f"mmprm convert-internvl: {e}\n")
    config = json.loads((Path(args.src) / "config.json").read_text())
    print(out)
    if args.tokenizer is None and rebuilds_tokenizer(Path(args.src), _tokenizer_config(Path(args.src))):
        print("tokenizer: InternLM2's, rebuilt from tokenizer.model (docs/released-prms.md)")
    # The mm_prm and visualprm conventions write InternVL's "internvl2_5" template and its system
    # message; a checkpoint that asks for others is not scored as its authors do.
    print(f"conversation template: {config.get('template')!r}")
    if config.get("system_message"):
        print(f"system message set by the checkpoint (the conventions write InternVL's): {config['system_message']!r}")
    return 0
