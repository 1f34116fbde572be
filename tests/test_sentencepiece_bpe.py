"""InternLM2's sentencepiece tokenizer rebuilt without sentencepiece (mmprm/models/sentencepiece_bpe.py).

The reader and the merge ranking are checked on hand-built values; the rebuilt tokenizer against
sentencepiece itself, on a model trained here with InternLM2's settings, over the shipped real
problems and solutions, chat prompts and random strings of the model's own pieces. The slow
tokenizer's procedure is written out: the text cut at every added token (the longest at a
position), sentencepiece encoding each stretch between, BOS in front.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
from released_checkpoints import INTERNLM2_CHAT_TOKENS, WIDER_TEXT, write_internlm2_tokenizer

from mmprm.models.internvl_convert import sentencepiece_tokenizer
from mmprm.models.sentencepiece_bpe import (
    SentencePieceError,
    bpe_merges,
    parse_model,
    proto_fields,
    read_model,
    rebuild_tokenizer,
)

DATA = Path(__file__).resolve().parents[1] / "data"


def message(*fields: bytes) -> bytes:
    return b"".join(fields)


def varint(value: int) -> bytes:
    out = b""
    while True:
        out += bytes([(value & 0x7F) | (0x80 if value > 0x7F else 0)])
        value >>= 7
        if not value:
            return out


def field(number: int, value: int | bytes | float) -> bytes:
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    if isinstance(value, float):
        return varint(number << 3 | 5) + struct.pack("<f", value)
    return varint(number << 3 | 0) + varint(value)


def test_proto_fields_reads_varints_strings_and_fixed32():
    # field 1 = 150 is the protobuf guide's example: 08 96 01
    buf = bytes([0x08, 0x96, 0x01]) + bytes([0x12, 0x02]) + b"hi" + bytes([0x1D]) + struct.pack("<f", -1.5)
    fields = list(proto_fields(buf))
    assert fields[:2] == [(1, 150), (2, b"hi")]
    assert fields[2][0] == 3 and struct.unpack("<f", fields[2][1].to_bytes(4, "little"))[0] == -1.5


def test_a_model_that_states_nothing_gets_sentencepieces_defaults():
    model = parse_model(field(1, message(field(1, b"a"))))
    assert model.pieces == [("a", 0.0, 1)]  # type NORMAL, score 0 when absent
    assert (model.model_type, model.byte_fallback) == (1, False)
    assert (model.add_dummy_prefix, model.remove_extra_whitespaces, model.escape_whitespaces) == (True, True, True)


def test_a_model_file_that_is_not_one_is_refused(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\xff\xff\xff")
    with pytest.raises(SentencePieceError, match="tokenizer.model: not a readable sentencepiece model"):
        read_model(path)


def test_merges_rank_by_the_merged_pieces_score():
    """ab (-1) before bc (-2) before abc (-3); abc splits both ways, the shorter left part first."""
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"abc": -3.0, "ab": -1.0, "bc": -2.0}
    assert bpe_merges(vocab, scores) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


def test_settings_it_does_not_rebuild_are_refused_by_name():
    piece = field(1, message(field(1, b"<unk>"), field(3, 2)))
    unigram_with_defaults = parse_model(piece)
    with pytest.raises(SentencePieceError, match="model_type 1 .*remove_extra_whitespaces: true"):
        rebuild_tokenizer(unigram_with_defaults, {})
    dummy_prefix = parse_model(piece + field(2, field(3, 2)) + field(3, field(4, 0)))
    with pytest.raises(SentencePieceError, match="settings not rebuilt: add_dummy_prefix: true$"):
        rebuild_tokenizer(dummy_prefix, {})
    nfkc = parse_model(
        piece + field(2, field(3, 2)) + field(3, message(field(1, b"nmt_nfkc"), field(3, 0), field(4, 0)))
    )
    with pytest.raises(SentencePieceError, match="normalization rule 'nmt_nfkc'"):
        rebuild_tokenizer(nfkc, {})


def slow_ids(sp, text: str, added: dict[str, int], bos_id: int) -> list[int]:
    """InternLM2Tokenizer's encoding written out: cut at added tokens, sentencepiece between, BOS."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
    ids, pos = [bos_id], 0
    for match in pattern.finditer(text):
        ids += sp.encode(text[pos : match.start()]) + [added[match.group()]]
        pos = match.end()
    return ids + sp.encode(text[pos:])


