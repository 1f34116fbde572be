"""GPU probe: the kernels and numbers `benchmarks/gpu_check.py` does not cover, one JSON line each.

    python benchmarks/gpu_probe.py                            # every probe, on the visible GPU
    python benchmarks/gpu_probe.py --only liger,mfu --out probe.jsonl
    python benchmarks/gpu_probe.py --allow-cpu                # CPU, shapes scaled down (the tests)

Written for one lent GPU (H100 or H200) and a short time budget: each probe prints its JSON line
as soon as it finishes (flushed), so a timeout loses only the probe in flight, and a last line sums
up: {"script": "gpu_probe", "ok", "failed", "seconds", "device", "torch"}. Every probe line has
"probe", "ok", "seconds" and its numbers; a probe that raises reports "error" and the next one runs.
A probe that cannot run (liger-kernel missing, a CUDA-only kernel on CPU) fails on a GPU
("cannot_run") and is "not_applicable" (ok) on CPU under --allow-cpu (`unavailable`).

Numbers are compared in float32 against a float32 reference computed from the same (rounded)
inputs: `compare` gives max |diff|, that over max |reference|, and the relative L2 error the
verdict reads (`TOLERANCE`).

Exit 0 when every probe run passed, 1 when one failed, 2 when no CUDA GPU is visible (without
--allow-cpu) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Relative L2 error allowed against the float32 reference. bf16 keeps 8 significant bits (unit
# roundoff 2^-8 = 3.9e-3): one rounding of every element costs ~1e-3 in relative L2, and the kernels
# here round a few times (logits, outputs, gradients; Liger sums weight-gradient chunks in bf16).
# 1e-2 leaves that a margin, while a wrong mask, shift or ignore index is off by far more (order 1).
# float32 kernels differ only in summation order: ~1e-7, so 1e-5.
TOLERANCE: dict[torch.dtype, float] = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
# mfu: a bf16 GEMM runs at 0.3x-1.2x the table's peak; outside it the table entry or the GPU is wrong.
PEAK_RATIO = (0.3, 1.2)


def unavailable(why: str, on_gpu: bool) -> dict[str, Any]:
    """A probe (or part) that cannot run: a failure on a GPU, where it should; not applicable on CPU."""
    return {"ok": False, "cannot_run": why} if on_gpu else {"ok": True, "not_applicable": why}


def compare(got: torch.Tensor, want: torch.Tensor, tol: float) -> dict[str, Any]:
    """Differences of `got` from the reference `want` (any equal shapes), computed in float64.

    Returns max_abs = max |got - want|, max_rel = max_abs / max |want|, rel_l2 = ||got - want|| /
    ||want||, and ok = rel_l2 <= tol (a zero reference needs got == want exactly).
    """
    diff = got.double() - want.double()
    scale, norm = want.double().abs().max(), want.double().norm()
    max_abs = float(diff.abs().max())
    rel_l2 = float(diff.norm() / norm) if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return {
        "max_abs": _sig(max_abs),
        "max_rel": _sig(max_abs / float(scale)) if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "rel_l2": _sig(rel_l2),
        "ok": rel_l2 <= tol,
    }


def table_key(device_name: str) -> str | None:
    """The `mmprm.mfu.PEAK_BF16_TFLOPS` key `peak_flops` takes for a device name (its first key in
    the name), or None."""
    from mmprm.mfu import PEAK_BF16_TFLOPS

    return next((key for key in PEAK_BF16_TFLOPS if key in device_name), None)


def peak_ratio_ok(measured_tflops: float, table_tflops: float | None) -> bool:
    """Whether a measured bf16 GEMM rate is plausible for the table's peak: within `PEAK_RATIO`."""
    if not table_tflops:
        return False
    return PEAK_RATIO[0] < measured_tflops / table_tflops < PEAK_RATIO[1]


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Mean wall seconds of `fn()` over `iters` calls after `warmup` calls, the device synchronized."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


# ----------------------------------------------------------------------------------------- liger


