"""The policy checkpoint format: round trips, strict loading, and the committed example checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import load_policy, save_policy
from furlong.core.tasks import AdditionTask
from furlong.core.tokenizer import CharTokenizer

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"


def tiny_model(vocab_size: int = 15, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def saved(tmp_path) -> tuple[Path, LlamaForCausalLM, CharTokenizer]:
    model, tok = tiny_model(), CharTokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path / "ckpt")
    return tmp_path / "ckpt", model, tok


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_round_trip_gives_the_same_model(saved):
    path, model, tok = saved
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 15 and config["dtype"] == "float32"
    loaded, loaded_tok = load_policy(path)
    assert loaded_tok == tok
    assert not loaded.training
    ids = torch.tensor([tok.encode("12+34=46")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_load_casts_to_the_requested_dtype(saved):
    loaded, _ = load_policy(saved[0], dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="floating-point"):
        load_policy(saved[0], dtype=torch.int32)


def test_tied_embeddings_are_stored_once_and_stay_tied(tmp_path):
    model, tok = tiny_model(tie=True), CharTokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    loaded, _ = load_policy(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_missing_tensor_is_named(saved):
    rewrite_weights(saved[0], lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.norm.weight'\]"):
        load_policy(saved[0])


def test_unexpected_tensor_is_named(saved):
    rewrite_weights(saved[0], lambda t: t.update({"extra.bias": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra.bias'\]"):
        load_policy(saved[0])


def test_wrong_shape_is_named(saved):
    rewrite_weights(saved[0], lambda t: t.update({"lm_head.weight": torch.zeros(15, 8)}))
    with pytest.raises(ValueError, match=r"lm_head.weight: file \(15, 8\) vs model \(15, 16\)"):
        load_policy(saved[0])


def test_vocab_mismatch_between_config_and_tokenizer(saved):
    CharTokenizer("0123456789+=-").save(saved[0])
    with pytest.raises(ValueError, match="vocab_size 15 differs from the tokenizer's vocab_size 16"):
        load_policy(saved[0])


def test_save_refuses_a_tokenizer_that_does_not_fit(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 15 differs"):
        save_policy(tiny_model(), CharTokenizer("ab"), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize(
    "breakage, problem",
    [
        (lambda p: (p / "config.json").unlink(), r"config\.json does not exist"),
        (lambda p: (p / "config.json").write_text("{"), "not valid JSON"),
        (lambda p: (p / "config.json").write_text('{"model_type": "gpt2"}'), "model_type 'gpt2'"),
        (lambda p: (p / "model.safetensors").unlink(), r"model\.safetensors do not exist"),
        (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "cannot be read"),
        (lambda p: (p / "tokenizer.json").unlink(), r"tokenizer\.json does not exist"),
    ],
)
def test_broken_checkpoint_files_are_clear_errors(saved, breakage, problem):
    breakage(saved[0])
    with pytest.raises(ValueError, match=problem):
        load_policy(saved[0])


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_policy(tmp_path / "nowhere")


def test_example_checkpoint_is_small_and_adds():
    assert (EXAMPLE / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    model, tok = load_policy(EXAMPLE)
    task = AdditionTask()
    assert tok == CharTokenizer(task.ALPHABET)
    prompts = task.prompts(99, 0, 64)
    ids = torch.tensor([tok.encode(p.text) for p in prompts])  # fixed-width prompts: no padding
    with torch.no_grad():
        for _ in range(task.max_answer_chars + 1):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    correct = 0
    for p, row in zip(prompts, ids[:, task.prompt_chars + 1 :].tolist()):
        if tok.eos_id in row:
            correct += tok.decode(row[: row.index(tok.eos_id)]) == p.answer
    assert correct >= 0.8 * len(prompts)
