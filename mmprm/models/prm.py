"""Process reward model: a backbone plus a head read at every step token, and its scorer.

Two heads (`PRMSpec.head`):
- "token_pair": the LM logits at a step token restricted to two reward tokens (default "+"/"-");
  the step score is softmax over the pair, index 0 = positive. No new parameters.
- "value": a linear layer on the last hidden state at the step token; score = sigmoid.

`save_prm` writes a standard HF directory (backbone or merged LoRA, processor with the step token,
`value_head.safetensors` for the value head) plus `mmprm_prm.json`; `load_prm` restores a
`PRMScorer` whose `score()` uses the same `mmprm.steps.tokenize_steps` as training.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmprm.collate import PER_TOKEN_KEYS, collate_steps, model_input_keys
from mmprm.data.schema import load_image
from mmprm.models.sharding import merge_lora_copy
from mmprm.models.spec import (
    SPEC_FILE,
    VALUE_HEAD_FILE,
    PRMSpec,
    example_field,
    example_steps,
    group_by_prompt,
    progress_bar,
    read_spec,
    released_spec,
    reward_token_ids,
    tokenize_example,
    tokenize_named_group,
    weight_files,
)
from mmprm.steps import TokenizedSteps

if TYPE_CHECKING:
    from mmprm.models.vllm_prm import VLLMPRMScorer
    from mmprm.packing import PackedTree


def _decoder(backbone: nn.Module) -> nn.Module:
    """The backbone without its LM head (vision encoder included); LoRA layers stay in place."""
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    return getattr(base, "model", base)  # a classifier PRM loads the bare decoder (AutoModel)


class ProcessRewardModel(nn.Module):
    """Backbone + PRM head. `forward` returns head outputs at the step tokens only.

    token_pair and classifier -> (N, 2) logits [positive, negative]; value -> (N,) logits;
    N = step tokens in batch.
    """

    def __init__(
        self,
        backbone: nn.Module,
        spec: PRMSpec,
        reward_ids: list[int] | None = None,
        classifier: nn.Module | None = None,
    ):
        super().__init__()
        spec.validate()
        self.backbone = backbone
        self.spec = spec
        self.reward_ids = reward_ids
        if spec.head == "token_pair" and not reward_ids:
            raise ValueError("token_pair head needs reward token ids")
        if spec.head == "classifier":
            if classifier is None:
                raise ValueError("classifier head needs its module (load_prm reads it from the checkpoint)")
            self.classifier = classifier
        if spec.head == "value":
            hidden = backbone.config.get_text_config().hidden_size
            self.value_head = nn.Linear(hidden, 1)
            nn.init.normal_(self.value_head.weight, std=1.0 / hidden**0.5)
            nn.init.zeros_(self.value_head.bias)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head outputs for hidden states (N, H) at step tokens."""
        if self.spec.head == "value":
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # (N,)
        if self.spec.head == "classifier":
            logits = self.classifier(hidden.to(next(self.classifier.parameters()).dtype))  # (N, 2)
            positive = self.spec.positive_label
            return logits[:, [positive, 1 - positive]]  # (N, 2) positive first
        base = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        lm_head = base.get_output_embeddings()
        # Call the module, never read lm_head.weight: under ZeRO-3 the weight is partitioned and
        # DeepSpeed gathers it only inside the module's own forward. The full-vocab logits are
        # for the N step tokens only, not the whole sequence: a small cost beside the decoder.
        logits = lm_head(hidden.to(lm_head.weight.dtype))  # (N, V)
        return logits[:, self.reward_ids]  # (N, 2)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        step_mask: torch.Tensor,
        row_positions: torch.Tensor | None = None,
        **model_inputs: Any,
    ) -> torch.Tensor:
        """`row_positions` marks a tree-packed batch (`mmprm.packing.collate_packed`): attention_mask
        is then its (B, 1, L, L) mask and every token takes the position it has in its row."""
        decoder = _decoder(self.backbone)
        if row_positions is None:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs)
        else:
            from mmprm.packing import packed_attention_mask, packed_position_ids, tree_attention

            config = self.backbone.config
            additive = packed_attention_mask(
                attention_mask, getattr(config, "_attn_implementation", None) or "sdpa", self.backbone.dtype
            )
            model_inputs["position_ids"] = packed_position_ids(decoder, input_ids, row_positions, model_inputs)
            with tree_attention(self.backbone, attention_mask, additive):
                out = decoder(input_ids=input_ids, attention_mask=additive, use_cache=False, **model_inputs)
        hidden = out.last_hidden_state  # (B, S, H)
        return self.head_logits(hidden[step_mask])  # (N, 2) or (N,)

    @staticmethod
    def probabilities(head_logits: torch.Tensor) -> torch.Tensor:
        """Step-correct probability from head logits: (N, 2) -> softmax[:, 0]; (N,) -> sigmoid."""
        if head_logits.ndim == 2:
            return torch.softmax(head_logits.float(), dim=-1)[:, 0]
        return torch.sigmoid(head_logits.float())