class _HiddenStateLM(nn.Module):
    """A causal LM whose last hidden state is a parameter: `next_token_loss_sum` runs on it as on a
    real model (output_hidden_states, logits_to_keep, get_output_embeddings), and the gradient of
    the hidden state is that parameter's."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        super().__init__()
        self.hidden = nn.Parameter(hidden.clone())  # (B, S, H)
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight.clone())  # (V, H)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, use_cache: bool = False, output_hidden_states: bool = False, logits_to_keep: int = 0) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kept = self.hidden[:, -logits_to_keep:] if logits_to_keep else self.hidden
        states = (self.hidden,) if output_hidden_states else None
        return CausalLMOutputWithPast(logits=self.lm_head(kept), hidden_states=states)


def _mmprm_loss(hidden, weight, labels, chunk_tokens: int, use_liger: bool) -> tuple[torch.Tensor, ...]:
    """mmprm's `next_token_loss_sum` on (B, S, H) hidden states and a (V, H) LM head: the loss sum,
    its gradients of hidden and weight (float32), and the labelled count."""
    from mmprm.training.lm_loss import next_token_loss_sum

    model = _HiddenStateLM(hidden, weight)
    loss, count = next_token_loss_sum(model, {"labels": labels}, chunk_tokens=chunk_tokens, use_liger=use_liger)
    loss.backward()
    return loss.detach().float(), model.hidden.grad.float(), model.lm_head.weight.grad.float(), count


def _reference_loss(hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    """The same from full float32 logits and `F.cross_entropy`, labels[:, t + 1] the target at t."""
    from mmprm.training.data import IGNORE

    h = hidden.float().clone().requires_grad_()
    w = weight.float().clone().requires_grad_()
    logits = h[:, :-1] @ w.T  # (B, S - 1, V)
    targets = labels[:, 1:]  # (B, S - 1)
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad, int((targets != IGNORE).sum())


def _compare_loss(got: tuple, want: tuple, tol: float) -> dict[str, Any]:
    out = {key: compare(g, w, tol) for key, g, w in zip(("loss", "d_hidden", "d_weight"), got[:3], want[:3])}
    out["labelled_count_equal"] = got[3] == want[3]
    out["ok"] = out["labelled_count_equal"] and all(out[key]["ok"] for key in ("loss", "d_hidden", "d_weight"))
    return out


def probe_liger(device: torch.device) -> dict[str, Any]:
    """mmprm's next_token_loss_sum (Liger and chunked paths) vs cross-entropy on full logits: loss, d hidden, d W."""
    from mmprm.training import lm_loss
    from mmprm.training.data import IGNORE

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows, seq, width, vocab = (2, 2049, 1024, 32000) if cuda else (2, 129, 64, 1000)
    # below the batch's B * (S - 1) positions, so the loss takes the hidden-state path (Liger or
    # chunks), not the plain full-logits one
    chunk = 1024 if cuda else 64
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, seq, width, generator=gen).to(device, dtype)  # (B, S, H), a final norm's scale
    weight = (0.02 * torch.randn(vocab, width, generator=gen)).to(device, dtype)  # (V, H), HF's init std
    labels = torch.randint(vocab, (rows, seq), generator=gen)  # (B, S)
    labels[torch.rand(rows, seq, generator=gen) < 0.1] = IGNORE
    labels[:, :16] = IGNORE  # a prompt
    labels = labels.to(device)
    tol = TOLERANCE[dtype]
    want = _reference_loss(hidden, weight, labels)  # from the same rounded inputs, in float32
    result: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": rows * (seq - 1),
        "labelled": want[3],
        "hidden": width,
        "vocab": vocab,
        "chunk_tokens": chunk,
        "tolerance_rel_l2": tol,
        "chunked": _compare_loss(_mmprm_loss(hidden, weight, labels, chunk, use_liger=False), want, tol),
    }
    if not cuda:
        why = "Liger's kernel is Triton on CUDA only"
    elif not lm_loss.liger_available():
        why = "liger-kernel is not installed (pip install 'mmprm[liger]')"
    else:
        why = None
    if why is not None:
        status = unavailable(why, cuda)
        return {**result, **status, "ok": status["ok"] and result["chunked"]["ok"]}
    # _liger_loss answers None where it would fall back to chunks: then the "liger" numbers are the chunks'
    head = _HiddenStateLM(hidden[:, :1], weight).lm_head
    result["liger_path_taken"] = lm_loss._liger_loss(head, hidden[0, 16:18], labels[0, 17:19]) is not None
    result["liger"] = _compare_loss(_mmprm_loss(hidden, weight, labels, chunk, use_liger=True), want, tol)
    result["ok"] = result["chunked"]["ok"] and result["liger_path_taken"] and result["liger"]["ok"]
    return result


