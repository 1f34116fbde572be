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
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

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
from mmprm.training.collate import PER_TOKEN_KEYS, collate_steps, model_input_keys

if TYPE_CHECKING:
    from mmprm.models.vllm_prm import VLLMPRMScorer
    from mmprm.training.packing import PackedTree


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
        step_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        row_positions: torch.Tensor | None = None,
        **model_inputs: Any,
    ) -> torch.Tensor:
        """`step_mask` is a (B, S) bool mask of the step tokens, or their (rows, columns) indices.
        `row_positions` marks a tree-packed batch (`mmprm.training.packing.collate_packed`): attention_mask
        is then its (B, 1, L, L) mask and every token takes the position it has in its row."""
        decoder = _decoder(self.backbone)
        if row_positions is None:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs)
        else:
            from mmprm.training.packing import packed_attention_mask, packed_position_ids, tree_attention

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


MAX_BATCH_TOKENS = 65536  # padded tokens per scoring forward: batch 16 of the longest packed tree


def batch_chunks(
    lengths: Sequence[int], batch_size: int, max_tokens: int | None, prefixes: Sequence[int] | None = None
) -> list[list[int]]:
    """Positions 0..len(lengths)-1 cut, in order, into runs of at most `batch_size` rows whose padded
    size stays within `max_tokens` (None: no limit); a row longer than that runs alone.

    The padded size is rows x the longest row; with `prefixes` (rows on prompt caches: row i's first
    `prefixes[i]` tokens are its cached prompt), rows x (longest prompt + longest rest).

    >>> batch_chunks([3, 3, 5, 9], batch_size=3, max_tokens=10)
    [[0, 1], [2], [3]]
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    head = tail = 0
    for i, n in enumerate(lengths):
        pre = prefixes[i] if prefixes is not None else 0
        wide_head, wide_tail = max(head, pre), max(tail, n - pre)
        too_big = max_tokens is not None and (wide_head + wide_tail) * (len(current) + 1) > max_tokens
        if current and (len(current) >= batch_size or too_big):
            chunks.append(current)
            current, wide_head, wide_tail = [], pre, n - pre
        current.append(i)
        head, tail = wide_head, wide_tail
    if current:
        chunks.append(current)
    return chunks


def _split(values: list[float], counts: list[int]) -> list[list[float]]:
    """`values` cut into consecutive runs of `counts`."""
    out, pos = [], 0
    for c in counts:
        out.append(values[pos : pos + c])
        pos += c
    return out


@dataclass(eq=False)  # hashed by identity: a chunk lists the prompts it holds
class _Prompt:
    """A question's shared prompt, run once: its candidates, its length, KV cache and M-RoPE shift."""

    group: int
    toks: list[TokenizedSteps]
    length: int
    cache: Any
    delta: int


def _stackable(cache: Any) -> bool:
    """Caches whose every layer is a plain `DynamicLayer`, whose keys and values `_rows_cache` can
    pad, stack and broadcast (a sliding-window or offloaded layer keeps more state)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        bool(layers)
        and all(type(layer) is DynamicLayer for layer in layers)
        and not getattr(cache, "offloading", False)
    )


def _rows_cache(caches: list[Any], rows: list[int], span: int) -> Any:
    """A KV cache whose row r is `caches[rows[r]]` (each of batch 1), zero-padded to `span` tokens
    (the attention mask hides the padding). The prompts' own caches are not changed: one prompt is
    broadcast as a view, and the forward's append makes the one copy it needs."""
    base = caches[0]
    if not _stackable(base):  # one prompt, a cache of another kind: copy it whole
        if len(caches) > 1:
            raise ValueError("rows of several prompts need caches of plain DynamicLayer layers")
        cache = copy.deepcopy(base)
        cache.batch_repeat_interleave(len(rows))
        return cache
    cache = copy.copy(base)
    cache.layers = []
    for n, layer in enumerate(base.layers):
        new = copy.copy(layer)
        if len(caches) == 1:
            new.keys = layer.keys.expand(len(rows), *layer.keys.shape[1:])
            new.values = layer.values.expand(len(rows), *layer.values.shape[1:])
        else:
            index = torch.tensor(rows, device=layer.keys.device)
            for name in ("keys", "values"):
                parts = [getattr(c.layers[n], name) for c in caches]
                stacked = torch.cat([F.pad(t, (0, 0, 0, span - t.shape[-2])) for t in parts])  # (G, heads, span, D)
                setattr(new, name, stacked.index_select(0, index))  # (b, heads, span, D)
        cache.layers.append(new)
    return cache


