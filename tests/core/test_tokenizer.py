"""The tokenizer adapter over transformers' tokenizers: the character-level tokenizer of the
example (built with the `tokenizers` library), BOS handling of tokenizers with and without one,
EOS ids, decoding and the errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
from hf_models import bpe_tokenizer

from furlong.core.tokenizer import Tokenizer, char_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

ALPHABET = "0123456789+="


def test_char_tokenizer_ids_and_vocab_size():
    tok = char_tokenizer(ALPHABET)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.eos_ids) == (0, 1, 2, (2,))
    assert tok.vocab_size == 15


def test_encode_puts_the_tokenizers_own_bos_first():
    tok = char_tokenizer(ALPHABET)
    assert tok.encode("07+85=") == [1, 3, 10, 13, 11, 8, 14]
    assert tok.encode("92", add_bos=False) == [12, 5]
    assert tok.encode("", add_bos=False) == []
    assert tok.encode("07") == tok.hf.encode("07")  # what transformers' own encode gives


def test_a_tokenizer_without_bos_adds_none():
    tok = Tokenizer(bpe_tokenizer(), eos_ids=[2, 0])
    assert tok.bos_id is None
    assert tok.encode("the lazy dog") == tok.encode("the lazy dog", add_bos=False)
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (2, (2, 0), 0)


def test_decode_round_trip_and_special_tokens():
    tok = char_tokenizer(ALPHABET)
    ids = tok.encode("12+34=") + tok.encode("46", add_bos=False) + [tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "12+34=46"
    assert tok.decode(ids, skip_special=False) == "<bos>12+34=46<eos><pad>"


def test_encode_names_an_unknown_character():
    tok = char_tokenizer(ALPHABET)
    with pytest.raises(ValueError, match=r"character 'x' at position 2"):
        tok.encode("12x")


def test_decode_rejects_ids_outside_the_vocabulary():
    tok = char_tokenizer(ALPHABET)
    with pytest.raises(ValueError, match="token id 15 at position 1"):
        tok.decode([3, 15])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])


@pytest.mark.parametrize("chars, problem", [("", "non-empty"), ("abca", "repeats character 'a'")])
def test_bad_alphabets_are_rejected(chars, problem):
    with pytest.raises(ValueError, match=problem):
        char_tokenizer(chars)


@pytest.mark.parametrize("eos", [[], [15], [True], [-1]])
def test_eos_ids_must_be_ids_of_the_vocabulary(eos):
    with pytest.raises(ValueError, match="eos ids must be"):
        Tokenizer(char_tokenizer(ALPHABET).hf, eos_ids=eos)


def test_no_pad_token_pads_with_the_first_eos(caplog):
    hf = bpe_tokenizer()
    hf.pad_token = None
    with caplog.at_level("INFO"):
        tok = Tokenizer(hf, eos_ids=[2])
    assert tok.pad_id == 2 and "padding with the first EOS id 2" in caplog.text


def test_save_and_load_round_trip_with_chat_template(tmp_path):
    tok = char_tokenizer("ab c", chat_template="{{ messages[0]['content'] }}")
    tok.save(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    assert data["model"]["type"] == "WordLevel"
    loaded = load_tokenizer(tmp_path / "m", eos_ids=[2])
    assert loaded.encode("ab c") == tok.encode("ab c") == [1, 3, 4, 5, 6]
    assert loaded.chat_template == "{{ messages[0]['content'] }}"


def test_a_directory_without_tokenizer_files_is_named(tmp_path):
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer_config.json exists"):
        load_tokenizer(tmp_path, eos_ids=[2])