class PRMScorer:
    """Scores steps with a trained PRM, using the training step tokenization.

    `score(examples)` returns one probability per step per example. Candidates that share a
    question and images (Best-of-N; `share_prefix=True`) are packed into one tree
    (`mmprm.packing`) where that runs at most `TREE_TOKEN_SHARE` of their tokens (a policy's
    samples repeat their steps), so that their prompt and every step they repeat run once;
    otherwise, and where attention takes no tree mask (flash-attn), they share one forward of the
    prompt, its KV cache reused for every candidate. Both give the scores of the unshared path (tests).
    """

    def __init__(
        self,
        model: ProcessRewardModel,
        processor: Any,
        device: str | torch.device = "cpu",
        batch_size: int = 8,
        max_length: int | None = None,
    ):
        self.model = model.eval().to(device)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.spec = model.spec
        self.dropped_steps = 0

    def close(self) -> None:
        """Release the model (and the accelerator memory it held) for the next one this process
        loads; scoring afterwards is an error. Every scorer has `close`, so a recipe frees either
        backend alike; closing twice is a no-op."""
        if self.__dict__.pop("model", None) is not None:
            from mmprm.models.loading import release_accelerator_memory

            release_accelerator_memory()

    def tokenize(self, ex: Any) -> TokenizedSteps:
        images = [load_image(p) for p in (example_field(ex, "images") or [])]
        return tokenize_example(self.processor, self.spec, ex, images, self.max_length)

    @torch.no_grad()
    def score(self, examples: Sequence[Any], share_prefix: bool = True, progress: bool = False) -> list[list[float]]:
        """One probability per step per example (steps cut by max_length get NaN).

        Examples with the same question and images form a group whose prompt is encoded once
        (`share_prefix`). Inputs are tokenized (images processed) one group at a time and dropped
        once scored; single examples wait in a buffer of a few batches, so they still run batched.
        What stays for the whole call is the scores, never the inputs or their pixel values.
        """
        results: list[list[float] | None] = [None] * len(examples)
        groups, empty = group_by_prompt(examples, share_prefix)
        for i in empty:
            results[i] = []  # nothing to score; aggregators rank an empty candidate last
        bar = progress_bar(sum(map(len, groups)), progress)
        singles: list[tuple[int, TokenizedSteps]] = []
        trees: list[tuple[list[int], PackedTree]] = []  # packed groups waiting for a batch
        packed = _packs_trees(self.model.backbone)

        def keep(idx: list[int], scores: list[list[float]]) -> None:
            for i, s in zip(idx, scores):
                results[i] = s + [float("nan")] * (len(example_steps(examples[i])) - len(s))
            bar.update(len(idx))

        def flush_singles() -> None:
            if singles:
                keep([i for i, _ in singles], self._score_plain([t for _, t in singles]))
                singles.clear()

        def flush_trees() -> None:
            if trees:
                for idx, scores in self._score_trees(trees):
                    keep(idx, scores)
                trees.clear()

        for idx in groups:
            toks = tokenize_named_group(self.processor, self.spec, examples, idx, self.max_length, self.tokenize)
            if len(idx) == 1:
                singles.append((idx[0], toks[0]))
                if len(singles) >= 8 * self.batch_size:
                    flush_singles()
                continue
            split = _pack_group(toks, idx) if packed else None
            if split is None:
                keep(idx, self._score_shared(toks))
                continue
            trees.extend(split)
            if len(trees) >= self.batch_size:
                flush_trees()
        flush_singles()
        flush_trees()
        bar.close()
        return results  # type: ignore[return-value]

    def _run(self, batch: dict[str, torch.Tensor]) -> list[list[float]]:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        logits = self.model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        probs = ProcessRewardModel.probabilities(logits).tolist()
        counts = batch["step_mask"].sum(dim=1).tolist()
        out, pos = [], 0
        for c in counts:
            out.append(probs[pos : pos + c])
            pos += c
        return out

    def _score_plain(self, toks: list[TokenizedSteps]) -> list[list[float]]:
        order = sorted(range(len(toks)), key=lambda i: len(toks[i].input_ids))  # length-bucketed batches
        out: list[list[float]] = [[] for _ in toks]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, s in zip(chunk, self._run(collate_steps([toks[i] for i in chunk], pad))):
                out[i] = s
        return out

    def _score_trees(self, trees: list[tuple[list[int], PackedTree]]) -> list[tuple[list[int], list[list[float]]]]:
        """Packed groups (`_pack_group`) in batches of `batch_size` trees of similar length; each
        tree's scores per node read back as its rows' (`PackedTree.row_steps`)."""
        from mmprm.packing import collate_packed

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ordered = sorted(trees, key=lambda t: len(t[1].input_ids))
        out = []
        for start in range(0, len(ordered), self.batch_size):
            chunk = ordered[start : start + self.batch_size]
            for (idx, tree), probs in zip(chunk, self._run(collate_packed([t for _, t in chunk], pad))):
                out.append((idx, [[probs[n] for n in steps] for steps in tree.row_steps]))
        return out

    def _score_shared(self, toks: list[TokenizedSteps]) -> list[list[float]]:
        """Encode the shared prompt once; run only each candidate's own tokens against its cache."""
        first = toks[0].input_ids
        prefix_len = min(min(t.step_positions) for t in toks)  # never share a step token
        for t in toks[1:]:
            k = 0
            while k < prefix_len and t.input_ids[k] == first[k]:
                k += 1
            prefix_len = k
        if prefix_len < 2:
            return self._score_plain(toks)
        decoder = _decoder(self.model.backbone)
        mm = {k: v.to(self.device) for k, v in toks[0].model_inputs.items()}
        for key in PER_TOKEN_KEYS:
            if key in mm:
                mm[key] = mm[key][:, :prefix_len]
        prefix_ids = torch.tensor([first[:prefix_len]], device=self.device)
        pre = decoder(input_ids=prefix_ids, attention_mask=torch.ones_like(prefix_ids), use_cache=True, **mm)
        cache = pre.past_key_values
        delta = _mrope_delta(decoder, prefix_ids, mm)
        out: list[list[float]] = [[] for _ in toks]
        order = sorted(range(len(toks)), key=lambda i: len(toks[i].input_ids))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = max(len(toks[i].input_ids) for i in chunk) - prefix_len
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), prefix_len + width), dtype=torch.long)
            mask[:, :prefix_len] = 1
            step_mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for row, i in enumerate(chunk):
                suffix = toks[i].input_ids[prefix_len:]
                ids[row, : len(suffix)] = torch.tensor(suffix)
                mask[row, prefix_len : prefix_len + len(suffix)] = 1
                step_mask[row, [p - prefix_len for p in toks[i].step_positions]] = True
            positions = torch.arange(prefix_len, prefix_len + width).unsqueeze(0).expand(len(chunk), -1) + delta
            batch_cache = copy.deepcopy(cache)
            batch_cache.batch_repeat_interleave(len(chunk))
            res = decoder(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=batch_cache,
                use_cache=True,
            )
            hidden = res.last_hidden_state  # (b, width, H)
            probs = ProcessRewardModel.probabilities(self.model.head_logits(hidden[step_mask.to(self.device)])).tolist()
            pos = 0
            for row, i in enumerate(chunk):
                c = int(step_mask[row].sum())
                out[i] = probs[pos : pos + c]
                pos += c
        return out


