"""Tree packing: all the rows of one problem in one sequence, each shared token computed once.

An MCTS export has many rows per problem. They share the prompt (image tokens included) and often
their first steps, so many of a problem's row tokens repeat (docs/tree-packing.md). A packed
sequence holds the shared prompt once, then every distinct step once, in depth-first order. An
attention mask lets a token see only its own path (its ancestors and the earlier tokens of its
step), and every token keeps the position it has in its rows, so the head at each step token sees
exactly what it sees in the row. The loss weights each distinct step by the number of rows through
it, against the mean of their labels: cross-entropy is linear in the target, so this is the loss
of the rows themselves.

    pack_rows(items)           the rows of one problem (TokenizedSteps) -> PackedTree
    collate_packed(trees, ..)  PackedTrees -> a batch for ProcessRewardModel (4D mask, row_positions)
    packed_position_ids(..)    row positions -> the backbone's position ids (M-RoPE included)
    tree_attention(..)         a context in which sdpa attends on CPU by blocks of the tree mask
    tree_block_mask(..)        the tree mask as FlexAttention's block mask (attn_implementation=flex_attention)
    plan_packs(rows, ..)       cached rows -> packs of row indices under a token budget, with lengths

Attention over a pack costs its length squared, yet a token sees only its own path, a small part
of the pack. On CPU, `tree_attention` cuts the queries into blocks of 64 and runs each block
against only the keys some query in it sees: the same numbers (up to float rounding), far fewer
of them computed (`benchmarks/prm_packing.py`; figures in docs/tree-packing.md). On a GPU, sdpa
keeps the masked kernel (many small kernels may cost more in launches than they save);
`attn_implementation=flex_attention` runs FlexAttention with the tree as a block mask instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from mmprm.steps import TokenizedSteps, torch_cat_zeros
from mmprm.training.collate import PER_TOKEN_KEYS, collate_model_inputs


@dataclass
class PackedTree:
    """One problem's rows as one sequence.

    input_ids: the shared prefix, then each distinct step (its text and its step token) once.
    row_positions: the index every token has in the rows that contain it.
    node_of_token: the step (node) each token belongs to; node 0 is the shared prefix.
    parents: parent node of every node (-1 for node 0); a parent precedes its children.
    step_positions / targets / weights: per step node, its step token's index, the mean label of the
        rows through it, and how many rows go through it.
    row_steps: per packed row, the node (index into step_positions) of each of its steps, so a
        score per node reads back as the rows' scores.
    """

    input_ids: list[int]
    row_positions: list[int]
    node_of_token: list[int]
    parents: list[int]
    step_positions: list[int]
    targets: list[float] | None
    weights: list[float]
    model_inputs: dict[str, Any] = field(default_factory=dict)
    row_steps: list[list[int]] = field(default_factory=list)

    def attention_mask(self) -> torch.Tensor:
        """(L, L) bool: token t sees token u when u <= t and u's node is t's node or an ancestor."""
        n_nodes = len(self.parents)
        ancestor = torch.eye(n_nodes, dtype=torch.bool)  # ancestor[n, m]: m is n or above it
        for node in range(1, n_nodes):
            ancestor[node] |= ancestor[self.parents[node]]
        nodes = torch.tensor(self.node_of_token)
        sees = ancestor[nodes][:, nodes]
        return sees & torch.ones_like(sees).tril()


def _shared_prefix(items: Sequence[TokenizedSteps]) -> int:
    """Tokens every row starts with, never reaching a step token (at least the prompt)."""
    first = items[0].input_ids
    n = min(t.step_positions[0] for t in items)
    for t in items[1:]:
        k = 0
        while k < n and t.input_ids[k] == first[k]:
            k += 1
        n = k
    return n


def pack_rows(items: Sequence[TokenizedSteps], ids: Sequence[str] | None = None) -> PackedTree:
    """Pack the tokenized rows of one problem (same question and images) into one tree.

    Tokens after a row's last step token are left out: no step token can see them. `ids` (the
    rows' ids) only name the rows in errors.
    """
    if not items:
        raise ValueError("pack_rows: no rows")
    labelled = all(t.labels is not None for t in items)
    root = _shared_prefix(items)
    for t in items:
        if t.prompt_length is not None and root < t.prompt_length:
            raise ValueError(
                f"pack_rows: rows {list(ids or [])[:3]}... do not share their prompt: pack only rows with the "
                "same question and images"
            )
    # Rows become paths of nodes first (node 0: the shared prefix); tokens are laid out depth-first
    # afterwards, so that every node's tokens are contiguous whatever order the rows come in.
    parents, segments, label_sums, counts = [-1], [()], [0.0], [0]
    children: dict[tuple[int, tuple[int, ...]], int] = {}
    row_nodes: list[list[int]] = []
    for t in items:
        node, start = 0, root
        row_nodes.append([])
        for k, pos in enumerate(t.step_positions):
            key = (node, tuple(t.input_ids[start : pos + 1]))
            if key not in children:
                children[key] = len(parents)
                parents.append(node)
                segments.append(key[1])
                label_sums.append(0.0)
                counts.append(0)
            node = children[key]
            row_nodes[-1].append(node)
            counts[node] += 1
            if labelled:
                label_sums[node] += float(t.labels[k])  # type: ignore[index]
            start = pos + 1
    kids: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        kids[parents[node]].append(node)
    input_ids, row_positions, node_of_token = list(items[0].input_ids[:root]), list(range(root)), [0] * root
    order, new_index, end_of, step_positions = [], [0] * len(parents), [0] * len(parents), []
    end_of[0] = root
    stack = list(reversed(kids[0]))
    while stack:
        node = stack.pop()
        new_index[node] = len(order) + 1
        order.append(node)
        seg, base = segments[node], end_of[parents[node]]
        input_ids.extend(seg)
        row_positions.extend(range(base, base + len(seg)))
        node_of_token.extend([new_index[node]] * len(seg))
        end_of[node] = base + len(seg)
        step_positions.append(len(input_ids) - 1)
        stack.extend(reversed(kids[node]))
    new_parents = [-1] + [new_index[parents[n]] for n in order]
    model_inputs = dict(items[0].model_inputs)
    for key in PER_TOKEN_KEYS:
        if key in model_inputs:  # the prefix keeps the processor's types (images); steps are text (0)
            model_inputs[key] = torch_cat_zeros(model_inputs[key][:, :root], len(input_ids) - root)
    return PackedTree(
        input_ids=input_ids,
        row_positions=row_positions,
        node_of_token=node_of_token,
        parents=new_parents,
        step_positions=step_positions,
        targets=[label_sums[n] / counts[n] for n in order] if labelled else None,
        weights=[float(counts[n]) for n in order],
        model_inputs=model_inputs,
        row_steps=[[new_index[n] - 1 for n in nodes] for nodes in row_nodes],
    )


def collate_packed(trees: Sequence[PackedTree], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad packed trees into a batch `ProcessRewardModel` takes.

    attention_mask is (B, 1, L, L) bool (True: may attend); a padding token sees only itself, so
    no softmax row is empty. row_positions (B, L) tells the model the positions to use; targets and
    step_weights (N,) follow the step tokens in batch order.
    """
    width = max(len(t.input_ids) for t in trees)
    batch = len(trees)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    row_positions = torch.zeros((batch, width), dtype=torch.long)
    step_mask = torch.zeros((batch, width), dtype=torch.bool)
    mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1, 1)
    for i, t in enumerate(trees):
        n = len(t.input_ids)
        input_ids[i, :n] = torch.tensor(t.input_ids)
        row_positions[i, :n] = torch.tensor(t.row_positions)
        step_mask[i, t.step_positions] = True
        mask[i, 0, :n, :n] = t.attention_mask()
    out: dict[str, torch.Tensor] = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "step_mask": step_mask,
        "row_positions": row_positions,
        "step_weights": torch.tensor([w for t in trees for w in t.weights], dtype=torch.float32),
    }
    if all(t.targets is not None for t in trees):
        out["targets"] = torch.tensor([x for t in trees for x in t.targets], dtype=torch.float32)  # type: ignore[union-attr]
    out.update(collate_model_inputs([t.model_inputs for t in trees], width))
    return out


