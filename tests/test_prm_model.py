"""PRM heads, collation and scoring: float labels stay floats; shared-prefix scores equal unshared."""

import math
import re

import pytest
import torch
from PIL import Image

from mmprm.data.schema import ImageDecodeError
from mmprm.models.loading import load_backbone
from mmprm.models.prm import (
    PRMScorer,
    PRMSpec,
    ProcessRewardModel,
    _pack_group,
    build_prm,
    collate_steps,
    model_input_keys,
)
from mmprm.steps import StepTokenError, tokenize_steps

ARCHS = ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"]


def _prm(tiny_models, arch, head="token_pair"):
    backbone, processor = load_backbone(tiny_models(arch))
    torch.manual_seed(0)
    return build_prm(backbone, processor, PRMSpec(head=head)), processor


def _images(arch, n=1, size=(28, 28)):
    return [] if arch == "qwen2" else [Image.new("RGB", size, (200, 30, 30)) for _ in range(n)]


@pytest.mark.parametrize("head", ["token_pair", "value"])
def test_soft_label_reaches_loss_as_float(tiny_models, head):
    from mmprm.scoring.losses import soft_bce_value, soft_ce_token_pair

    model, processor = _prm(tiny_models, "qwen2_vl", head)
    tok = tokenize_steps(processor, "Sum?", ["2 + 3 = 5.", "So 5."], _images("qwen2_vl"), labels=[1.0, 0.7])
    pad = processor.tokenizer.pad_token_id
    batch = collate_steps([tok], pad)
    assert batch["targets"].dtype == torch.float32
    assert batch["targets"].tolist() == [1.0, pytest.approx(0.7, abs=1e-7)]
    assert batch["targets"][1].item() == torch.tensor(0.7, dtype=torch.float32).item()
    logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
    loss = (soft_ce_token_pair if head == "token_pair" else soft_bce_value)(logits, batch["targets"])
    # hand formula with p = model probability of "good": -(t log p + (1-t) log(1-p)), t = 1.0 and 0.7
    p = ProcessRewardModel.probabilities(logits).double()
    t = torch.tensor([1.0, 0.7], dtype=torch.float64)
    expected = -(t * p.log() + (1 - t) * (1 - p).log()).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    # an int cast would make the second target 0: that loss is measurably different
    wrong = -(
        torch.tensor([1.0, 0.0], dtype=torch.float64) * p.log()
        + torch.tensor([0.0, 1.0], dtype=torch.float64) * (1 - p).log()
    ).mean()
    assert abs(wrong.item() - loss.item()) > 1e-3


