"""Tree packing: one problem's rows in one sequence give the step logits and the loss of the rows."""

import contextlib

import pytest
import torch
from PIL import Image

from mmprm.models import prm as prm_module
from mmprm.models.loading import load_backbone
from mmprm.models.prm import PRMScorer, PRMSpec, build_prm
from mmprm.scoring.losses import soft_bce_value
from mmprm.steps import TokenizedSteps, tokenize_steps
from mmprm.training import packing
from mmprm.training.collate import collate_steps, model_input_keys
from mmprm.training.packing import collate_packed, pack_rows, plan_packs

ARCHS = ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"]

# Three paths of one MCTS tree: rows 0 and 1 share step 1, row 2 is row 0 one step shorter.
STEPS = [
    (["Tile 1 is 3.", "3 + 4 = 7.", "So 7."], [1.0, 0.75, 0.5]),
    (["Tile 1 is 3.", "3 + 4 = 8."], [1.0, 0.0]),
    (["Tile 1 is 3.", "3 + 4 = 7."], [0.5, 0.25]),
]
# The packed node of each row step, rows in order: nodes are [step 1, "3 + 4 = 7.", "So 7.", "3 + 4 = 8."].
ROW_STEP_NODES = [0, 1, 2, 0, 3, 0, 1]


def _prm(tiny_models, arch, attn="sdpa"):
    backbone, processor = load_backbone(tiny_models(arch), attn_implementation=attn)
    torch.manual_seed(0)
    return build_prm(backbone, processor, PRMSpec(head="value")), processor


def _rows(processor, arch, question="Add the tiles."):
    images = [] if arch == "qwen2" else [Image.new("RGB", (56, 42), (200, 30, 30))]
    return [tokenize_steps(processor, question, steps, images, labels) for steps, labels in STEPS]


def test_pack_rows_shares_prefix_and_steps_by_hand():
    # prompt [7, 8]; each step is 2 tokens, the second the step token 9
    def row(steps, labels):
        ids = [7, 8] + [t for s in steps for t in (s, 9)]
        return TokenizedSteps(ids, [3 + 2 * k for k in range(len(steps))], labels, prompt_length=2)

    tree = pack_rows([row([1, 2, 3], [1.0, 0.75, 0.5]), row([1, 4], [1.0, 0.0]), row([1, 2], [0.5, 0.25])])
    # prefix, then depth first: step 1, its children "2" (then "3") and "4"
    assert tree.input_ids == [7, 8, 1, 9, 2, 9, 3, 9, 4, 9]
    assert tree.row_positions == [0, 1, 2, 3, 4, 5, 6, 7, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 1]
    assert tree.step_positions == [3, 5, 7, 9]
    assert tree.weights == [3.0, 2.0, 1.0, 1.0]
    assert tree.targets == [pytest.approx(2.5 / 3), 0.5, 0.5, 0.0]
    mask = tree.attention_mask()
    # the "4" step sees the prompt and step 1 (and itself), not the "2"/"3" branch beside it
    assert mask[8].tolist() == [True, True, True, True, False, False, False, False, True, False]
    assert mask[9].tolist() == [True, True, True, True, False, False, False, False, True, True]
    assert mask[7].tolist() == [True] * 8 + [False, False]


def test_pack_rows_refuses_rows_of_different_prompts():
    a = TokenizedSteps([7, 8, 1, 9], [3], [1.0], prompt_length=2)
    b = TokenizedSteps([7, 5, 1, 9], [3], [1.0], prompt_length=2)
    with pytest.raises(ValueError, match="do not share their prompt"):
        pack_rows([a, b], ids=["a", "b"])