def run_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a batch runs through the model, padding left out (row batches and packed ones)."""
    mask = batch["attention_mask"]
    if mask.ndim == 2:
        return int(mask.sum())
    # packed: padding is at the end and takes row position 0, as only a tree's first token does
    return int((batch["row_positions"] > 0).sum()) + mask.shape[0]


def packed_position_ids(decoder: Any, input_ids: torch.Tensor, row_positions: torch.Tensor, inputs: dict) -> Any:
    """Position ids of a packed batch: what each token has in its own row.

    Models with M-RoPE (the Qwen2-VL family, `get_rope_index`) number image tokens by their grid
    and text linearly after them; their positions for the packed sequence read as one row are
    shifted back by (packed index - row index), which is 0 in the shared prefix. Other models take
    the row positions as they are.
    """
    rope_index = getattr(decoder, "get_rope_index", None)
    if rope_index is None or "mm_token_type_ids" not in inputs:
        return row_positions
    kwargs = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in inputs}
    linear, _ = rope_index(input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], **kwargs)
    shift = torch.arange(input_ids.shape[1], device=input_ids.device) - row_positions  # (B, L)
    return linear - shift.unsqueeze(0)


def packed_attention_mask(mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> Any:
    """The packed bool mask as the kernel takes it: the additive float mask of sdpa and eager (sdpa
    would convert a bool mask in every layer), or FlexAttention's block mask (`tree_block_mask`)."""
    if attn_implementation in ("sdpa", "eager"):
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    if attn_implementation == "flex_attention":
        return tree_block_mask(mask)
    raise ValueError(
        f"tree packing (data.pack_trees) needs attention that takes a tree mask (sdpa, eager or "
        f"flex_attention), not {attn_implementation!r}: set model.attn_implementation or data.pack_trees=false"
    )