# ------------------------------------------------------------------------------------- flex_tree


def tree_rows(prompt: int, depth: int, branch: int, step_tokens: int, seed: int) -> list:
    """Every root-to-leaf row of a full tree (`branch` children per step, `depth` steps), as an MCTS
    export has them: one prompt, each step `step_tokens` random ids ending with the step token 1."""
    from mmprm.steps import TokenizedSteps

    rng = random.Random(seed)
    rows = []

    def grow(ids: list[int], positions: list[int]) -> None:
        for _ in range(branch):
            row = ids + [rng.randrange(2, 30000) for _ in range(step_tokens - 1)] + [1]
            steps = [*positions, len(row) - 1]
            if len(steps) == depth:
                rows.append(TokenizedSteps(row, steps, [rng.random() for _ in steps], prompt_length=prompt))
            else:
                grow(row, steps)

    grow([rng.randrange(2, 30000) for _ in range(prompt)], [])
    return rows


def _sdpa_dense(q, k, v, sees):
    """sdpa with the (B, 1, L, L) bool tree mask, key/value heads repeated per query group: (B, L, H, D)."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=sees)
    return out.transpose(1, 2)


class _Training(nn.Module):
    """The `module` transformers' attention functions read `.training` from (flex compiles for it)."""


def _flex(q, k, v, block_mask):
    """FlexAttention with the block mask: (B, L, H, D). On CUDA the function `attn_implementation=
    flex_attention` runs (transformers', compiled); on CPU eager flex (compiling it takes ~30 s)."""
    if q.is_cuda:
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(_Training().train(), q, k, v, block_mask)[0]
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # "called without torch.compile(): unfused implementation"
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)


def _attend(attend: Callable, inputs: tuple, grad_out: torch.Tensor | None, dtype: torch.dtype) -> dict:
    """Run `attend(q, k, v)` in `dtype`: its output and (with grad_out) q/k/v gradients, float32."""
    leaves = [t.detach().to(dtype, copy=True).requires_grad_(grad_out is not None) for t in inputs]
    out = attend(*leaves)
    got = {"out": out.detach().float()}
    if grad_out is not None:
        out.backward(grad_out.to(dtype))
        got.update({name: t.grad.float() for name, t in zip(("d_q", "d_k", "d_v"), leaves)})
    return got


