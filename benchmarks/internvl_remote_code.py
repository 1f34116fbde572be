"""Agreement of `mmprm convert-internvl` and the `mm_prm` convention with InternVL's own code.

    python benchmarks/internvl_remote_code.py --internvl-code PATH [--seed 0]

PATH is a checkout that holds InternVL's `internvl` package (MM-PRM's repository,
github.com/ModalMinds/MM-PRM, ships it with the `prm()` method its PRM is scored by; InternVL's
own `internvl_chat/` works for the logits). The tests cannot run that code (it is not ours to
ship), so this script does, on tiny random-init models built from InternVL's own config classes:
for an InternLM2 and a Qwen2 language model it saves an `InternVLChatModel`, converts it with
`mmprm.models.internvl_convert`, and compares

- the logits of the remote model and of transformers' `InternVLForConditionalGeneration` loaded
  from the conversion, on one prompt with an image of three tiles;
- MM-PRM's `InternVLChatModel.prm()` step scores with `mmprm.load_prm(..., convention="mm_prm")`
  on the conversion, for the same image and four solutions.

With `--visualprm-modeling FILE`, VisualPRM's `modeling_internvl_chat.py` (the one in the
VisualPRM-8B checkpoint directory), its `InternVLRewardModel.generate_steps_with_soft_score()` runs
on the same remote model (the class is taken from the file and set on the package's
`InternVLChatModel`, whose forward it calls) and is compared with
`load_prm(..., convention="visualprm")`, with the image and without.

Prints one JSON line: per language model, the largest absolute differences. `timm` (only
`DropPath`, an identity at inference) is stubbed when it is not installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"
SOLUTIONS = [
    ["He starts with 3 apples.", "3 + 5 = 8.", "The answer is 8."],
    ["He starts with 3 apples.", "3 + 5 = 9.", "The answer is 9."],
    ["3 * 5 = 15.", "The answer is 15."],
    ["He buys 5 more, so 3 + 5 = 8 apples in total."],
]
INTERNVL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<prm>"]


def stub_timm() -> None:
    """InternViT imports timm's DropPath; at inference (drop rate 0, eval mode) it is the identity."""
    import importlib.machinery
    import importlib.util

    import transformers  # noqa: F401  (its import-time checks run before the stub exists)

    if importlib.util.find_spec("timm") is None:
        for name in ("timm", "timm.models", "timm.models.layers"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module
        sys.modules["timm.models.layers"].DropPath = lambda *a, **k: torch.nn.Identity()  # type: ignore[attr-defined]


def tokenizer():
    """A byte-level BPE with InternVL's chat and image tokens, MM-PRM's <prm>, and Yes/No single tokens."""
    from transformers import PreTrainedTokenizerFast

    from mmprm.models.tiny import train_bpe

    tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe(INTERNVL_TOKENS), eos_token="<|im_end|>")
    tok.add_tokens(["Yes", "No"])
    return tok


def remote_model(kind: str, vocab: int, seed: int):
    from internvl.model.internvl_chat.configuration_internvl_chat import InternVLChatConfig
    from internvl.model.internvl_chat.modeling_internvl_chat import InternVLChatModel

    llm = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1e6,
        attn_implementation="eager",
    )
    if kind == "internlm2":
        llm.update(architectures=["InternLM2ForCausalLM"], bias=False, rope_scaling={"type": "dynamic", "factor": 2.0})
    else:
        llm.update(architectures=["Qwen2ForCausalLM"])
    vision = dict(
        architectures=["InternVisionModel"],
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        qkv_bias=True,
        qk_normalization=False,
        norm_type="layer_norm",
        image_size=56,
        patch_size=14,
        use_flash_attn=False,
    )
    config = InternVLChatConfig(
        vision_config=vision,
        llm_config=llm,
        downsample_ratio=0.5,
        select_layer=-1,
        ps_version="v2",
        template="internvl2_5",
        dynamic_image_size=True,
        use_thumbnail=True,
        max_dynamic_patch=4,
        force_image_size=56,
    )
    torch.manual_seed(seed)
    model = InternVLChatModel(config, use_flash_attn=False).eval()
    with torch.no_grad():  # every weight random (layer scales and norms too), so none is a no-op
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model, config