def _mrope_delta(decoder: nn.Module, input_ids: torch.Tensor, model_inputs: dict[str, torch.Tensor]) -> int:
    """How far M-RoPE models (the Qwen2-VL family) shift the text after this prompt's images: its
    last position is `len - 1 + delta`. Computed from these inputs alone: the model's own
    `rope_deltas` is the last image input's, kept across calls without images."""
    grids = {k: model_inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in model_inputs}
    rope_index = getattr(decoder, "get_rope_index", None)
    if rope_index is None or not grids:
        return 0
    _, delta = rope_index(input_ids, mm_token_type_ids=model_inputs["mm_token_type_ids"], **grids)
    return int(delta.reshape(-1)[0])


SCORE_PACK_TOKENS = 4096  # most tokens in one packed group (prm_train's pack_tokens default)
# A tree pays for its mask and its blocks of attention, so it beats the prompt cache only where it
# runs far fewer tokens: distinct candidates keep the cache, candidates that repeat steps become a
# tree (`benchmarks/prm_scoring_throughput.py`; the figures are in docs/performance.md).
TREE_TOKEN_SHARE = 0.5


def _packs_trees(backbone: nn.Module) -> bool:
    """Scoring packs a question's candidates into trees where attention takes a 4D mask."""
    return getattr(backbone.config, "_attn_implementation", None) in ("sdpa", "eager")