def probe_flex_tree(device: torch.device) -> dict[str, Any]:
    """FlexAttention with mmprm's tree block mask vs sdpa with the dense tree mask: outputs, q/k/v gradients."""
    from mmprm.training.packing import collate_packed, pack_rows, tree_block_mask

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, head_dim = (16, 4, 128) if cuda else (4, 2, 16)
    # (prompt tokens, depth, branching, tokens per step) of each tree: 4384 and 1824 tokens on GPU
    shapes = [(1024, 3, 4, 40), (1024, 2, 4, 40)] if cuda else [(64, 2, 3, 12), (64, 1, 3, 12)]
    trees = [pack_rows(tree_rows(*shape, seed=i)) for i, shape in enumerate(shapes)]
    sees = collate_packed(trees, pad_id=0)["attention_mask"].to(device)  # (B, 1, L, L) bool
    batch, length = sees.shape[0], sees.shape[-1]
    block_mask = tree_block_mask(sees)
    n_q, n_kv = (math.ceil(length / size) for size in block_mask.BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    # rounded to the probe's dtype first, so the float32 reference sees the same inputs
    q = torch.randn(batch, heads, length, head_dim, generator=gen).to(dtype).float().to(device)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(dtype).float().to(device) for _ in "kv")
    grad_out = torch.randn(batch, length, heads, head_dim, generator=gen).to(dtype).float().to(device)
    tol = TOLERANCE[dtype]
    result: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "length": length,
        "tree_tokens": [len(t.input_ids) for t in trees],
        "tree_rows": [len(t.row_steps) for t in trees],
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": list(block_mask.BLOCK_SIZE),
        "blocks_nonempty": int((block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum()),
        "blocks_causal": batch * n_q * (n_q + 1) // 2,
        "blocks_total": batch * n_q * n_kv,
        "flex_kernel": "transformers flex_attention_forward (compiled)" if cuda else "flex_attention, eager (unfused)",
        "tolerance_rel_l2": tol,
    }
    want = _attend(lambda *t: _sdpa_dense(*t, sees), (q, k, v), grad_out, torch.float32)
    backward_why = None
    try:
        flex = _attend(lambda *t: _flex(*t, block_mask), (q, k, v), grad_out, dtype)
    except NotImplementedError as e:  # torch 2.13: "FlexAttention does not support backward on CPU"
        if cuda:
            raise
        backward_why = f"backward: {e}"
        flex = _attend(lambda *t: _flex(*t, block_mask), (q, k, v), None, dtype)
    result["flex"] = {key: compare(flex[key], want[key], tol) for key in flex}
    if cuda:  # context: how far sdpa itself is in bf16 (not judged)
        low = _attend(lambda *t: _sdpa_dense(*t, sees), (q, k, v), grad_out, dtype)
        result["sdpa_bf16"] = {key: compare(low[key], want[key], tol) for key in low}
    result["ok"] = all(d["ok"] for d in result["flex"].values())
    if backward_why is not None:
        result.update({**unavailable(backward_why, cuda), "ok": result["ok"]})
    return result


# --------------------------------------------------------------------------------------- compile


def _step_batches(processor: Any, n: int, rows: int, steps: int, device: torch.device) -> list[dict]:
    """n collated PRM batches of `rows` addition rows of `steps` labelled steps, the last row one step
    shorter: every batch has padding, so every one passes a mask (a batch without would compile a
    second graph, mask None)."""
    from mmprm.steps import tokenize_steps
    from mmprm.training.collate import collate_steps

    rng = random.Random(0)
    pad = getattr(processor, "tokenizer", processor).pad_token_id or 0
    batches = []
    for b in range(n):
        items = []
        for i in range(rows):
            total, texts, labels = rng.randint(1, 50), [], []
            for _ in range(steps - (i == rows - 1)):
                x, wrong = rng.randint(1, 50), rng.random() < 0.2
                texts.append(f"{total} + {x} = {total + x + wrong}.")
                labels.append(0.0 if wrong or (labels and labels[-1] == 0.0) else 1.0)
                total += x
            items.append(tokenize_steps(processor, f"Add the numbers of problem {b}-{i}.", texts, [], labels))
        batches.append({k: v.to(device) for k, v in collate_steps(items, pad).items()})
    return batches