def _count_tree_blocks(monkeypatch, block=4):
    """Attend by blocks of `block` queries (the trees here are far shorter than 64 tokens) and
    record each batch's blocks, whose `calls` count the layers that ran by blocks."""
    made, original = [], packing.tree_blocks

    def spy(sees, additive, size):
        made.append(original(sees, additive, size))
        return made[-1]

    monkeypatch.setattr(packing, "TREE_BLOCK", block)
    monkeypatch.setattr(packing, "tree_blocks", spy)
    return made


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logits_equal_row_logits(tiny_models, arch, monkeypatch):
    model, processor = _prm(tiny_models, arch)
    made = _count_tree_blocks(monkeypatch)
    rows = _rows(processor, arch)
    pad = _pad(processor)
    plain = model(**_inputs(collate_steps(rows, pad)))
    tree = pack_rows(rows)
    assert len(tree.input_ids) < sum(len(r.input_ids) for r in rows)
    # a second, different problem in the same batch checks padding and per-tree positions
    other = pack_rows(_rows(processor, arch, "Multiply the two tiles, then add one."))
    batch = collate_packed([tree, other], pad)
    packed = model(**_inputs(batch))[: len(tree.step_positions)]
    for i, node in enumerate(ROW_STEP_NODES):
        assert torch.allclose(packed[node], plain[i], atol=1e-5), f"{arch}: node {node} vs row step {i}"
    # the text attention really ran by blocks, in every layer, and a block saw fewer keys than the pack
    layers = model.backbone.config.get_text_config().num_hidden_layers
    assert len(made) == 1 and made[0].calls == layers, arch
    assert min(len(keys) for q0, q1, keys, _ in made[0].blocks[0] if q0 > 0) < len(tree.input_ids)


def test_attention_by_blocks_gives_the_gradients_of_the_full_mask(tiny_models, monkeypatch):
    model, processor = _prm(tiny_models, "qwen2_vl")
    batch = collate_packed(
        [pack_rows(_rows(processor, "qwen2_vl")), pack_rows(_rows(processor, "qwen2_vl", "Add tiles 1 and 2."))],
        _pad(processor),
    )

    def grads():
        model.zero_grad()
        soft_bce_value(model(**_inputs(batch)), batch["targets"], batch["step_weights"]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    made = _count_tree_blocks(monkeypatch, block=8)
    by_blocks = grads()
    assert made[0].calls > 0
    monkeypatch.setattr(packing, "tree_attention", lambda *a: contextlib.nullcontext())
    full = grads()
    assert by_blocks.keys() == full.keys()
    for name, g in full.items():
        assert torch.allclose(by_blocks[name], g, atol=1e-6, rtol=1e-4), name


def _count_written_backward(monkeypatch) -> list:
    """One entry per attention layer that ran `_AttentionByBlocks`."""
    applied, apply = [], packing._AttentionByBlocks.apply
    monkeypatch.setattr(packing._AttentionByBlocks, "apply", lambda *a: applied.append(1) or apply(*a))
    return applied


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_by_blocks_backward_gives_autograds_gradients_to_the_bit(tiny_models, arch, monkeypatch):
    """The blocks' backward written out (`_AttentionByBlocks`) adds each block's gradients in the
    order autograd adds them through the slices: the same loss and gradients, bit for bit."""
    model, processor = _prm(tiny_models, arch)
    batch = collate_packed(
        [pack_rows(_rows(processor, arch)), pack_rows(_rows(processor, arch, "Add tiles 1 and 2."))],
        _pad(processor),
    )
    _count_tree_blocks(monkeypatch, block=4)
    applied = _count_written_backward(monkeypatch)

    def loss_and_grads():
        model.zero_grad()
        loss = soft_bce_value(model(**_inputs(batch)), batch["targets"], batch["step_weights"])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    assert len(applied) == model.backbone.config.get_text_config().num_hidden_layers
    monkeypatch.setattr(packing, "_blocks_backward_applies", lambda *a: False)  # autograd through the blocks
    loss_autograd, grads_autograd = loss_and_grads()
    assert len(applied) == model.backbone.config.get_text_config().num_hidden_layers
    assert torch.equal(loss, loss_autograd)
    assert grads.keys() == grads_autograd.keys()
    for name, g in grads_autograd.items():
        assert torch.equal(grads[name], g), name


def test_attention_by_blocks_backward_is_not_taken_without_autograd_or_under_autocast(tiny_models, monkeypatch):
    model, processor = _prm(tiny_models, "qwen2_vl")
    batch = collate_packed([pack_rows(_rows(processor, "qwen2_vl"))], _pad(processor))
    applied = _count_written_backward(monkeypatch)
    with torch.no_grad():
        model(**_inputs(batch))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**_inputs(batch))
    assert applied == []