def test_token_pair_head_equals_full_lm_logits(tiny_models):
    model, processor = _prm(tiny_models, "qwen2", "token_pair")
    tok = tokenize_steps(processor, "Sum?", ["2 + 3 = 5.", "So 5."], labels=[1.0, 0.0])
    batch = collate_steps([tok], processor.pad_token_id or 0)
    pair = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"])
    full = model.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[
        batch["step_mask"]
    ]
    assert torch.allclose(pair, full[:, model.reward_ids], atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sharing", ["trees", "split_trees", "prompt_cache"])
def test_prefix_shared_scores_equal_unshared(tiny_models, arch, sharing, monkeypatch):
    """A question's candidates scored together - packed into trees (split where a tree passes the
    token bound), or against one KV cache of the prompt where attention takes no tree mask - score
    as each one alone, repeated candidates and shared first steps included."""
    import mmprm.models.prm as prm_module

    monkeypatch.setattr(prm_module, "TREE_TOKEN_SHARE", 1.0)  # trees even where they share little
    if sharing == "split_trees":
        monkeypatch.setattr(prm_module, "SCORE_PACK_TOKENS", 40)
    if sharing == "prompt_cache":
        monkeypatch.setattr(prm_module, "_packs_trees", lambda backbone: False)
    packed = []
    monkeypatch.setattr(prm_module, "_pack_group", lambda *a: packed.append(_pack_group(*a)) or packed[-1])
    model, processor = _prm(tiny_models, arch, "value")
    scorer = PRMScorer(model, processor, batch_size=3)
    imgs = _images(arch, 1, (56, 42))
    cands = [
        ["Tile 1 is 3.", "3 + 4 = 7."],
        ["Tile 1 is 5.", "5 + 4 = 9.", "So 9."],
        ["7."],
        ["Tile 1 is 3.", "3 + 4 = 8."],
        ["a", "b", "c", "d"],
        ["Tile 1 is 3.", "3 + 4 = 7."],
    ]
    examples = [{"question": "Add the tiles.", "images": imgs, "steps": s} for s in cands]
    shared = scorer.score(examples, share_prefix=True)
    if sharing == "prompt_cache":
        assert packed == []
    else:  # one tree, or several under the bound; each candidate in exactly one of them
        trees = packed[-1]  # the outermost call ends last (a split calls itself on each half)
        assert (len(trees) > 1) == (sharing == "split_trees")
        assert all(len(t.input_ids) <= prm_module.SCORE_PACK_TOKENS or len(idx) == 1 for idx, t in trees)
        assert sorted(i for idx, _ in trees for i in idx) == list(range(len(cands)))
    plain = scorer.score(examples, share_prefix=False)
    assert [len(s) for s in shared] == [len(c) for c in cands]
    worst = max(abs(a - b) for s, p in zip(shared, plain) for a, b in zip(s, p))
    assert worst <= 1e-5, f"{arch}: shared-prefix scores differ by {worst}"


def test_candidates_go_to_a_tree_only_where_it_runs_far_fewer_tokens(tiny_models):
    """Repeated samples share most of their tokens in a tree; distinct ones would run as many tokens
    as with the prompt cache, plus the tree's mask: they keep the cache."""
    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor)
    imgs = _images("qwen2_vl", 1, (56, 42))

    def toks(cands):
        return [scorer.tokenize({"question": "Add the tiles.", "images": imgs, "steps": c}) for c in cands]

    repeated = toks([["Tile 1 is 3.", "3 + 4 = 7.", "So 7."]] * 7 + [["Tile 1 is 3.", "3 + 4 = 8.", "So 8."]])
    distinct = toks([[f"Tile 1 is {d}.", f"{d} + 4 = {d + 4}.", f"So {d + 4}."] for d in range(8)])
    trees = _pack_group(repeated, list(range(8)))
    assert trees is not None and len(trees) == 1 and trees[0][1].row_steps[0] == trees[0][1].row_steps[6]
    assert _pack_group(distinct, list(range(8))) is None


def test_scorer_batches_mixed_problems_and_keeps_order(tiny_models):
    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor, batch_size=2)
    ex = [{"question": f"Q{i % 2}", "images": _images("qwen2_vl"), "steps": ["x"] * (1 + i % 3)} for i in range(6)]
    single = [scorer.score([e])[0] for e in ex]
    batched = scorer.score(ex)
    for a, b in zip(single, batched):
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b))


@pytest.mark.slow  # scores many groups to watch memory: about 25 s each
@pytest.mark.parametrize("share_prefix", [True, False])
def test_scorer_holds_inputs_one_group_at_a_time(tiny_models, tmp_path, monkeypatch, share_prefix):
    """Tokenized inputs (their pixel values included) are dropped once scored: at 100k problems x
    64 candidates, holding them all before the first forward is terabytes."""
    import gc
    import weakref

    import mmprm.models.spec as spec_module  # where the scorers tokenize

    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor, batch_size=2)
    paths = []
    for i in range(10):
        paths.append(str(tmp_path / f"p{i}.png"))
        Image.new("RGB", (56, 42), (20 * i, 30, 30)).save(paths[-1])
    examples = [
        {"question": f"Q{i}", "images": [paths[i]], "steps": [f"Tile 1 is {j}.", f"So {i + j}."]}
        for i in range(10)
        for j in range(3)
    ]
    alive: list[weakref.ref] = []
    peak = [0]

    def tracked(fn):
        def wrapper(*args, **kwargs):
            gc.collect()
            peak[0] = max(peak[0], sum(r() is not None for r in alive))
            out = fn(*args, **kwargs)
            if out is not None:
                alive.append(weakref.ref(out))
            return out

        return wrapper

    monkeypatch.setattr(spec_module, "tokenize_steps", tracked(spec_module.tokenize_steps))
    monkeypatch.setattr(spec_module, "extend_steps", tracked(spec_module.extend_steps))
    expected = [scorer.score([e])[0] for e in examples]
    alive.clear()
    peak[0] = 0
    scores = scorer.score(examples, share_prefix=share_prefix)
    assert len(alive) == 30
    # shared: this group's 3 and the last group's 3; plain: a buffer of 8 batches of 2
    assert peak[0] <= (6 if share_prefix else 16), peak[0]
    for a, b in zip(expected, scores):
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b))