def tree_block_mask(sees: torch.Tensor) -> Any:
    """A (B, 1, L, L) bool tree mask as FlexAttention's `BlockMask`.

    The kernel skips every block of queries x keys where no query sees a key, and applies the mask
    only inside the blocks that are partly seen: a pack's attention costs the blocks along its
    paths, not L x L, and the mask is never an L x L float tensor (a dense mask also turns off
    SDPA's grouped-query kernels on GPU).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    seen = sees[:, 0]  # (B, L, L)

    def tree_mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return seen[b, q, kv]

    length = sees.shape[-1]
    return create_block_mask(tree_mask, sees.shape[0], None, length, length, device=sees.device)


TREE_ATTENTION = "mmprm_tree_sdpa"  # the name `tree_attention` registers with transformers
TREE_BLOCK = 64  # queries per block: fewer cost more calls, more see more keys (docs/tree-packing.md)


@dataclass
class _TreeBlocks:
    """The packed batch's additive mask, and per sequence its query blocks: (first query, end,
    the keys some query in the block sees, the block's additive mask over those keys)."""

    mask: torch.Tensor
    blocks: list[list[tuple[int, int, torch.Tensor | slice, torch.Tensor | None]]]
    calls: int = 0  # attention layers that ran by blocks (tests check the path is taken)


_active_tree: ContextVar[_TreeBlocks | None] = ContextVar("mmprm_tree_blocks", default=None)


def tree_blocks(sees: torch.Tensor, additive: torch.Tensor, block: int = TREE_BLOCK) -> _TreeBlocks:
    """Query blocks of a (B, 1, L, L) bool tree mask (`collate_packed`); `additive` is the same mask
    as the model gets it (`packed_attention_mask`), sliced per block so the values are its own."""
    out = []
    for b in range(sees.shape[0]):
        row = []
        for q0 in range(0, sees.shape[-1], block):
            q1 = min(q0 + block, sees.shape[-1])
            keys = sees[b, 0, q0:q1].any(dim=0).nonzero().squeeze(1)
            row.append((q0, q1, keys, additive[b, 0, q0:q1][:, keys]))
        out.append(row)
    return _TreeBlocks(additive, out)