def test_attention_by_blocks_stays_out_of_gradient_checkpointing(tiny_models, monkeypatch):
    """Checkpointing recomputes outside the context; by blocks it would save other tensors than it
    recomputes, and the checkpoint refuses that. The full mask runs instead, and training works."""
    model, processor = _prm(tiny_models, "qwen2_vl")
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    made = _count_tree_blocks(monkeypatch)
    batch = collate_packed([pack_rows(_rows(processor, "qwen2_vl"))], _pad(processor))
    soft_bce_value(model(**_inputs(batch)), batch["targets"], batch["step_weights"]).backward()
    assert made == []
    assert model.value_head.weight.grad is not None


def test_packed_weighted_loss_equals_row_loss(tiny_models):
    model, processor = _prm(tiny_models, "qwen2_vl")
    rows = _rows(processor, "qwen2_vl")
    pad = _pad(processor)
    plain = collate_steps(rows, pad)
    row_loss = soft_bce_value(model(**_inputs(plain)), plain["targets"])
    packed = collate_packed([pack_rows(rows)], pad)
    tree_loss = soft_bce_value(model(**_inputs(packed)), packed["targets"], packed["step_weights"])
    # Cross-entropy is linear in the target: the rows through a node add up to their count times
    # the loss against their mean label, so the weighted mean over nodes is the mean over row steps.
    assert packed["step_weights"].sum().item() == len(plain["targets"]) == 7
    assert tree_loss.item() == pytest.approx(row_loss.item(), abs=1e-5)


def test_eager_attention_takes_the_packed_mask(tiny_models):
    sdpa, processor = _prm(tiny_models, "qwen2_vl")
    eager, _ = _prm(tiny_models, "qwen2_vl", attn="eager")
    batch = collate_packed([pack_rows(_rows(processor, "qwen2_vl"))], _pad(processor))
    assert torch.allclose(sdpa(**_inputs(batch)), eager(**_inputs(batch)), atol=1e-5)


def test_plan_packs_groups_by_problem_and_splits_at_the_budget():
    def row(index, key, steps):
        ids = [7, 8] + [t for s in steps for t in (s, 9)]
        positions = [3 + 2 * k for k in range(len(steps))]
        return {"index": index, "key": key, "input_ids": ids, "step_positions": positions, "prompt_length": 2}

    rows = [
        row(0, "a", [1, 2, 3]),
        row(1, "b", [5]),
        row(2, "a", [1, 4]),
        row(3, "a", [1, 2]),  # adds nothing: a prefix of row 0
        {**row(4, "a", [6]), "prompt_length": -1},  # no known prompt: packs alone
    ]
    plan = plan_packs(rows, max_tokens=100)
    assert plan.packs == [[4], [0, 2, 3], [1]]
    assert plan.lengths == [4, 10, 4]  # a: prompt 2 + steps "1","2","3","4" of 2 tokens
    assert plan.row_tokens == 8 + 4 + 6 + 6 + 4
    tight = plan_packs(rows, max_tokens=8)  # row 2's new step would make 10
    assert tight.packs == [[0], [4], [2, 3], [1]]
    assert tight.lengths == [8, 4, 8, 4]