def test_empty_candidate_scores_as_empty_list(tiny_models):
    model, processor = _prm(tiny_models, "qwen2", "value")
    scorer = PRMScorer(model, processor)
    out = scorer.score(
        [{"question": "Q", "steps": []}, {"question": "Q", "steps": ["a"]}, {"question": "Q", "steps": ["b", "c"]}]
    )
    assert [len(s) for s in out] == [0, 1, 2]


def test_malformed_examples_are_refused_by_index_and_field(tiny_models, tmp_path):
    """A string of steps would be scored a character a step; it, a missing field and a single
    example not in a list are refused before any work, each example named by index (and id)."""
    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor)
    ok = {"question": "Q", "steps": ["a", "b"]}
    cases = {
        "examples[1] (id=s).steps: str, where a list of step texts is expected": [ok, {**ok, "id": "s", "steps": "ab"}],
        "examples[0].steps: NoneType": [{"question": "Q"}],
        "examples[0].steps[1]: NoneType, where text is expected": [{**ok, "steps": ["a", None]}],
        "examples[0].images: str, where a list of image paths is expected": [{**ok, "images": "x.png"}],
        "score() takes a list of examples": ok,
    }
    for message, examples in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            scorer.score(examples)
    # text the tokenizer reads as structure names the example it is in, also inside a shared group
    special = processor.tokenizer.eos_token
    group = [ok, {**ok, "id": "bad", "steps": ["a", f"b {special}"]}, {**ok, "steps": ["c"]}]
    with pytest.raises(StepTokenError, match=re.escape("examples[1] (id=bad): steps[1] contains the special token")):
        scorer.score(group)
    # a file that is not an image is named by its path
    fake = tmp_path / "fake.png"
    fake.write_text("not a png")
    with pytest.raises(ImageDecodeError, match=re.escape(f"{fake}: not a readable image")):
        scorer.score([{**ok, "images": [str(fake)]}])


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])  # the M-RoPE architectures
@pytest.mark.parametrize("sharing", ["trees", "prompt_cache", "none"])
def test_scores_do_not_depend_on_what_was_scored_before(tiny_models, arch, sharing, monkeypatch):
    """M-RoPE models keep the last image's position offset on the module; a text-only group scored
    after an image group must not inherit it."""
    import mmprm.models.prm as prm_module

    monkeypatch.setattr(prm_module, "TREE_TOKEN_SHARE", 1.0)  # trees even where they share little
    if sharing == "prompt_cache":
        monkeypatch.setattr(prm_module, "_packs_trees", lambda backbone: False)
    cands = [["Tile 1 is 3.", "3 + 4 = 7."], ["Tile 1 is 5.", "5 + 4 = 9.", "So 9."], ["7."]]
    text = [{"question": "Add the tiles.", "images": [], "steps": s} for s in cands]
    image = [{"question": "Add the tiles.", "images": _images(arch, 1, (56, 56)), "steps": s} for s in cands]
    share = sharing != "none"
    fresh = PRMScorer(*_prm(tiny_models, arch, "value"), batch_size=3).score(text, share_prefix=share)
    scorer = PRMScorer(*_prm(tiny_models, arch, "value"), batch_size=3)
    before = scorer.score(text, share_prefix=share)
    scorer.score(image, share_prefix=share)
    after = scorer.score(text, share_prefix=share)
    assert before == after == fresh