# Eager under `torch.compile` (a graph break in a compiled decoder layer): traced, the loop over a
# pack's blocks would recompile the layer for every pack of a new length or block count.
@torch.compiler.disable
def _tree_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs):
    """transformers attention function: by blocks for the active tree mask, else plain sdpa."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from mmprm.models.attention import grouped_query_sdpa, grouped_query_sdpa_applies

    tree = _active_tree.get()
    if tree is None or attention_mask is not tree.mask:  # another mask (a vision tower, a row batch)
        return grouped_query_sdpa(module, query, key, value, attention_mask, **kwargs)
    tree.calls += 1
    # Grouped-query attention: one key head serves n_rep queries; scoring (no autograd) runs the
    # grouped kernel on the heads as they are, training the repeated heads (mmprm.models.attention).
    grouped = grouped_query_sdpa_applies(query, key, value, attention_mask)
    if not grouped:
        n_rep = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    dropout = kwargs.get("dropout", 0.0)
    scale = kwargs.get("scaling")
    if _blocks_backward_applies(query, key, value, tree.blocks, dropout, grouped):
        out = _AttentionByBlocks.apply(query, key, value, tree.blocks, scale)
    else:
        rows = []
        for b, blocks in enumerate(tree.blocks):
            parts = [
                torch.nn.functional.scaled_dot_product_attention(
                    query[b : b + 1, :, q0:q1],
                    key[b : b + 1, :, keys],
                    value[b : b + 1, :, keys],
                    attn_mask=sub,
                    is_causal=sub is None,  # a whole sequence of a sequence pack (`document_blocks`)
                    dropout_p=dropout,
                    scale=scale,
                    **({"enable_gqa": True} if grouped else {}),
                )
                for q0, q1, keys, sub in blocks
            ]
            rows.append(torch.cat(parts, dim=2))
        out = torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None  # (B, L, heads, head_dim)


def _blocks_backward_applies(query, key, value, blocks, dropout: float, grouped: bool) -> bool:
    """Whether `_AttentionByBlocks` runs the blocks: under autograd, without dropout or autocast,
    where sdpa would pick its CPU flash kernel (the one it calls). The blocks differ only in length,
    never empty (a padding token sees itself), so the first block's inputs decide for all."""
    if grouped or dropout or not torch.is_grad_enabled():
        return False
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if torch.is_autocast_enabled(query.device.type) or not hasattr(torch, "_fused_sdp_choice"):
        return False
    from torch.nn.attention import SDPBackend

    q0, q1, keys, sub = blocks[0][0]
    n_keys = keys.stop - keys.start if isinstance(keys, slice) else len(keys)
    q, k, v = query[:1, :, q0:q1], key[:1, :, :n_keys], value[:1, :, :n_keys]
    choice = torch._fused_sdp_choice(q, k, v, sub, dropout, sub is None, scale=None)
    return choice == SDPBackend.FLASH_ATTENTION.value


