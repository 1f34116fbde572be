"""ZeRO-3 in one process: what mmprm reads from partitioned weights (step token rows, the LM head).

A tiny model hides these bugs: DeepSpeed never partitions parameters under
`stage3_param_persistence_threshold` (1e5 elements). The models here have hidden 128 and a
1024-token vocabulary, so the embeddings and the LM head (1024 x 128 = 131,072) are partitioned.
The recipe runs with 1 and 2 ranks are in tests/test_deepspeed_recipes.py.
"""

from __future__ import annotations

import pytest
import torch
from ports import free_port

deepspeed = pytest.importorskip("deepspeed")

from mmprm.models.loading import add_step_token, load_backbone
from mmprm.models.prm import PRMSpec, ProcessRewardModel, build_prm
from mmprm.models.sharding import full_shape, gathered, partition_report
from mmprm.models.tiny import build_tiny_model
from mmprm.steps import tokenize_steps
from mmprm.training.collate import collate_steps

ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100_000},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny qwen2 (hidden 128) as built, and the same weights saved with 16 spare embedding rows
    (real checkpoints pad their vocabulary: Qwen2.5-VL has 151,936 rows for 151,665 tokens)."""
    root = tmp_path_factory.mktemp("zero3_models")
    plain = build_tiny_model("qwen2", root / "plain", hidden_size=128)
    model, tok = load_backbone(plain)
    model.resize_token_embeddings(len(tok) + 16, mean_resizing=False)
    model.save_pretrained(root / "spare")
    tok.save_pretrained(root / "spare")
    return plain, root / "spare"


@pytest.fixture
def zero3(monkeypatch):
    """One-rank gloo group plus transformers' ZeRO-3 switch, so `from_pretrained` loads partitioned."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    hf_config = HfDeepSpeedConfig(ZERO3)  # noqa: F841 - transformers holds a weak reference
    yield
    unset_hf_deepspeed_config()
    torch.distributed.destroy_process_group()
    deepspeed.comm.comm.cdb = None  # let the next test start a fresh group
    # an engine caches its clone of the world group; the next engine must clone the new one
    deepspeed.utils.groups._WORLD_GROUP = None


def _engine(prm: ProcessRewardModel):
    optimizer = torch.optim.AdamW([p for p in prm.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=prm, optimizer=optimizer, config=ZERO3)
    return engine


def test_add_step_token_reads_the_real_row_count_of_a_partitioned_embedding(models, zero3):
    _, spare = models
    model, processor = load_backbone(spare)
    weight = model.get_input_embeddings().weight
    assert weight.shape == (0,) and full_shape(weight) == (1040, 128)  # partitioned at load
    with gathered([weight]):
        before = weight.detach().clone()
    token_id = add_step_token(processor, model)
    weight = model.get_input_embeddings().weight
    # the id fits in the spare rows: nothing is resized (reading .shape[0] == 0 shrank it to 1025)
    assert token_id == 1024 and full_shape(weight) == (1040, 128)
    with gathered([weight]):
        assert torch.equal(weight.detach(), before)
    assert add_step_token(processor, model) == token_id  # idempotent


def test_add_step_token_grows_a_partitioned_embedding_without_spare_rows(models, zero3):
    plain, _ = models
    model, processor = load_backbone(plain)
    assert full_shape(model.get_input_embeddings().weight) == (1024, 128)
    assert add_step_token(processor, model) == 1024
    assert full_shape(model.get_input_embeddings().weight)[0] == 1025
    assert full_shape(model.get_output_embeddings().weight)[0] == 1025


def test_token_pair_head_under_zero3_equals_the_unpartitioned_model(models, zero3):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _, spare = models
    tokenizer_dir = spare
    model, processor = load_backbone(tokenizer_dir)
    prm = build_prm(model, processor, PRMSpec())
    engine = _engine(prm)
    lm_head = prm.backbone.get_output_embeddings().weight
    rows = {r["name"]: r for r in partition_report(prm)}
    assert lm_head.shape == (0,) and rows["backbone.lm_head.weight"]["partitioned"]

    unset_hf_deepspeed_config()  # the reference loads whole
    ref_model, ref_processor = load_backbone(tokenizer_dir)
    ref = build_prm(ref_model, ref_processor, PRMSpec()).eval()
    assert ref.reward_ids == prm.reward_ids

    hidden = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))  # (N, H)
    with torch.no_grad():
        direct = prm.head_logits(hidden)  # outside the engine: the module call gathers lm_head
        expected = ref.head_logits(hidden)
    assert direct.shape == (5, 2)
    torch.testing.assert_close(direct, expected, atol=1e-6, rtol=0)

    tok = tokenize_steps(processor, "What is 2 + 3?", ["2 + 3 = 5.", "So the answer is 5."], [], [1.0, 1.0])
    batch = collate_steps([tok], pad_id=0)
    engine.eval()
    with torch.no_grad():
        through_engine = engine(batch["input_ids"], batch["attention_mask"], batch["step_mask"])
        expected = ref(batch["input_ids"], batch["attention_mask"], batch["step_mask"])
    assert through_engine.shape == (2, 2)
    torch.testing.assert_close(through_engine, expected, atol=1e-5, rtol=0)

    # one training step: the LM head rows of "+"/"-" get gradients through the gathered module
    engine.train()
    loss = torch.nn.functional.cross_entropy(
        engine(batch["input_ids"], batch["attention_mask"], batch["step_mask"]), torch.tensor([0, 0])
    )
    engine.backward(loss)
    engine.step()
    with gathered([lm_head]):
        moved = (lm_head.detach() - ref.backbone.get_output_embeddings().weight.detach()).abs().sum(dim=1)
    assert moved[prm.reward_ids].min() > 0


def test_chunked_sft_loss_under_zero3_equals_the_unpartitioned_full_logits(models, zero3):
    """The chunked loss calls the partitioned LM head as a module, a chunk at a time, forward and
    recomputed in backward: the loss and the gradients equal the whole model's full-logits ones."""
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from mmprm.training.lm_loss import next_token_loss_sum

    plain, _ = models
    model, _ = load_backbone(plain)
    assert model.get_output_embeddings().weight.shape == (0,)  # partitioned
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3)
    unset_hf_deepspeed_config()
    ref, _ = load_backbone(plain)

    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :9] = -100  # a prompt without loss; 2 x 15 labelled tokens in chunks of 7
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    loss, n = next_token_loss_sum(engine, dict(batch), chunk_tokens=7)
    engine.backward(loss)
    expected, n_ref = next_token_loss_sum(ref, dict(batch), chunk_tokens=10**9)
    expected.backward()
    assert n == n_ref == 30
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(safe_get_full_grad(param), ref_param.grad, atol=1e-5, rtol=1e-5, msg=name)