def _train_steps(model: nn.Module, batches: list[dict], bf16: bool) -> tuple[list[float], list[float]]:
    """One AdamW step per batch (bf16 autocast, as train.bf16 runs): the losses and step seconds."""
    from mmprm.scoring.losses import soft_ce_token_pair
    from mmprm.training.collate import model_input_keys

    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, seconds = [], []
    for batch in batches:
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        loss = soft_ce_token_pair(logits.float(), batch["targets"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return losses, seconds


def probe_compile(device: torch.device) -> dict[str, Any]:
    """train.compile (inductor, per decoder layer) vs eager: a tiny Qwen2 PRM's losses on the same steps; step times."""
    from torch._dynamo.utils import counters

    from mmprm.models.compile_layers import compile_decoder_layers
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.models.tiny import build_tiny_model

    cuda = device.type == "cuda"
    torch.manual_seed(0)  # the step token's new embedding row is drawn at random
    size = {"hidden_size": 1024, "num_layers": 4, "head_dim": 64} if cuda else {"hidden_size": 64, "num_layers": 2}
    warmup, timed = (3, 10) if cuda else (1, 2)
    models, processor = [], None
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("qwen2", Path(tmp) / "qwen2", seed=0, **size)
        for _ in range(2):
            backbone, processor = load_backbone(path)
            models.append(build_prm(backbone, processor, PRMSpec()).to(device).train())
    eager_model, compiled_model = models
    compiled_model.load_state_dict(eager_model.state_dict())  # the same weights, the step token's row too
    n_layers = compile_decoder_layers(compiled_model)
    graphs = counters["stats"]["unique_graphs"]
    batches = _step_batches(processor, warmup + timed, rows=8 if cuda else 2, steps=12 if cuda else 4, device=device)
    eager_losses, eager_s = _train_steps(eager_model, batches, bf16=cuda)
    compiled_losses, compiled_s = _train_steps(compiled_model, batches, bf16=cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    losses = compare(torch.tensor(compiled_losses), torch.tensor(eager_losses), TOLERANCE[dtype])
    eager_step, compiled_step = statistics.median(eager_s[warmup:]), statistics.median(compiled_s[warmup:])
    return {
        "ok": losses["ok"],
        "dtype": "bfloat16 autocast" if cuda else "float32",
        "model": f"tiny qwen2 PRM, {size}",
        "compiled_layers": n_layers,
        "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
        "steps": warmup + timed,
        "warmup_steps": warmup,
        "tokens_per_batch": int(batches[0]["attention_mask"].sum()),
        "eager_losses": [_sig(x, 6) for x in eager_losses],
        "compiled_losses": [_sig(x, 6) for x in compiled_losses],
        "losses": losses,
        "tolerance_rel_l2": TOLERANCE[dtype],
        "compiled_first_step_s": round(compiled_s[0], 3),
        "eager_step_s": _sig(eager_step),
        "compiled_step_s": _sig(compiled_step),
        "speedup_compiled_vs_eager": _sig(eager_step / compiled_step, 3),
    }


# ------------------------------------------------------------------------------------------- mfu


def probe_mfu(device: torch.device) -> dict[str, Any]:
    """A bf16 matmul's TFLOP/s vs mmprm.mfu's peak table for this GPU: measured, entry, ratio, matched key."""
    from mmprm.mfu import peak_flops

    cuda = device.type == "cuda"
    n = 8192 if cuda else 512
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, torch.bfloat16) for _ in "ab")
    per_call = seconds_per_call(lambda: a @ b, device, warmup=3 if cuda else 1, iters=20 if cuda else 3)
    measured = 2 * n**3 / per_call / 1e12
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_flops(None, name) if cuda else None
    table = peak / 1e12 if peak is not None else None
    result = {
        "device_name": name,
        "n": n,
        "dtype": "bfloat16",
        "seconds_per_matmul": _sig(per_call),
        "measured_tflops": _sig(measured),
        "table_key": table_key(name) if cuda else None,
        "table_tflops": table,
        "ratio": _sig(measured / table, 3) if table else None,
        "ok_range": list(PEAK_RATIO),
    }
    if not cuda:
        return {**result, **unavailable("no GPU: the peak table holds GPUs only", False)}
    return {**result, "ok": peak_ratio_ok(measured, table)}


# ----------------------------------------------------------------------------------- sdpa_kernel


def probe_sdpa_kernel(device: torch.device) -> dict[str, Any]:
    """The sdpa backend of Qwen2.5-VL-7B's GQA shape (causal/dense mask, enable_gqa/repeated heads); fwd+bwd times."""
    from torch.nn.attention import SDPBackend

    names = {backend.value: name for name, backend in SDPBackend.__members__.items()}
    cuda = device.type == "cuda"
    heads, kv_heads, head_dim, seq = 28, 4, 128, 4096 if cuda else 256
    rep = heads // kv_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(device, torch.bfloat16) for _ in "kv")
    k, v = k.requires_grad_(), v.requires_grad_()
    grad_out = torch.randn(1, heads, seq, head_dim, generator=gen).to(device, torch.bfloat16)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    # (mask, is_causal, enable_gqa); without enable_gqa the key/value heads are repeated per query
    # group inside the step, as transformers' repeat_kv does, so the backward sums them as it does
    variants = {
        "gqa_causal": (None, True, True),
        "repeated_causal": (None, True, False),
        "gqa_mask": (causal, False, True),
        "repeated_mask": (causal, False, False),
    }
    result: dict[str, Any] = {
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "seq": seq, "dtype": "bfloat16"}
    }
    first = None
    for name, (mask, is_causal, gqa) in variants.items():

        def attend(mask=mask, is_causal=is_causal, gqa=gqa):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
            kwargs = {"enable_gqa": True} if gqa else {}
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=is_causal, **kwargs), kk, vv

        def step(attend=attend):
            q.grad = k.grad = v.grad = None
            attend()[0].backward(grad_out)

        # with autograd on, as in training: the choice weighs whether a kernel has the backward
        out, kk, vv = attend()
        choice = torch._fused_sdp_choice(q, kk, vv, mask, 0.0, is_causal, scale=None, enable_gqa=gqa)
        out = out.detach()
        seconds = seconds_per_call(step, device, warmup=2 if cuda else 1, iters=5 if cuda else 2)
        first = out if first is None else first
        result[name] = {
            "backend": names.get(choice, str(choice)),
            "forward_backward_ms": _sig(seconds * 1e3),
            "out_vs_gqa_causal": compare(out.float(), first.float(), TOLERANCE[torch.bfloat16]),
        }
    result["ok"] = all(
        result[name]["backend"] != "ERROR" and result[name]["out_vs_gqa_causal"]["ok"] for name in variants
    )
    return result