class _AttentionByBlocks(torch.autograd.Function):
    """sdpa by query blocks (`_tree_sdpa`), with the backward of the blocks written out.

    Through autograd, every block's slice of the queries and gather of the keys and values gets a
    gradient as large as the whole tensor, zeros but for the block's part, and autograd sums those
    for each block and layer. Here each block's gradients are added into one tensor per input, in
    the order autograd adds them (the last block first), so the gradients are the same numbers to
    the bit, without the whole-size tensors. The kernels are those sdpa runs on CPU (its flash
    kernel and that kernel's backward)."""

    @staticmethod
    def forward(ctx, query, key, value, blocks, scale):
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        saved, rows = [], []
        for b, row in enumerate(blocks):
            parts = []
            for q0, q1, keys, sub in row:
                q, k, v = query[b : b + 1, :, q0:q1], key[b : b + 1, :, keys], value[b : b + 1, :, keys]
                out, logsumexp = kernel(q, k, v, 0.0, sub is None, attn_mask=sub, scale=scale)
                saved.extend((q, k, v, out, logsumexp))
                parts.append(out)
            rows.append(torch.cat(parts, dim=2))
        ctx.save_for_backward(*saved)
        ctx.blocks, ctx.scale = blocks, scale
        ctx.shapes = query.shape, key.shape
        return torch.cat(rows, dim=0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query_shape, key_shape = ctx.shapes
        d_query = grad.new_zeros(query_shape)
        d_key, d_value = grad.new_zeros(key_shape), grad.new_zeros(key_shape)
        saved = ctx.saved_tensors
        order = [(b, block) for b, row in enumerate(ctx.blocks) for block in row]
        for i in reversed(range(len(order))):
            b, (q0, q1, keys, sub) = order[i]
            q, k, v, out, logsumexp = saved[5 * i : 5 * i + 5]
            g = grad[b : b + 1, :, q0:q1]
            gq, gk, gv = kernel(g, q, k, v, out, logsumexp, 0.0, sub is None, attn_mask=sub, scale=ctx.scale)
            d_query[b : b + 1, :, q0:q1] += gq
            if isinstance(keys, slice):
                d_key[b : b + 1, :, keys] += gk
                d_value[b : b + 1, :, keys] += gv
            else:
                d_key[b].index_add_(1, keys, gk[0])
                d_value[b].index_add_(1, keys, gv[0])
        return d_query, d_key, d_value, None, None


@contextmanager
def tree_attention(
    backbone: Any, sees: torch.Tensor, additive: torch.Tensor, blocks: _TreeBlocks | None = None
) -> Iterator[_TreeBlocks | None]:
    """Within this context, the backbone's text attention runs `additive` (the packed mask) by blocks.

    Only for sdpa on CPU, and not under gradient checkpointing (its recomputation runs outside the
    context, where the full mask gives the same numbers through other tensors, which the checkpoint
    refuses); anywhere else it does nothing and the masked kernel runs as before. Yields the blocks
    (None when it does nothing). The backbone's text config names the attention function for the
    length of the context: one forward at a time per model (as training and scoring run).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = backbone.config.get_text_config()
    if (
        config._attn_implementation != "sdpa"
        or additive.device.type != "cpu"
        or getattr(backbone, "is_gradient_checkpointing", False)
    ):
        yield None
        return
    AttentionInterface.register(TREE_ATTENTION, _tree_sdpa)  # a dict entry: registering again is free
    ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, sdpa_mask)
    tree = blocks if blocks is not None else tree_blocks(sees, additive, TREE_BLOCK)
    token = _active_tree.set(tree)
    config._attn_implementation = TREE_ATTENTION
    try:
        yield tree
    finally:
        config._attn_implementation = "sdpa"
        _active_tree.reset(token)


@dataclass
class PackPlan:
    """Packs of row indices (all rows of a pack share question and images) and their token counts."""

    packs: list[list[int]]
    lengths: list[int]
    row_tokens: int  # tokens of the rows themselves, for the packing ratio

    @property
    def ratio(self) -> float:
        return sum(self.lengths) / max(1, self.row_tokens)


def plan_packs(rows: Iterable[dict[str, Any]], max_tokens: int, max_open: int = 4096) -> PackPlan:
    """Group rows by problem into packs of at most `max_tokens` packed tokens, in one pass.

    Each row: `index`, `key` (anything hashable naming question and images), `input_ids`,
    `step_positions`, `prompt_length` (-1 when unknown: the row then packs alone). A pack's length
    counts its prompt once and each distinct step once (`pack_rows` may share more, never less).
    Memory: a hash per distinct step of the open packs and the row indices, not the tokens. At most
    `max_open` packs stay open, the one opened first closed first: annotation writes a problem's
    rows together, so that closes only finished problems, and a file of a million problems does not
    keep one open pack each (rows in another order still pack, into more packs).
    """
    open_packs: OrderedDict[Any, dict[str, Any]] = OrderedDict()
    packs: list[list[int]] = []
    lengths: list[int] = []
    row_tokens = 0

    def close(pack: dict[str, Any]) -> None:
        packs.append(pack["rows"])
        lengths.append(pack["length"])

    for row in rows:
        ids, positions, prompt = row["input_ids"], row["step_positions"], row["prompt_length"]
        end = positions[-1] + 1
        row_tokens += len(ids)
        if prompt < 0 or prompt > positions[0]:
            close({"rows": [row["index"]], "length": end})
            continue
        hashes, start, node = [], prompt, hash(tuple(ids[:prompt]))
        for pos in positions:
            node = hash((node, tuple(ids[start : pos + 1])))
            hashes.append((node, pos + 1 - start))
            start = pos + 1
        pack = open_packs.get(row["key"])
        if pack is not None:
            extra = sum(n for h, n in hashes if h not in pack["nodes"])
            if pack["length"] + extra > max_tokens:
                close(pack)
                pack = None
        if pack is None:
            pack = open_packs[row["key"]] = {"rows": [], "nodes": set(), "length": prompt}
            if len(open_packs) > max_open:  # the problem opened longest ago: done, when rows come grouped
                close(open_packs.popitem(last=False)[1])
        pack["rows"].append(row["index"])
        for h, n in hashes:
            if h not in pack["nodes"]:
                pack["nodes"].add(h)
                pack["length"] += n
    for pack in open_packs.values():
        close(pack)
    return PackPlan(packs, lengths, row_tokens)


# ---------------------------------------------------------------- sequence packing (policy SFT)
# Several whole rows one after another in one sequence, each attending only to itself: no padding
# between rows, and attention by blocks keeps the cost near that of the rows alone.

# The label that carries no loss, cross_entropy's ignore_index (mmprm.training.data.IGNORE, which
# imports this module: not imported from there)
IGNORE = -100


def plan_sequence_packs(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in packs of at most `max_tokens` tokens (best fit, longest rows first).

    Deterministic: the same lengths give the same packs. A row longer than `max_tokens` gets a
    pack of its own (callers refuse such a budget first: policy_sft's data.pack_tokens).
    """
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, pack index), sorted: the tightest fit first
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, p = room.pop(k)
            packs[p].append(i)
            bisect.insort(room, (left - n, p))
        else:
            packs.append([i])
            bisect.insort(room, (max_tokens - n, len(packs) - 1))
    return packs