def _pack_group(toks: list[TokenizedSteps], idx: list[int]) -> list[tuple[list[int], PackedTree]] | None:
    """The candidates of one question as trees (`mmprm.packing.pack_rows`) of at most
    SCORE_PACK_TOKENS tokens, each with the example indices of its rows: every distinct step runs
    once, and a policy's samples repeat many of their steps.
    None when the rows do not share their prompt, or the tree would run more than TREE_TOKEN_SHARE
    of the tokens the prompt cache runs (prompt once, then every candidate's own): the prompt
    cache scores them then."""
    from mmprm.packing import pack_rows

    try:
        tree = pack_rows(toks)
    except ValueError:
        return None
    prompt = tree.node_of_token.count(0)
    if len(tree.input_ids) > TREE_TOKEN_SHARE * (prompt + sum(len(t.input_ids) - prompt for t in toks)):
        return None
    if len(tree.input_ids) <= SCORE_PACK_TOKENS or len(toks) == 1:
        return [(idx, tree)]
    half = len(toks) // 2
    first, second = _pack_group(toks[:half], idx[:half]), _pack_group(toks[half:], idx[half:])
    return None if first is None or second is None else first + second


def build_prm(backbone: nn.Module, processor: Any, spec: PRMSpec) -> ProcessRewardModel:
    """Wrap a loaded backbone as a PRM: adds the step token and resolves reward token ids."""
    from mmprm.models.loading import add_step_token

    add_step_token(processor, backbone, spec.step_token)
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = reward_token_ids(tokenizer, spec.reward_tokens) if spec.head == "token_pair" else None
    return ProcessRewardModel(backbone, spec, ids)


