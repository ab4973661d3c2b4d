"""CharTokenizer: ids, round trips, the tokenizer.json format and its errors."""

from __future__ import annotations

import json

import pytest

from furlong.core.tokenizer import CharTokenizer

pytestmark = pytest.mark.unit

ALPHABET = "0123456789+="


def test_special_ids_and_vocab_size():
    tok = CharTokenizer(ALPHABET)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 15


def test_encode_maps_characters_after_the_special_tokens():
    tok = CharTokenizer(ALPHABET)
    assert tok.encode("07+85=") == [1, 3, 10, 13, 11, 8, 14]
    assert tok.encode("92", add_bos=False) == [12, 5]
    assert tok.encode("", add_bos=False) == []


def test_decode_round_trip_and_special_tokens():
    tok = CharTokenizer(ALPHABET)
    ids = tok.encode("12+34=") + tok.encode("46", add_bos=False) + [tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "12+34=46"
    assert tok.decode(ids, skip_special=False) == "<bos>12+34=46<eos><pad>"


def test_encode_names_an_unknown_character():
    tok = CharTokenizer(ALPHABET)
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tok.encode("12x")


def test_decode_rejects_ids_outside_the_vocabulary():
    tok = CharTokenizer(ALPHABET)
    with pytest.raises(ValueError, match="token id 15 at position 1"):
        tok.decode([3, 15])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])


@pytest.mark.parametrize("chars, problem", [("", "non-empty"), ("abca", "repeats character 'a'")])
def test_bad_alphabets_are_rejected(chars, problem):
    with pytest.raises(ValueError, match=problem):
        CharTokenizer(chars)


def test_save_and_load_round_trip(tmp_path):
    tok = CharTokenizer("ab c")
    tok.save(tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "tokenizer.json").read_text())
    assert data["type"] == "furlong-char"
    assert data["chars"] == "ab c"
    loaded = CharTokenizer.load(tmp_path / "ckpt")
    assert loaded == tok
    assert loaded.encode("c a") == tok.encode("c a") == [1, 6, 5, 3]


def test_load_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.json does not exist"):
        CharTokenizer.load(tmp_path)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"type": "bpe", "version": 1}', "type is 'bpe'"),
        ('{"type": "furlong-char", "version": 9}', "format version 9"),
        (
            '{"type": "furlong-char", "version": 1, "special_tokens": {"<pad>": 0}, "chars": "ab"}',
            "special_tokens",
        ),
        (
            '{"type": "furlong-char", "version": 1, "special_tokens": {"<pad>": 0, "<bos>": 1, "<eos>": 2}, '
            '"chars": 5}',
            "chars must be a string",
        ),
        (
            '{"type": "furlong-char", "version": 1, "special_tokens": {"<pad>": 0, "<bos>": 1, "<eos>": 2}, '
            '"chars": "aa"}',
            "repeats character",
        ),
    ],
)
def test_load_malformed_file_is_a_clear_error(tmp_path, content, problem):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=problem):
        CharTokenizer.load(tmp_path)