def collate_sequence_packs(packs: Sequence[Sequence[dict[str, Any]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Packs of `tokenize_sft` outputs -> one batch row per pack, right-padded.

    input_ids / labels / attention_mask (B, L) as `collate_sft` gives them (the 2-D mask marks real
    tokens, not attention), and position_ids (B, L): each row's own 0, 1, ..., and the padding at
    the end as one more sequence. A row's first label is IGNORE, so no row learns to predict the
    next one's start; every other label is the row's own (the same tokens carry loss as padded).
    Image tensors are concatenated in row order, as the models consume them.
    """
    width = max(sum(len(t["input_ids"]) for t in pack) for pack in packs)
    ids = torch.full((len(packs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(packs), width), IGNORE, dtype=torch.long)
    real = torch.zeros((len(packs), width), dtype=torch.long)
    positions = torch.zeros((len(packs), width), dtype=torch.long)
    extras = []
    for b, pack in enumerate(packs):
        start = 0
        for t in pack:
            n = len(t["input_ids"])
            ids[b, start : start + n] = torch.tensor(t["input_ids"])
            labels[b, start : start + n] = torch.tensor(t["labels"])
            labels[b, start] = IGNORE
            real[b, start : start + n] = 1
            positions[b, start : start + n] = torch.arange(n)
            start += n
        positions[b, start:] = torch.arange(width - start)
        extras.append(_pack_extras([t["extra"] for t in pack], [len(t["input_ids"]) for t in pack]))
    return {
        "input_ids": ids,
        "attention_mask": real,
        "position_ids": positions,
        "labels": labels,
        **collate_model_inputs(extras, width),
    }


def _pack_extras(extras: Sequence[dict[str, torch.Tensor]], lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """The processor outputs of a pack's rows as one example's: per-token tensors joined along the
    tokens (zeros for a row without them, a text-only row), the rest along dim 0."""
    out: dict[str, torch.Tensor] = {}
    for key in sorted(set().union(*(e.keys() for e in extras))):
        have = [e[key] for e in extras if key in e]
        if key in PER_TOKEN_KEYS:
            parts = [
                e[key][:, :n] if key in e else torch.zeros((1, n), dtype=have[0].dtype) for e, n in zip(extras, lengths)
            ]
            out[key] = torch.cat(parts, dim=1)
        else:
            out[key] = torch.cat(have, dim=0)
    return out


def _base_model(model: Any) -> Any:
    """The HF model under DDP / DeepSpeed and PEFT wrappers."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def sequence_pack_inputs(model: Any, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Within this context, the model inputs of a `collate_sequence_packs` batch for the model's
    attention kernel (labels kept); the model runs inside it.

    Positions restart at every row: for the Qwen2-VL family, the M-RoPE positions of the model's
    own `get_rope_index` over the pack, each row moved back by its start, with the plain positions
    in front (the 4-row position ids transformers reads packed sequences from). sdpa and eager get
    a block-diagonal causal (B, 1, L, L) mask (on CPU sdpa attends by blocks, `tree_attention`),
    flex_attention the same as a block mask. flash_attention_2/3 get one flattened sequence without
    padding and no mask: transformers' varlen path cuts it where the positions restart.
    """
    base = _base_model(model)
    config = base.config.get_text_config()
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    out = dict(batch)
    real = out.pop("attention_mask").bool()  # (B, L)
    rows = out["position_ids"]  # (B, L)
    decoder = getattr(base, "model", base)
    rope_index = getattr(decoder, "get_rope_index", None)
    if rope_index is not None:
        if "mm_token_type_ids" in out:
            kwargs = {k: out[k] for k in ("image_grid_thw", "video_grid_thw") if k in out}
            linear, _ = rope_index(out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"], **kwargs)
            # a row's positions over the pack are its own plus those of the row's first token
            # (every M-RoPE axis alike, text or image); the row's first index is (index - position)
            first = torch.arange(rows.shape[1], device=rows.device) - rows
            mrope = linear - linear[0].gather(1, first).unsqueeze(0)
        else:
            mrope = rows.unsqueeze(0).expand(3, -1, -1)
        out["position_ids"] = torch.cat([rows.unsqueeze(0), mrope], dim=0)  # (4, B, L)
    if attn.startswith("flash_attention"):
        yield flatten_packs(out, real)
        return
    doc = (rows == 0).cumsum(-1)  # (B, L): which sequence of its pack a token is in
    sees = (doc.unsqueeze(-1) == doc.unsqueeze(-2)).tril().unsqueeze(1)  # (B, 1, L, L)
    if attn not in ("sdpa", "eager", "flex_attention"):
        raise ValueError(
            f"sequence packing (data.pack_sequences) runs with sdpa, eager, flex_attention or "
            f"flash_attention_2, not {attn!r}: set model.attn_implementation or data.pack_sequences=false"
        )
    out["attention_mask"] = packed_attention_mask(sees, attn, base.dtype)
    # the rows' bounds are read on the host: only where the blocks can run (CPU), no sync on a GPU
    blocks = document_blocks(rows, out["attention_mask"]) if rows.device.type == "cpu" else None
    with tree_attention(base, sees, out["attention_mask"], blocks):
        yield out


def document_blocks(positions: torch.Tensor, additive: torch.Tensor) -> _TreeBlocks:
    """The blocks `tree_attention` runs for a sequence-packed batch: each sequence (positions
    restarting at 0) against its own keys only, causal, with no mask to build or read."""
    out = []
    for row in positions.tolist():
        starts = [t for t, p in enumerate(row) if p == 0] + [len(row)]
        out.append([(a, b, slice(a, b), None) for a, b in zip(starts, starts[1:])])
    return _TreeBlocks(additive, out)


def flatten_packs(inputs: dict[str, torch.Tensor], real: torch.Tensor) -> dict[str, torch.Tensor]:
    """A packed batch as one sequence without its padding (`real`, (B, L) bool): flash-attn's varlen
    layout, where transformers finds the rows from the positions (batch size 1 only)."""
    out = dict(inputs)
    keep = real.reshape(-1)
    for key in ("input_ids", "labels", *PER_TOKEN_KEYS):
        if key in out:
            out[key] = out[key].reshape(1, -1)[:, keep]
    pos = out["position_ids"]  # (B, L), or (4, B, L) with M-RoPE
    out["position_ids"] = pos.reshape(*pos.shape[:-2], 1, -1)[..., keep]
    return out