def save_prm(
    model: ProcessRewardModel,
    processor: Any,
    out_dir: str | Path,
    merge_lora: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a standard HF directory plus mmprm's spec (and value head) so `load_prm` restores it.

    `state_dict` is the full wrapper state gathered across ranks (ZeRO-3 shards every weight, so
    the local module alone holds empty parameters); without it the module's own weights are saved.
    LoRA is merged into a copy of the backbone that holds these weights; `state_dict` is not changed.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backbone = model.backbone
    backbone_sd = head_sd = None
    if state_dict is not None:
        backbone_sd = {k[len("backbone.") :]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        head_sd = {k[len("value_head.") :]: v for k, v in state_dict.items() if k.startswith("value_head.")}
    if merge_lora and hasattr(backbone, "merge_and_unload"):
        backbone, backbone_sd = merge_lora_copy(backbone, backbone_sd), None  # the merged weights are its own
    backbone.save_pretrained(out, state_dict=backbone_sd)
    processor.save_pretrained(out)
    if model.spec.head == "value":
        head = head_sd or model.value_head.state_dict()
        save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, str(out / VALUE_HEAD_FILE))
    (out / SPEC_FILE).write_text(json.dumps(asdict(model.spec), indent=2) + "\n")
    return out


def load_prm(
    path: str | Path,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    max_length: int | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    backend: str = "hf",
    vllm_kwargs: dict[str, Any] | None = None,
    convention: str | None = None,
    compile: bool = False,
) -> PRMScorer | VLLMPRMScorer:
    """Restore a PRM saved by `save_prm` (or `recipes/prm_train.py`) as a scorer.

    `convention` loads a released PRM that mmprm did not write (Math-Shepherd, Qwen2.5-Math-PRM,
    RLHFlow, MM-PRM, VisualPRM: `mmprm.models.spec.RELEASED_CONVENTIONS`) and scores it as its
    authors do; InternVL ones after `mmprm convert-internvl`.

    backend "hf" (default): a `PRMScorer` in this process. `attn_implementation`: sdpa (default),
    flash_attention_2 (needs flash-attn and CUDA), eager or auto; checked before any weight loads.
    backend "vllm": a `mmprm.models.vllm_prm.VLLMPRMScorer`, the same scores from a vLLM engine
    (`vllm_kwargs` go to `vllm.LLM`; `device` and `attn_implementation` are vLLM's to choose).
    Scores are float32 whatever `dtype` the model runs in. `compile` (hf only): `torch.compile` each
    decoder layer (`mmprm.models.compile_layers`), the same scores.
    """
    from safetensors.torch import load_file

    from mmprm.models.loading import load_backbone

    if backend not in ("hf", "vllm"):
        raise ValueError(f"backend: {backend!r} is not one of ['hf', 'vllm']")
    if compile and backend != "hf":
        raise ValueError("compile: applies to backend 'hf' only (vLLM compiles its model itself)")
    path = Path(path)
    if backend == "vllm":
        from mmprm.models.vllm_prm import VLLMPRMScorer

        kwargs = dict(vllm_kwargs or {})
        if dtype is not None and not kwargs.get("server_url"):  # a served PRM runs in the server's dtype
            kwargs.setdefault("dtype", str(dtype).removeprefix("torch."))
        return VLLMPRMScorer(path, batch_size=batch_size, max_length=max_length, convention=convention, **kwargs)
    if convention is not None and convention != "mmprm":
        spec = released_spec(convention)
        return _compiled(
            _load_released(path, spec, device, batch_size, max_length, dtype, attn_implementation), compile
        )
    spec = read_spec(path)
    backbone, processor = load_backbone(path, dtype=dtype, attn_implementation=attn_implementation)
    model = build_prm(backbone, processor, spec)
    if spec.head == "value":
        model.value_head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
    return _compiled(PRMScorer(model, processor, device=device, batch_size=batch_size, max_length=max_length), compile)


def _compiled(scorer: PRMScorer, compile: bool) -> PRMScorer:
    """The scorer, its decoder layers compiled in place when `compile` (`load_prm(compile=True)`)."""
    if compile:
        from mmprm.models.compile_layers import compile_decoder_layers

        compile_decoder_layers(scorer.model)
    return scorer


def _load_released(
    path: Path,
    spec: PRMSpec,
    device: str | torch.device,
    batch_size: int,
    max_length: int | None,
    dtype: torch.dtype | None,
    attn_implementation: str,
) -> PRMScorer:
    """A released PRM as its checkpoint is: no step token added, no embedding resized; its step
    tag (where the layout has one) must already be one token of its vocabulary."""
    from mmprm.models.loading import load_backbone
    from mmprm.steps import step_token_id

    classifier = None
    if spec.head == "classifier":
        from transformers.utils import logging as hf_logging

        # The decoder alone is loaded; transformers would list the head's weights as unexpected.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            backbone, processor = load_backbone(path, dtype=dtype, attn_implementation=attn_implementation, bare=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        classifier = classifier_head(path, backbone.config.get_text_config().hidden_size).to(backbone.dtype)
    else:
        backbone, processor = load_backbone(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = getattr(processor, "tokenizer", processor)
    if spec.layout != "turns":
        step_token_id(tokenizer, spec.step_format)
    reward_ids = reward_token_ids(tokenizer, spec.reward_tokens) if spec.head == "token_pair" else None
    model = ProcessRewardModel(backbone, spec, reward_ids, classifier)
    return PRMScorer(model, processor, device=device, batch_size=batch_size, max_length=max_length)


def classifier_head(path: Path, hidden: int, prefix: str = "score.") -> nn.Module:
    """The two-class head a classifier PRM keeps beside its decoder (`score.*` in its checkpoint):
    one linear layer (`score.weight`), or Qwen2.5-Math-PRM's linear-ReLU-linear (`score.0`, `score.2`)."""
    from safetensors import safe_open

    if not path.is_dir():  # a hub id: the files from_pretrained has just fetched into the cache
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.safetensors", "*.json"]))
    weights: dict[str, torch.Tensor] = {}
    holding = sorted({file for name, file in weight_files(path).items() if name.startswith(prefix)})
    for name in holding:
        with safe_open(str(path / name), framework="pt") as f:
            weights.update({k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    if set(weights) == {"weight", "bias"} or set(weights) == {"weight"}:
        head: nn.Module = nn.Linear(hidden, weights["weight"].shape[0], bias="bias" in weights)
    elif {"0.weight", "2.weight"} <= set(weights):
        head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, weights["2.weight"].shape[0]))
    else:
        raise ValueError(
            f"{path}: no classifier head found ({prefix}weight, or {prefix}0/{prefix}2 weights); "
            f"its {prefix}* tensors are {sorted(weights) or 'absent'}: is this the convention it was trained with?"
        )
    head.load_state_dict(weights)
    out = weights["weight" if "weight" in weights else "2.weight"].shape[0]
    if out != 2:
        raise ValueError(f"{path}: the classifier head has {out} classes; a PRM's has two (wrong, right)")
    return head


def iter_batches(items: Sequence[Any], batch_size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), batch_size):
        yield items[start : start + batch_size]
