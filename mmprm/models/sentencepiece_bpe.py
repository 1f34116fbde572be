"""A sentencepiece BPE model file rebuilt as a `tokenizers` tokenizer, without sentencepiece.

InternLM2's tokenizer (InternVL2.5-8B/26B, hence MM-PRM-8B and VisualPRM-8B) is a sentencepiece
`tokenizer.model` driven by remote code. Its slow tokenizer splits the text at the added tokens
and has sentencepiece encode each remaining chunk; this module builds the `tokenizers` pipeline
that gives the same ids: the model file is read directly (its protobuf wire format, so neither
sentencepiece nor protobuf is needed), merges are ranked by the merged piece's score as
sentencepiece's BPE ranks them, user-defined pieces stay whole as sentencepiece keeps them, and
characters outside the vocabulary fall back to bytes. Settings it does not rebuild (a
normalization rule other than identity, a dummy prefix, removing extra whitespace, whitespace as
suffix: none of them InternLM2's) are refused by name rather than approximated. One difference
stays: text that spells a renamed piece's old name (InternLM2's "[UNUSED_TOKEN_146]", now
`<|im_start|>`) is spelled out here, where sentencepiece gives the renamed token's id.
tests/test_sentencepiece_bpe.py checks the ids against sentencepiece itself.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# sentencepiece_model.proto: SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_MODEL = 2


class SentencePieceError(ValueError):
    """A model file that cannot be read, or holds a setting this rebuild does not reproduce."""


@dataclass
class SentencePieceModel:
    """The fields of a sentencepiece model file the tokenization depends on (proto2 defaults)."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type) by id
    model_type: int = 1  # unigram
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise SentencePieceError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def proto_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of one protobuf message: an int for varint and fixed
    fields (floats are left as their bits), bytes for length-delimited ones."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise SentencePieceError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise SentencePieceError("truncated field")
        yield number, value


def _text(value: bytes) -> str:
    return value.decode("utf-8")


# The fields read, by message: field number -> (SentencePieceModel attribute, conversion)
TRAINER_SPEC = {3: ("model_type", int), 24: ("treat_whitespace_as_suffix", bool), 35: ("byte_fallback", bool)}
NORMALIZER_SPEC = {
    1: ("normalizer_name", _text),
    2: ("precompiled_charsmap", bytes),
    3: ("add_dummy_prefix", bool),
    4: ("remove_extra_whitespaces", bool),
    5: ("escape_whitespaces", bool),
}


def parse_model(buf: bytes) -> SentencePieceModel:
    model = SentencePieceModel()
    for number, value in proto_fields(buf):
        if number == 1:  # SentencePiece
            piece, score, kind = "", 0.0, NORMAL
            for n, v in proto_fields(value):
                if n == 1:
                    piece = _text(v)
                elif n == 2:
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif n == 3:
                    kind = v
            model.pieces.append((piece, score, kind))
        elif number in (2, 3):  # TrainerSpec, NormalizerSpec
            fields = TRAINER_SPEC if number == 2 else NORMALIZER_SPEC
            for n, v in proto_fields(value):
                if n in fields:
                    name, convert = fields[n]
                    setattr(model, name, convert(v))
    if not model.pieces:
        raise SentencePieceError("no pieces: not a sentencepiece model file")
    return model


def read_model(path: str | Path) -> SentencePieceModel:
    try:
        return parse_model(Path(path).read_bytes())
    except (SentencePieceError, UnicodeDecodeError, struct.error) as e:
        raise SentencePieceError(f"{path}: not a readable sentencepiece model ({e})") from e