class _Prefetch:
    """The items of `source` computed on a background thread, up to `depth` ahead of the loop that
    reads them, so that tokenization and image preprocessing overlap the model. An error raised
    there is raised in the reading loop. `enabled=False` reads `source` in the loop itself."""

    def __init__(self, source: Iterable[Any], depth: int, enabled: bool = True):
        self.source = source
        self.enabled = enabled
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Iterator[Any]:
        if not self.enabled:
            return iter(self.source)
        self._thread = threading.Thread(target=self._produce, name="mmprm-score-prefetch", daemon=True)
        self._thread.start()
        return self._read()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()  # a reader that stopped early (an error) releases the producer
        if self._thread is not None:
            self._thread.join()

    def _put(self, item: tuple[bool, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self.source:
                if not self._put((True, item)):
                    return
            self._put((False, None))
        except BaseException as error:  # handed to the reader, which raises it
            self._put((False, error))

    def _read(self) -> Iterator[Any]:
        while True:
            ok, item = self._queue.get()
            if ok:
                yield item
            elif item is None:
                return
            else:
                raise item


class PRMScorer:
    """Scores steps with a trained PRM, using the training step tokenization.

    `score(examples)` returns one probability per step per example. Candidates that share a
    question and images (Best-of-N; `share_prefix=True`) are packed into one tree
    (`mmprm.training.packing`) where that runs at most `TREE_TOKEN_SHARE` of their tokens (a policy's
    samples repeat their steps), so that their prompt and every step they repeat run once;
    otherwise, and where attention takes no tree mask (flash-attn), they share one forward of the
    prompt, its KV cache reused for every candidate. Both give the scores of the unshared path (tests).

    Every forward holds rows of many questions, sorted by length: at most `batch_size` rows and
    `max_batch_tokens` padded tokens (a row longer than that runs alone). With `prefetch` (default:
    on a CUDA device) inputs are tokenized and their images processed on a background thread while
    the model runs.
    """

    def __init__(
        self,
        model: ProcessRewardModel,
        processor: Any,
        device: str | torch.device = "cpu",
        batch_size: int = 8,
        max_length: int | None = None,
        max_batch_tokens: int | None = MAX_BATCH_TOKENS,
        prefetch: bool | None = None,
    ):
        if batch_size < 1 or (max_batch_tokens is not None and max_batch_tokens < 1):
            raise ValueError(f"batch_size={batch_size}, max_batch_tokens={max_batch_tokens}: both must be >= 1")
        self.model = model.eval().to(device)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.max_batch_tokens = max_batch_tokens
        # On a GPU the host is idle while kernels run; on CPU the model's own thread needs the
        # cores (and the GIL), and the thread made scoring slower (docs/performance.md).
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
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

    @property
    def _pad(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """`batch_chunks` with this scorer's limits."""
        return batch_chunks(lengths, self.batch_size, self.max_batch_tokens)

    @torch.no_grad()
    def score(self, examples: Sequence[Any], share_prefix: bool = True, progress: bool = False) -> list[list[float]]:
        """One probability per step per example (steps cut by max_length get NaN).

        Examples with the same question and images form a group whose prompt is encoded once
        (`share_prefix`). Inputs are tokenized (images processed) one group at a time, a few groups
        ahead of the model, and dropped once scored; groups wait in buffers of a few batches so that
        rows of many questions run in one forward. What stays for the whole call is the scores,
        never the inputs or their pixel values.
        """
        results: list[list[float] | None] = [None] * len(examples)
        groups, empty = group_by_prompt(examples, share_prefix)
        for i in empty:
            results[i] = []  # nothing to score; aggregators rank an empty candidate last
        bar = progress_bar(sum(map(len, groups)), progress)
        singles: list[tuple[int, TokenizedSteps]] = []
        trees: list[tuple[list[int], PackedTree]] = []  # packed groups waiting for a batch
        shared: list[tuple[list[int], list[TokenizedSteps]]] = []  # prompt-cache groups waiting
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

        def flush_shared() -> None:
            if shared:
                for (idx, _), scores in zip(shared, self._score_shared_groups([t for _, t in shared])):
                    keep(idx, scores)
                shared.clear()

        tokenized = (self.tokenize_group(examples, idx) for idx in groups)
        with _Prefetch(tokenized, depth=2 * self.batch_size, enabled=self.prefetch) as stream:
            for idx, toks in zip(groups, stream):
                if len(idx) == 1:
                    singles.append((idx[0], toks[0]))
                    if len(singles) >= 8 * self.batch_size:
                        flush_singles()
                    continue
                split = _pack_group(toks, idx) if packed else None
                if split is None:
                    shared.append((idx, toks))
                    if sum(len(t) for _, t in shared) >= self.batch_size:
                        flush_shared()
                    continue
                trees.extend(split)
                if len(trees) >= self.batch_size:
                    flush_trees()
        flush_singles()
        flush_shared()
        flush_trees()
        bar.close()
        return results  # type: ignore[return-value]

    def tokenize_group(self, examples: Sequence[Any], idx: list[int]) -> list[TokenizedSteps]:
        """The examples `idx`, which share a prompt, tokenized (the prompt and images once)."""
        return tokenize_named_group(self.processor, self.spec, examples, idx, self.max_length, self.tokenize)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def _step_index(self, step_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the step tokens in a host (B, S) mask, on the device. Indexing with
        them queues a gather; indexing with a device mask waits for the device to count it."""
        rows, cols = step_mask.nonzero(as_tuple=True)
        return self._to_device(rows), self._to_device(cols)

    def _run(self, batch: dict[str, torch.Tensor]) -> list[list[float]]:
        step_mask = batch.pop("step_mask")
        counts = step_mask.sum(dim=1).tolist()  # on the host: the probabilities' copy is the one sync
        batch = {k: self._to_device(v) for k, v in batch.items()}
        index = self._step_index(step_mask)
        logits = self.model(batch["input_ids"], batch["attention_mask"], index, **model_input_keys(batch))
        return _split(ProcessRewardModel.probabilities(logits).tolist(), counts)

    def _score_plain(self, toks: list[TokenizedSteps]) -> list[list[float]]:
        order = sorted(range(len(toks)), key=lambda i: len(toks[i].input_ids))  # length-bucketed batches
        out: list[list[float]] = [[] for _ in toks]
        for chunk in self._chunks([len(toks[i].input_ids) for i in order]):
            rows = [order[c] for c in chunk]
            for i, s in zip(rows, self._run(collate_steps([toks[i] for i in rows], self._pad))):
                out[i] = s
        return out

    def _score_trees(self, trees: list[tuple[list[int], PackedTree]]) -> list[tuple[list[int], list[list[float]]]]:
        """Packed groups (`_pack_group`) in batches of trees of similar length; each tree's
        scores per node read back as its rows' (`PackedTree.row_steps`)."""
        from mmprm.training.packing import collate_packed

        ordered = sorted(trees, key=lambda t: len(t[1].input_ids))
        out = []
        for chunk in self._chunks([len(t.input_ids) for _, t in ordered]):
            batch = [ordered[c] for c in chunk]
            for (idx, tree), probs in zip(batch, self._run(collate_packed([t for _, t in batch], self._pad))):
                out.append((idx, [[probs[n] for n in steps] for steps in tree.row_steps]))
        return out

    def _score_shared_groups(self, groups: list[list[TokenizedSteps]]) -> list[list[list[float]]]:
        """Candidates of several questions, each question's prompt encoded once; only each
        candidate's own tokens run, against its prompt's KV cache, with rows of several questions
        in one forward. Scores per group, per candidate."""
        out: list[list[list[float]]] = [[] for _ in groups]
        prompts: list[_Prompt] = []
        for g, toks in enumerate(groups):
            prompt = self._encode_prompt(toks, g)
            if prompt is None:
                out[g] = self._score_plain(toks)
            else:
                prompts.append(prompt)
                out[g] = [[] for _ in toks]
        # Rows of several questions share a forward only where their caches can be padded and
        # stacked (`_stackable`); a question's candidates stay together, shortest first.
        runs = [prompts] if all(_stackable(p.cache) for p in prompts) else [[p] for p in prompts]
        for run in runs:
            rows = [(p, i) for p in run for i in sorted(range(len(p.toks)), key=lambda i: len(p.toks[i].input_ids))]
            lengths = [len(p.toks[i].input_ids) for p, i in rows]
            prefixes = [p.length for p, _ in rows]
            for chunk in batch_chunks(lengths, self.batch_size, self.max_batch_tokens, prefixes):
                members = [rows[c] for c in chunk]
                for (p, i), probs in zip(members, self._run_on_prompts(members)):
                    out[p.group][i] = probs
        return out

    def _encode_prompt(self, toks: list[TokenizedSteps], group: int) -> _Prompt | None:
        """The prompt the candidates `toks` share, run once: its KV cache (batch 1) and M-RoPE
        shift; None when they share fewer than 2 tokens before a step token."""
        first = toks[0].input_ids
        prefix_len = min(min(t.step_positions) for t in toks)  # never share a step token
        for t in toks[1:]:
            k = 0
            while k < prefix_len and t.input_ids[k] == first[k]:
                k += 1
            prefix_len = k
        if prefix_len < 2:
            return None
        decoder = _decoder(self.model.backbone)
        mm = dict(toks[0].model_inputs)
        for key in PER_TOKEN_KEYS:
            if key in mm:
                mm[key] = mm[key][:, :prefix_len]
        prefix_ids = torch.tensor([first[:prefix_len]])
        delta = _mrope_delta(decoder, prefix_ids, mm)  # on the host copies: no device sync
        mm = {k: self._to_device(v) for k, v in mm.items()}
        prefix_ids = self._to_device(prefix_ids)
        pre = decoder(input_ids=prefix_ids, attention_mask=torch.ones_like(prefix_ids), use_cache=True, **mm)
        return _Prompt(group=group, toks=toks, length=prefix_len, cache=pre.past_key_values, delta=delta)

    def _run_on_prompts(self, members: list[tuple[_Prompt, int]]) -> list[list[float]]:
        """One forward of the candidates `members` ((prompt, candidate index) pairs, a prompt's
        candidates next to each other) on their prompts' KV caches: probabilities per candidate."""
        prompts = list(dict.fromkeys(p for p, _ in members))
        span = max(p.length for p in prompts)  # the caches padded to the longest prompt
        width = max(len(p.toks[i].input_ids) - p.length for p, i in members)
        b = len(members)
        ids = torch.full((b, width), self._pad, dtype=torch.long)
        mask = torch.zeros((b, span + width), dtype=torch.long)
        step_mask = torch.zeros((b, width), dtype=torch.bool)
        positions = torch.empty((b, width), dtype=torch.long)
        for row, (p, i) in enumerate(members):
            suffix = p.toks[i].input_ids[p.length :]
            ids[row, : len(suffix)] = torch.tensor(suffix)
            mask[row, : p.length] = 1
            mask[row, span : span + len(suffix)] = 1
            step_mask[row, [q - p.length for q in p.toks[i].step_positions]] = True
            positions[row] = torch.arange(p.length, p.length + width) + p.delta
        counts = step_mask.sum(dim=1).tolist()
        index = self._step_index(step_mask)  # copied with the inputs, before the forward is queued
        cache = _rows_cache([p.cache for p in prompts], [prompts.index(p) for p, _ in members], span)
        res = _decoder(self.model.backbone)(
            input_ids=self._to_device(ids),
            attention_mask=self._to_device(mask),
            position_ids=self._to_device(positions),
            past_key_values=cache,
            use_cache=True,
        )
        hidden = res.last_hidden_state  # (b, width, H)
        logits = self.model.head_logits(hidden[index])
        return _split(ProcessRewardModel.probabilities(logits).tolist(), counts)


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
    """The candidates of one question as trees (`mmprm.training.packing.pack_rows`) of at most
    SCORE_PACK_TOKENS tokens, each with the example indices of its rows: every distinct step runs
    once, and a policy's samples repeat many of their steps.
    None when the rows do not share their prompt, or the tree would run more than TREE_TOKEN_SHARE
    of the tokens the prompt cache runs (prompt once, then every candidate's own): the prompt
    cache scores them then."""
    from mmprm.training.packing import pack_rows

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
    max_batch_tokens: int | None = MAX_BATCH_TOKENS,
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
    Scores are float32 whatever `dtype` the model runs in. An HF scorer's forwards hold at most
    `batch_size` rows and `max_batch_tokens` padded tokens (None: rows only). `compile` (hf only):
    `torch.compile` each decoder layer (`mmprm.models.compile_layers`), the same scores.
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
        scorer = _load_released(path, spec, device, batch_size, max_length, dtype, attn_implementation)
        scorer.max_batch_tokens = max_batch_tokens
        return _compiled(scorer, compile)
    spec = read_spec(path)
    backbone, processor = load_backbone(path, dtype=dtype, attn_implementation=attn_implementation)
    model = build_prm(backbone, processor, spec)
    if spec.head == "value":
        model.value_head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
    scorer = PRMScorer(
        model, processor, device=device, batch_size=batch_size, max_length=max_length, max_batch_tokens=max_batch_tokens
    )
    return _compiled(scorer, compile)


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