@pytest.mark.parametrize("gathered", [True, False], ids=["state_dict", "module"])
def test_saved_lora_prm_scores_as_the_model_in_memory(tiny_models, tmp_path, gathered):
    """save_prm merges LoRA from the module's weights or from a gathered state dict (what prm_train
    passes, ZeRO-3 or not) into a copy: the saved PRM scores as the model did, which is left as it was."""
    from peft import LoraConfig, get_peft_model

    from mmprm.models.prm import load_prm, save_prm

    model, processor = _prm(tiny_models, "qwen2_vl", head="value")
    model.backbone = get_peft_model(model.backbone, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # adapters start at zero: give them something to merge
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ex = [{"question": "Sum?", "images": _images("qwen2_vl"), "steps": ["2 + 3 = 5.", "So 5."]}]
    expected = PRMScorer(model, processor).score(ex)[0]
    with model.backbone.disable_adapter():
        unmerged = PRMScorer(model, processor).score(ex)[0]
    assert unmerged != pytest.approx(expected, abs=1e-3)  # the adapters move the scores
    save_prm(model, processor, tmp_path, state_dict=model.state_dict() if gathered else None)
    assert load_prm(tmp_path).score(ex)[0] == pytest.approx(expected, abs=1e-6)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# The language model's attention and MLP names: LLaVA's and InternVL's vision towers use the first
# four too, Qwen2.5-VL's the last three.
LM_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _in_vision_tower(name):
    return "vision_tower." in name or ("visual." in name and "merger" not in name)


@pytest.mark.parametrize("targets", [None, LM_LINEARS], ids=["default_targets", "lm_linears"])
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen2"])
def test_lora_prm_leaves_the_frozen_vision_tower_as_it_was(tiny_models, tmp_path, arch, targets):
    """LoRA as prm_train sets it up puts no adapter in the frozen vision tower: the saved (merged) PRM
    holds the base model's vision weights, while its language model carries the trained adapters."""
    from safetensors.torch import load_file

    from mmprm.models.prm import save_prm
    from mmprm.training.run import LoraConfig, TrainModelConfig, adapt_backbone

    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    if targets is not None:
        lora.target_modules = targets
    model, processor = _prm(tiny_models, arch, head="value")
    model.backbone = adapt_backbone(model.backbone, TrainModelConfig(lora=lora))
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert [n for n in adapted if _in_vision_tower(n)] == []
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(lora.target_modules)  # every name, in the LM
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # adapters start at zero: stand in for training
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    save_prm(model, processor, tmp_path / "prm")
    base, saved = load_file(tiny_models(arch) / "model.safetensors"), load_file(tmp_path / "prm" / "model.safetensors")
    tower = [k for k in base if _in_vision_tower(k)]
    assert tower and [k for k in tower if not torch.equal(saved[k], base[k])] == []
    q_proj = next(k for k in base if k.endswith("q_proj.weight") and not _in_vision_tower(k))
    assert not torch.equal(saved[q_proj], base[q_proj])  # the adapters were merged into the LM


def test_lora_reaches_the_vision_tower_only_when_it_is_not_frozen(tiny_models):
    """freeze_vision_tower=false lets target_modules match the tower's layers too; names that match
    only the frozen tower are refused by key, not left to peft's error after the model loaded."""
    from mmprm.config import ConfigError
    from mmprm.training.run import LoraConfig, TrainModelConfig, adapt_backbone

    backbone, _ = load_backbone(tiny_models("internvl"))
    cfg = TrainModelConfig(freeze_vision_tower=False, lora=LoraConfig(enabled=True, r=4, alpha=8))
    adapted = [n for n, m in adapt_backbone(backbone, cfg).named_modules() if hasattr(m, "lora_A")]
    assert any(_in_vision_tower(n) for n in adapted) and not all(_in_vision_tower(n) for n in adapted)
    backbone, _ = load_backbone(tiny_models("qwen2_vl"))
    tower_only = TrainModelConfig(lora=LoraConfig(enabled=True, target_modules=["qkv"]))  # Qwen2-VL's ViT attention
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qkv'\] name no layer of the language"):
        adapt_backbone(backbone, tower_only)