def test_plan_packs_keeps_few_packs_open():
    """Rows grouped by problem (as annotation writes them) pack the same with 2 packs open as with
    all open; interleaved rows still put every row in one pack under the budget, in more packs."""

    def row(index, key, steps):
        ids = [7, 8] + [t for s in steps for t in (s, 9)]
        return {
            "index": index,
            "key": key,
            "input_ids": ids,
            "step_positions": [3 + 2 * k for k in range(len(steps))],
            "prompt_length": 2,
        }

    grouped = [row(4 * p + r, f"p{p}", [p, r]) for p in range(50) for r in range(4)]
    many, few = plan_packs(grouped, max_tokens=100), plan_packs(grouped, max_tokens=100, max_open=2)
    assert sorted(map(sorted, few.packs)) == sorted(map(sorted, many.packs)) and len(few.packs) == 50
    interleaved = [row(4 * p + r, f"p{p % 5}", [p, r]) for r in range(4) for p in range(50)]
    plan = plan_packs(interleaved, max_tokens=100, max_open=2)
    assert sorted(i for pack in plan.packs for i in pack) == list(range(200))
    assert all(length <= 100 for length in plan.lengths) and len(plan.packs) > 5


def _inputs(batch):
    keys = ("input_ids", "attention_mask", "step_mask")
    return {**{k: batch[k] for k in keys}, **model_input_keys(batch)}


def _pad(processor):
    return getattr(processor, "tokenizer", processor).pad_token_id or 0


@pytest.mark.parametrize("dtype", ["autocast", "bfloat16"])
def test_packed_forward_runs_in_bf16(tiny_models, dtype):
    model, processor = _prm(tiny_models, "qwen2_vl")
    batch = collate_packed([pack_rows(_rows(processor, "qwen2_vl"))], _pad(processor))
    full = model(**_inputs(batch))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        low = model(**_inputs(batch))
    assert low.dtype in (torch.bfloat16, torch.float32) and torch.isfinite(low.float()).all()
    assert torch.allclose(low.float(), full, atol=0.1), (low, full)