def visualprm_reward_model(path: Path) -> type:
    """`InternVLRewardModel` from VisualPRM's modeling file, subclassing the `internvl` package's
    `InternVLChatModel`: only the class is executed, since the file's own imports are modules that
    sit beside it in the checkpoint."""
    import typing

    from internvl.conversation import get_conv_template
    from internvl.model.internvl_chat.modeling_internvl_chat import InternVLChatModel

    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "InternVLRewardModel"]
    if not found:
        raise SystemExit(f"{path}: no class InternVLRewardModel; give VisualPRM's modeling_internvl_chat.py")
    namespace = {
        **{name: getattr(typing, name) for name in typing.__all__},
        "math": math,
        "torch": torch,
        "get_conv_template": get_conv_template,
        "InternVLChatModel": InternVLChatModel,
    }
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["InternVLRewardModel"]


def visualprm_agreement(reward_model: type, model, config, tok, pixel_values, image, out: Path) -> dict:
    """VisualPRM's `generate_steps_with_soft_score()` against the `visualprm` convention, each
    solution with the image and without (VisualPRM's steps are the response split at blank lines)."""
    from mmprm import load_prm

    reward = reward_model(config, use_flash_attn=False).eval()
    reward.load_state_dict(model.state_dict())
    scorer = load_prm(out, convention="visualprm")
    diff, scores = 0.0, []
    for steps in SOLUTIONS:
        for images in ([image], []):
            with torch.no_grad():
                theirs = reward.generate_steps_with_soft_score(
                    tok, QUESTION, "\n\n".join(steps), pixel_values if images else None
                )
            mine = scorer.score([{"question": QUESTION, "steps": steps, "images": images}])[0]
            diff = max(diff, *(abs(t["score"] - m) for t, m in zip(theirs, mine, strict=True)))
            scores += mine
    return {"max_abs_visualprm_score_diff": diff, "visualprm_score_range": [min(scores), max(scores)]}


def check(kind: str, seed: int, reward_model: type | None = None) -> dict[str, float]:
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import InternVLForConditionalGeneration

    from mmprm import load_prm
    from mmprm.models.internvl_convert import convert_internvl
    from mmprm.models.loading import load_processor

    tok = tokenizer()
    model, config = remote_model(kind, len(tok), seed)
    work = Path(tempfile.mkdtemp())
    src = work / "chat"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["InternVLChatModel"]}))
    tok.save_pretrained(work / "tokenizer")
    out = convert_internvl(src, work / "hf", tokenizer=work / "tokenizer")

    g = torch.Generator().manual_seed(seed)
    image = Image.fromarray((torch.rand(60, 100, 3, generator=g) * 255).to(torch.uint8).numpy())
    pixel_values = load_processor(out).image_processor(images=[image], return_tensors="pt")["pixel_values"]
    context = tok.convert_tokens_to_ids("<IMG_CONTEXT>")
    model.img_context_token_id = context
    model.num_image_token = 4
    head = tok("<|im_start|>user\n<img>", add_special_tokens=False)["input_ids"]
    tail = tok("</img>\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n8", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([head + [context] * (4 * len(pixel_values)) + tail])
    converted = InternVLForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        flags = torch.ones(len(pixel_values), dtype=torch.long)
        theirs = model(pixel_values=pixel_values, input_ids=ids, attention_mask=torch.ones_like(ids), image_flags=flags)
        ours = converted(input_ids=ids, pixel_values=pixel_values)
    scorer = load_prm(out, convention="mm_prm")
    score_diff, scores = 0.0, []
    for steps in SOLUTIONS:
        with torch.no_grad():
            prm = model.prm(tok, pixel_values, f"Question: {QUESTION}\nProcess: " + "<prm>".join(steps) + "<prm>")
        mine = scorer.score([{"question": QUESTION, "steps": steps, "images": [image]}])[0]
        score_diff = max(score_diff, *(abs(a - b) for a, b in zip(prm.tolist(), mine, strict=True)))
        scores += mine
    result = {
        "max_abs_logit_diff": (theirs.logits - ours.logits).abs().max().item(),
        "logit_scale": theirs.logits.abs().max().item(),
        "max_abs_mm_prm_score_diff": score_diff,
        "mm_prm_score_range": [min(scores), max(scores)],
    }
    if reward_model is not None:
        result |= visualprm_agreement(reward_model, model, config, tok, pixel_values, image, out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--internvl-code", required=True, help="a checkout holding InternVL's `internvl` package")
    parser.add_argument("--visualprm-modeling", type=Path, help="VisualPRM's modeling_internvl_chat.py")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.internvl_code).resolve()))
    stub_timm()
    reward_model = visualprm_reward_model(args.visualprm_modeling) if args.visualprm_modeling else None
    result = {kind: check(kind, args.seed, reward_model) for kind in ("internlm2", "qwen2")}
    print(json.dumps({"benchmark": "internvl_remote_code", "seed": args.seed, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