def real_texts() -> list[str]:
    """The shipped MATH-V questions and GSM8K model solutions, as they are."""
    texts = [json.loads(line)["question"] for line in (DATA / "mathv" / "testmini.jsonl").open()]
    for line in (DATA / "gsm8k" / "example_model_solutions.jsonl").open():
        row = json.loads(line)
        texts += [row["question"], row["ground_truth"]]
    return texts


def random_texts(pieces: list[str], n: int, seed: int = 0) -> list[str]:
    """Strings of the model's own pieces and awkward characters, spaces written both ways."""
    rng = random.Random(seed)
    pool = [*pieces, " ", "  ", "\n", "\t", "\r\n", "\0", "é", "€", "🙂", "ｚ", "Ａ", "<img>", "<|im_end|>", "<s>"]
    return [
        "".join(rng.choice(pool).replace("▁", rng.choice(" ▁")) for _ in range(rng.randint(1, 25))) for _ in range(n)
    ]


def test_the_rebuilt_tokenizer_gives_sentencepieces_ids(tmp_path):
    import sentencepiece as spm

    src = write_internlm2_tokenizer(tmp_path)
    config = json.loads((src / "tokenizer_config.json").read_text())
    tok = sentencepiece_tokenizer(src / "tokenizer.model", config, {})
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    added = {t["content"]: int(i) for i, t in config["added_tokens_decoder"].items()}
    pieces = [p for p, _, _ in read_model(src / "tokenizer.model").pieces if p not in INTERNLM2_CHAT_TOKENS]
    chat = (
        "<|im_start|>system\n你是书生·万象<|im_end|>\n<|im_start|>user\n<img><IMG_CONTEXT><IMG_CONTEXT></img>\n"
        "Question: Tom has 3 apples and buys 15 more.\nProcess: 3 + 15 = 18.<|im_end|>\n<|im_start|>assistant\n"
    )
    texts = [chat, *real_texts(), *WIDER_TEXT, "  two  spaces\n\n\nnewlines ", " lead", "x^2 + \\frac{1}{2}"]
    texts += random_texts(pieces, 400)
    wrong = [t for t in texts if tok(t)["input_ids"] != slow_ids(sp, t, added, sp.bos_id())]
    assert not wrong, [(t, tok.tokenize(t), sp.encode(t, out_type=str)) for t in wrong[:3]]
    assert len(texts) > 450 and sum(map(len, texts)) > 40_000
    plain = [t for t in texts if not any(a in t for a in added)]
    undecoded = [
        t for t in plain if tok.decode(tok(t, add_special_tokens=False)["input_ids"]) != sp.decode(sp.encode(t))
    ]
    assert not undecoded, undecoded[:3]
    # the byte fallback and a user-defined piece were exercised
    assert any(p.startswith("<0x") for t in texts for p in sp.encode(t, out_type=str))
    assert tok.tokenize("ＡＢ") == ["Ａ", "Ｂ"]


def test_the_check_script_reports_no_mismatch_on_a_model_it_is_given(tmp_path):
    """benchmarks/internlm2_tokenizer.py, which takes InternLM2's real file, on the tiny model."""
    import subprocess
    import sys

    src = write_internlm2_tokenizer(tmp_path)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "internlm2_tokenizer.py"
    args = ["--model", src / "tokenizer.model", "--tokenizer-config", src / "tokenizer_config.json", "--random", "50"]
    proc = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["texts"] == len(real_texts()) + 50 and result["mismatches_vs_sentencepiece"] == 0