# ------------------------------------------------------------------------------------------ main

# Every probe in the order run; its docstring's first line is its --help line.
PROBES: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "liger": probe_liger,
    "flex_tree": probe_flex_tree,
    "compile": probe_compile,
    "mfu": probe_mfu,
    "sdpa_kernel": probe_sdpa_kernel,
}


def parse_only(values: list[str]) -> list[str]:
    """The probes to run, in PROBES order, from --only (repeated or comma separated; none: all).

    Raises:
        ValueError: an unknown name, named in the message with the known ones.
    """
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    unknown = sorted(names - set(PROBES))
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: no such probe (the probes: {', '.join(PROBES)})")
    return [name for name in PROBES if not names or name in names]


def run_probe(name: str, device: torch.device) -> dict[str, Any]:
    """One probe's line: probe, ok, seconds, then its numbers; an exception becomes its "error".

    What the probe's libraries print (DeepSpeed's logger, imported by accelerate) goes to stderr, so
    that stdout holds the JSON lines only.
    """
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = PROBES[name](device)
    except Exception as e:  # report it and go on to the next probe
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"probe": name, "ok": result.pop("ok"), "seconds": round(time.perf_counter() - start, 2), **result}


def emit(line: dict[str, Any], out: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(text + "\n")


def main(argv: list[str]) -> int:
    width = max(map(len, PROBES))
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="probes:\n" + "\n".join(f"  {n:<{width}}  {fn.__doc__.splitlines()[0]}" for n, fn in PROBES.items()),
    )
    parser.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]", help="run only these probes")
    parser.add_argument("--out", default=None, metavar="FILE", help="also append every JSON line to FILE")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU anyway (for this script's own tests)")
    args = parser.parse_args(argv)
    try:
        names = parse_only(args.only)
    except ValueError as e:
        print(f"gpu-probe: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu-probe: no CUDA GPU is visible (torch {torch.__version__}, torch.cuda.is_available() is False). "
            "Run it on a GPU machine with a CUDA build of torch; --allow-cpu runs it on CPU for its tests. "
            "Nothing was probed.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    start, failed = time.perf_counter(), []
    for name in names:
        line = run_probe(name, device)
        emit(line, args.out)
        if not line["ok"]:
            failed.append(name)
    summary = {
        "script": "gpu_probe",
        "ok": not failed,
        "failed": failed,
        "seconds": round(time.perf_counter() - start, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    emit(summary, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