def test_packed_logits_equal_row_logits_with_lora(tiny_models):
    from peft import LoraConfig, get_peft_model

    model, processor = _prm(tiny_models, "qwen2_vl")
    model.backbone = get_peft_model(model.backbone, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rows = _rows(processor, "qwen2_vl")
    plain = model(**_inputs(collate_steps(rows, _pad(processor))))
    packed = model(**_inputs(collate_packed([pack_rows(rows)], _pad(processor))))
    assert torch.allclose(packed[ROW_STEP_NODES], plain, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_1_5_hf", "internvl3_hf"])
def test_packed_logits_equal_row_logits_on_real_chat_templates(tmp_path, family, monkeypatch):
    """Checkpoints shaped like real ones, not our presets: Qwen2-VL's template adds a default system
    prompt, LLaVA-1.5's tokenizer prepends BOS and pads on the left, InternVL3 wraps each image in
    context tokens. The prefix the rows share, and so the tree, comes from their own tokenization;
    the packed forward attends by blocks of the tree, and scoring reads the rows back from it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from template_families import build_family_checkpoint

    backbone, processor = load_backbone(build_family_checkpoint(family, tmp_path / family))
    torch.manual_seed(0)
    model = build_prm(backbone, processor, PRMSpec(head="value"))
    rows = _rows(processor, family)
    plain = model(**_inputs(collate_steps(rows, _pad(processor))))
    tree = pack_rows(rows)
    assert len(tree.input_ids) < sum(len(r.input_ids) for r in rows)
    made = _count_tree_blocks(monkeypatch)
    packed = model(**_inputs(collate_packed([tree], _pad(processor))))
    assert torch.allclose(packed[ROW_STEP_NODES], plain, atol=1e-5), family
    assert made[0].calls == model.backbone.config.get_text_config().num_hidden_layers, family
    # the scorer packs these rows as one tree (forced: three rows share too little to choose it)
    monkeypatch.setattr(prm_module, "TREE_TOKEN_SHARE", 1.0)
    scorer = PRMScorer(model, processor)
    image = Image.new("RGB", (56, 42), (200, 30, 30))
    scored = scorer.score([{"question": "Add the tiles.", "images": [image], "steps": s} for s, _ in STEPS])
    assert len(made) == 2, family  # the training forward above, then the scorer's tree
    flat = torch.tensor([x for row in scored for x in row])
    assert torch.allclose(flat, torch.sigmoid(plain), atol=1e-5), family


def test_tree_block_mask_skips_the_blocks_no_path_sees():
    """A 128-token prompt and two 256-token branches (five 128-token blocks): branch B's queries
    never visit branch A's key blocks, so 11 of the 25 blocks run (a causal mask runs 15)."""
    from mmprm.training.packing import tree_block_mask

    tree = packing.PackedTree(
        input_ids=[0] * 640,
        row_positions=list(range(384)) + list(range(128, 384)),
        node_of_token=[0] * 128 + [1] * 256 + [2] * 256,
        parents=[-1, 0, 0],
        step_positions=[383, 639],
        targets=[1.0, 0.0],
        weights=[1.0, 1.0],
        row_steps=[[0], [1]],
    )
    mask = tree.attention_mask()[None, None]
    blocks = tree_block_mask(mask)
    per_query_block = (blocks.kv_num_blocks + blocks.full_kv_num_blocks)[0, 0].tolist()
    assert per_query_block == [1, 2, 3, 2, 3]
    assert blocks.to_dense()[0, 0].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]


@pytest.mark.slow  # FlexAttention compiles its kernel (torch.compile) on first use
@pytest.mark.parametrize("arch", ["qwen2", "internvl"])
def test_flex_attention_with_the_tree_block_mask_gives_the_row_logits(tiny_models, arch):
    """`attn_implementation=flex_attention`: the packed batch through FlexAttention and the tree
    block mask gives each step the logit its row gets with sdpa."""
    model, processor = _prm(tiny_models, arch)
    flex, _ = _prm(tiny_models, arch, attn="flex_attention")
    rows = _rows(processor, arch)
    pad = _pad(processor)
    with torch.no_grad():
        plain = model(**_inputs(collate_steps(rows, pad)))
        other = pack_rows(_rows(processor, arch, "Multiply the two tiles, then add one."))
        tree = pack_rows(rows)
        packed = flex(**_inputs(collate_packed([tree, other], pad)))[: len(tree.step_positions)]
    for i, node in enumerate(ROW_STEP_NODES):
        assert torch.allclose(packed[node], plain[i], atol=1e-5), f"{arch}: node {node} vs row step {i}"


def test_flex_attention_on_an_architecture_without_it_is_refused_naming_the_key(tiny_models):
    from mmprm.config import ConfigError

    with pytest.raises(ConfigError, match="model.attn_implementation=flex_attention: .*Qwen2VL.*set model.attn"):
        load_backbone(tiny_models("qwen2_vl"), attn_implementation="flex_attention")


@pytest.mark.slow
def test_compiled_layers_do_not_recompile_for_each_new_pack(tiny_models, monkeypatch):
    """The blocked attention is a Python loop over a pack's blocks: traced into a compiled decoder
    layer (`train.compile` with `data.pack_trees`), every pack of a new length or block count
    recompiled the layer, each a minute of inductor on CPU, until dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    from mmprm.models.compile_layers import compile_decoder_layers

    model, processor = _prm(tiny_models, "qwen2")
    made = _count_tree_blocks(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    try:
        compile_decoder_layers(model, backend="aot_eager")
        questions = ["Add.", "Add the two tiles, then the third one.", "Add " + "each tile of the grid, " * 6]
        for question in questions:  # three packs of three lengths, so three block counts
            batch = collate_packed([pack_rows(_rows(processor, "qwen2", question))], _pad(processor))
            soft_bce_value(model(**_inputs(batch)), batch["targets"], batch["step_weights"]).backward()
        assert len({len(m.blocks[0]) for m in made}) == 3 and all(m.calls for m in made)
        # a graph before the attention and one after it, traced once with dynamic shapes
        assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
