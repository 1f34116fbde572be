"""One optimizer step of a tiny PRM under FSDP2 in one gloo process on CPU; prints the gradient
norm before clipping and the one the optimizer steps with, as JSON.

    python tests/fsdp2_step.py MODEL_DIR OUT_DIR frozen|all [MAX_GRAD_NORM] [COMPILE]

accelerate takes FSDP for GPUs only, but torch's `fully_shard` runs on CPU with gloo: the script
builds the run as `TrainingRun` does, then switches its accelerator state to FSDP2, so
`TrainingRun.prepare` goes through accelerate's real FSDP2 preparation (every parameter replaced
by a sharded DTensor) and `_optimizer_step` clips what the optimizer steps.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist


def main(model_dir: str, out_dir: str, trainable: str, max_grad_norm: str = "1.0", compile: str = "false") -> None:
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.scoring.losses import soft_ce_token_pair
    from mmprm.steps import tokenize_steps
    from mmprm.training.collate import collate_steps
    from mmprm.training.run import TrainConfig, TrainingRun, TrainModelConfig, adapt_backbone, load_trainable_backbone

    train = TrainConfig(
        max_steps=1,
        batch_size=1,
        lr=1e-3,
        max_grad_norm=float(max_grad_norm),
        report_to="none",
        compile=compile == "true",
    )
    run = TrainingRun("fsdp2", train, out_dir, None)
    dist.init_process_group("gloo", rank=0, world_size=1)
    state = run.accelerator.state
    state.distributed_type = DistributedType.FSDP
    # each decoder layer its own FSDP unit, as launch/accelerate/fsdp.yaml asks
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=False
    )
    assert run.accelerator.is_fsdp2

    cfg = TrainModelConfig(name_or_path=model_dir, freeze_vision_tower=trainable == "frozen")
    backbone, processor = load_trainable_backbone(cfg)
    model = build_prm(backbone, processor, PRMSpec())
    model.backbone = adapt_backbone(model.backbone, cfg)
    prepared = run.prepare(model)
    run.batch_order([1])
    sharded = sum(isinstance(p, DTensor) for p in prepared.parameters())

    tok = tokenize_steps(processor, "What is 2 + 3?", ["2 + 3 = 6.", "So 6."], labels=[0.0, 0.0])
    batch = collate_steps([tok], processor.tokenizer.pad_token_id)
    logits = prepared(batch["input_ids"], batch["attention_mask"], batch["step_mask"])
    # a loss scaled far up: the gradient norm is far above train.max_grad_norm
    run.accelerator.backward(1e4 * soft_ce_token_pair(logits, batch["targets"]))

    def norm(params) -> float:
        n = get_total_norm([p.grad for p in params if p.grad is not None])
        return float(n.full_tensor() if isinstance(n, DTensor) else n)

    stepped = []
    inner = run.optimizer.optimizer  # accelerate's wrapper steps this one
    inner.register_step_pre_hook(lambda opt, *_: stepped.append(norm(p for g in opt.param_groups for p in g["params"])))
    before = norm(prepared.parameters())
    _, logged = run._optimizer_step(0.0)
    out = {
        "sharded": sharded,
        "before": before,
        "stepped": stepped[0],
        "logged": float(logged),
        "logits": logits.tolist(),
        "compiled_graphs": counters["stats"]["unique_graphs"],  # train.compile: traced under FSDP2
    }
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
