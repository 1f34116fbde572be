"""`mmprm.training.vision_sync`: a text-only batch runs the vision tower on a blank image, counting 0.

The ZeRO-3 runs with two ranks (one text-only, one with an image) are in test_deepspeed_recipes.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from mmprm.models.loading import load_backbone
from mmprm.training.vision_sync import VisionSync, dummy_image_inputs, shards_parameters, vision_sync

VLM_ARCHS = ("qwen2_vl", "qwen2_5_vl", "internvl", "llava")
# What the blank image becomes: Qwen patches 56 px into 4 rows of 2*3*14*14 values; the others one tile.
DUMMY_SHAPES = {
    "qwen2_vl": {"pixel_values": (4, 1176), "image_grid_thw": (1, 3)},
    "qwen2_5_vl": {"pixel_values": (4, 1176), "image_grid_thw": (1, 3)},
    "internvl": {"pixel_values": (1, 3, 56, 56)},  # num_patches dropped: get_image_features takes none
    "llava": {"pixel_values": (1, 3, 56, 56)},
}


def tower_of(model: torch.nn.Module) -> torch.nn.Module:
    inner = model.model
    return getattr(inner, "visual", None) or inner.vision_tower


def projector_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    inner = model.model
    proj = getattr(getattr(inner, "visual", None), "merger", None) or inner.multi_modal_projector
    return list(proj.parameters())


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_dummy_image_inputs_are_what_get_image_features_takes(tiny_models, arch):
    model, processor = load_backbone(tiny_models(arch))
    dummy = dummy_image_inputs(processor, model)
    assert {k: tuple(v.shape) for k, v in dummy.items()} == DUMMY_SHAPES[arch]
    if arch.startswith("qwen"):
        assert dummy["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert model.get_image_features(**dummy).pooler_output is not None


def test_dummy_image_inputs_refuse_a_text_only_model(tiny_models):
    model, tokenizer = load_backbone(tiny_models("qwen2"))
    with pytest.raises(ValueError, match="no image processor or no get_image_features"):
        dummy_image_inputs(tokenizer, model)


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_a_text_batch_runs_the_tower_once_and_its_loss_is_unchanged(tiny_models, arch):
    model, processor = load_backbone(tiny_models(arch))
    sync = VisionSync(model, dummy_image_inputs(processor, model))
    runs = []
    tower_of(model).register_forward_hook(lambda *_: runs.append(1))
    batch = processor.tokenizer(["one two three", "four five"], return_tensors="pt", padding=True)

    plain = model(**batch).logits
    assert runs == []
    with sync(batch):
        synced = model(**batch).logits  # (B, S, V)
    assert len(runs) == 1
    assert torch.equal(plain, synced)
    # the projector is in the graph: it gets a gradient (of zeros) as on a rank with an image
    synced.sum().backward()
    grads = [p.grad for p in projector_params(model)]
    assert all(g is not None and not g.any() for g in grads)

    with sync(batch, generate=True):  # transformers encodes images before the prefill: so does sync
        assert len(runs) == 2
        model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert len(runs) == 2


def test_a_batch_with_images_is_left_to_the_model(tiny_models):
    model, processor = load_backbone(tiny_models("qwen2_vl"))
    sync = VisionSync(model, dummy_image_inputs(processor, model))
    runs = []
    tower_of(model).register_forward_hook(lambda *_: runs.append(1))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
    batch = processor(text=[text], images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    with sync(batch):
        model(**batch)
    assert len(runs) == 1  # the model's own run only


def accelerator(zero_stage: int | None = None, fsdp: bool = False) -> SimpleNamespace:
    ds = (
        None
        if zero_stage is None
        else SimpleNamespace(zero_stage=2, deepspeed_config={"zero_optimization": {"stage": zero_stage}})
    )
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=object() if fsdp else None))


def test_vision_sync_acts_only_where_weights_are_sharded(tiny_models):
    assert [shards_parameters(accelerator(s)) for s in (None, 2, 3)] == [False, False, True]
    assert shards_parameters(accelerator(fsdp=True))
    model, processor = load_backbone(tiny_models("qwen2_vl"))
    assert isinstance(vision_sync(accelerator(3), model, processor), VisionSync)
    assert not isinstance(vision_sync(accelerator(2), model, processor), VisionSync)
    text_model, tokenizer = load_backbone(tiny_models("qwen2"))
    assert not isinstance(vision_sync(accelerator(3), text_model, tokenizer), VisionSync)


def test_vision_sync_refuses_a_sharded_model_whose_tower_cannot_run_alone(tiny_models):
    model, processor = load_backbone(tiny_models("qwen2_vl"))
    with pytest.raises(ValueError, match="deepspeed_zero2.yaml.*data.train_file and data.eval_file an image"):
        vision_sync(accelerator(3), model, SimpleNamespace(tokenizer=processor.tokenizer))