def unsupported_settings(model: SentencePieceModel) -> list[str]:
    """What in `model` the rebuild would not reproduce, each named as sentencepiece names it."""
    problems = []
    if model.model_type != BPE_MODEL:
        problems.append(f"model_type {model.model_type} (only BPE, 2, is rebuilt)")
    if model.precompiled_charsmap or model.normalizer_name not in ("", "identity"):
        problems.append(f"normalization rule {model.normalizer_name or 'custom'!r} (only identity is rebuilt)")
    if model.add_dummy_prefix:  # tokenizers would also prefix the user-defined pieces it matches
        problems.append("add_dummy_prefix: true")
    if model.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces: true")
    if model.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix: true")
    if not model.escape_whitespaces:
        problems.append("escape_whitespaces: false")
    return problems


def bpe_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces of the vocabulary, ranked as sentencepiece
    ranks merges: the merged piece with the higher score first (ties: the lower id)."""
    merges = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[piece], left, right))
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in merges]


def rebuild_tokenizer(
    model: SentencePieceModel,
    added_tokens: dict[int, dict[str, Any]],
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> Any:
    """A `tokenizers.Tokenizer` giving the ids the slow tokenizer gives: `added_tokens` (id ->
    transformers' AddedToken fields: content, special, lstrip, rstrip, single_word) are split out
    of the text first, a content at an id inside the model renaming that piece (InternLM2's chat
    tokens); `bos_token`/`eos_token`, when given, are added around every sequence."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    problems = unsupported_settings(model)
    if UNKNOWN not in (kind for _, _, kind in model.pieces):
        problems.append("no unknown piece")
    if problems:
        raise SentencePieceError("settings not rebuilt: " + "; ".join(problems))
    kinds = [kind for _, _, kind in model.pieces]
    pieces = [piece for piece, _, _ in model.pieces]
    for i, piece in enumerate(pieces):
        # sentencepiece reads a NUL piece as unused when it falls back to bytes (NUL becomes <0x00>)
        if piece == "\0" and model.byte_fallback:
            kinds[i] = UNUSED
        # an unused piece is never produced: out of reach of the text's characters, out of the merges
        if kinds[i] == UNUSED:
            pieces[i] = f"<unused {i}: {piece!r}>"
    for i, token in added_tokens.items():
        if i < len(pieces):
            pieces[i] = token["content"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise SentencePieceError("the model holds the same piece at two ids")
    # Merges produce normal pieces only: sentencepiece never merges into a control, byte or unused
    # piece, and matches user-defined pieces whole before merging (they are added tokens below).
    scores = {pieces[i]: score for i, (_, score, _) in enumerate(model.pieces) if kinds[i] == NORMAL}
    tokenizer = Tokenizer(
        BPE(
            vocab,
            bpe_merges(vocab, scores),
            unk_token=pieces[kinds.index(UNKNOWN)],
            fuse_unk=True,
            byte_fallback=model.byte_fallback,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # User-defined pieces are matched in the normalized text, as sentencepiece matches them.
    tokenizer.add_tokens(
        [
            AddedToken(piece, normalized=True, special=False)
            for i, piece in enumerate(pieces)
            if kinds[i] == USER_DEFINED and i not in added_tokens
        ]
    )
    for i in sorted(added_tokens):
        token = added_tokens[i]
        added = AddedToken(
            token["content"],
            special=token.get("special", True),
            lstrip=token.get("lstrip", False),
            rstrip=token.get("rstrip", False),
            single_word=token.get("single_word", False),
            normalized=False,
        )
        (tokenizer.add_special_tokens if added.special else tokenizer.add_tokens)([added])
        if tokenizer.token_to_id(token["content"]) != i:
            raise SentencePieceError(
                f"added token {token['content']!r} lands at id {tokenizer.token_to_id(token['content'])}, not {i}: "
                "added ids must follow the model's pieces without gaps"
            )
    ends = [(t, tokenizer.token_to_id(t)) for t in (bos_token, eos_token) if t is not None]
    if ends:
        # A pair is one sequence to the slow tokenizer: bos, both texts, eos.
        head, tail = [bos_token] if bos_token else [], [eos_token] if eos_token else []
        single, pair = " ".join([*head, "$A", *tail]), " ".join([*head, "$A", "$B:1", *tail])
        tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
    return tokenizer
