"""A policy is a Hugging Face directory: every family loads exactly as transformers loads it, shards
are streamed, every broken or missing file is named, saved and exported directories load in
transformers, and the committed example is one."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import transformers
from hf_models import FAMILIES, reference_logits, write_user_dir
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import (
    export_policy,
    load_policy,
    read_generation_config,
    save_policy,
    unique_state,
)
from furlong.core.tasks import AdditionTask
from furlong.core.tokenizer import char_tokenizer

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"
TEXT = "the quick brown fox 12+34=46"


def tiny_llama(vocab_size: int = 15, tie: bool = False) -> LlamaForCausalLM:
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
def saved(tmp_path):
    model, tok = tiny_llama(), char_tokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path / "ckpt")
    return tmp_path / "ckpt", model, tok


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    return write_user_dir(tmp_path_factory.mktemp("qwen3") / "model", "qwen3")


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_loads_as_transformers_loads_it(tmp_path, family, dtype):
    model_dir = write_user_dir(tmp_path / family, family)
    assert len(list(model_dir.glob("model-*.safetensors"))) >= 3
    model, tok = load_policy(model_dir, dtype)
    assert type(model).__name__ == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    ids = tok.encode(TEXT)
    with torch.no_grad():
        ours = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.equal(ours, reference_logits(model_dir, ids, dtype))  # the same bits


def test_tokenizer_comes_from_the_directory_with_the_generation_configs_eos_ids(user_dir):
    _, tok = load_policy(user_dir)
    assert tok.eos_ids == (2, 0) and tok.eos_id == 2  # generation_config.json lists two
    assert tok.pad_id == 0 and tok.bos_id is None  # Qwen-style: no BOS
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    ids = tok.encode("the lazy dog")
    assert ids == tok.hf.encode("the lazy dog") and tok.decode(ids) == "the lazy dog"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_chat_template_in_tokenizer_config_is_read_too(tmp_path):
    model_dir = write_user_dir(tmp_path / "m", "llama", template_in_config=True)
    assert not (model_dir / "chat_template.jinja").exists()
    _, tok = load_policy(model_dir)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_one_eos_id_and_char_tokenizer_bos(saved):
    path, _, tok = saved
    assert read_generation_config(path).eos_ids == (2,)
    _, loaded = load_policy(path)
    assert loaded.encode("12+34=") == [1, 4, 5, 13, 6, 7, 14] == tok.encode("12+34=")
    assert loaded.encode("46", add_bos=False) == [7, 9]
    assert (
        loaded.decode([1, 7, 9, 2]) == "46"
        and loaded.decode([1, 7, 9, 2], skip_special=False) == "<bos>46<eos>"
    )
    with pytest.raises(ValueError, match="cannot tokenize"):
        loaded.encode("12-3")


def test_round_trip_of_save_policy(saved):
    path, model, tok = saved
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 15 and config["dtype"] == "float32"
    loaded, _ = load_policy(path)
    assert not loaded.training
    ids = torch.tensor([tok.encode("12+34=46")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        assert torch.equal(hf(ids).logits, model(ids).logits)


def test_load_casts_to_the_requested_dtype(saved):
    loaded, _ = load_policy(saved[0], dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(loaded.lm_head.weight, saved[1].lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="floating-point"):
        load_policy(saved[0], dtype=torch.int32)


def test_tied_embeddings_are_stored_once_and_stay_tied(tmp_path):
    model, tok = tiny_llama(tie=True), char_tokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    loaded, _ = load_policy(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_loads_in_several_threads_leave_model_construction_as_it_was(tmp_path):
    # transformers' no-init context restores what it found on exit: two loads interleaved without
    # a lock would leave its no-op init functions in place for every later model of the process.
    model, tok = tiny_llama(tie=True), char_tokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path)
    init_weights, normal = transformers.PreTrainedModel.init_weights, torch.nn.init.normal_
    start, errors = threading.Barrier(3), []

    def load_many() -> None:
        start.wait()
        try:
            for _ in range(20):
                loaded, _ = load_policy(tmp_path)
                assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=load_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert transformers.PreTrainedModel.init_weights is init_weights
    assert torch.nn.init.normal_ is normal


def test_missing_tensor_is_named(saved):
    rewrite_weights(saved[0], lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.norm.weight'\]"):
        load_policy(saved[0])


def test_unexpected_tensor_is_named_with_its_file(saved):
    rewrite_weights(saved[0], lambda t: t.update({"extra.bias": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra.bias \(model.safetensors\)'\]"):
        load_policy(saved[0])


def test_wrong_shape_is_named(saved):
    rewrite_weights(saved[0], lambda t: t.update({"lm_head.weight": torch.zeros(15, 8)}))
    with pytest.raises(
        ValueError, match=r"lm_head.weight \(model.safetensors\): stored shape \[15, 8\], model \[15, 16\]"
    ):
        load_policy(saved[0])


def test_integer_weights_are_refused(saved):
    rewrite_weights(saved[0], lambda t: t.update({"model.norm.weight": torch.zeros(16, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="model.norm.weight .*dtype I32 is not a float format"):
        load_policy(saved[0])


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(saved):
    char_tokenizer("0123456789+=-").save(saved[0])
    with pytest.raises(ValueError, match="tokenizer knows 16 ids, more than config.json's vocab_size 15"):
        load_policy(saved[0])
    with pytest.raises(ValueError, match="tokenizer knows 5 ids, more than the model's vocab_size 4"):
        save_policy(tiny_llama(vocab_size=4), char_tokenizer("ab"), saved[0].parent / "other")


def _drop_shard(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / sorted(set(index["weight_map"].values()))[1]).unlink()


@pytest.mark.parametrize(
    "breakage, problem",
    [
        (lambda p: (p / "config.json").unlink(), r"config\.json does not exist"),
        (lambda p: (p / "config.json").write_text("{"), r"config\.json is not readable JSON"),
        (
            lambda p: (p / "config.json").write_text('{"model_type": "gpt2"}'),
            "model_type 'gpt2' is not a supported",
        ),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps(
                    {
                        **json.loads((p / "config.json").read_text()),
                        "quantization_config": {"quant_method": "fp8"},
                    }
                )
            ),
            "quantized checkpoints",
        ),
        (lambda p: (p / "generation_config.json").unlink(), r"generation_config\.json does not exist"),
        (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": []}'), "eos_token_id must be"),
        (
            lambda p: (p / "tokenizer.json").unlink() or (p / "tokenizer_config.json").unlink(),
            "has no tokenizer",
        ),
        (lambda p: (p / "tokenizer.json").write_text("{"), r"tokenizer of .* cannot be loaded"),
        (
            lambda p: (p / "model.safetensors.index.json").write_text("[]"),
            r"index\.json must hold a JSON object",
        ),
        (
            _drop_shard,
            r"shard model-00002-of-\d+\.safetensors listed in model\.safetensors\.index\.json does not exist",
        ),
        (
            lambda p: [s.write_bytes(b"garbage") for s in sorted(p.glob("model-*.safetensors"))[:1]],
            r"safetensors file .*model-00001-of-\d+\.safetensors",
        ),
    ],
)
def test_broken_or_missing_files_are_named(tmp_path, user_dir, breakage, problem):
    broken = tmp_path / "broken"
    shutil.copytree(user_dir, broken)
    breakage(broken)
    with pytest.raises(ValueError, match=problem):
        load_policy(broken)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_policy(tmp_path / "nowhere")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_export_writes_a_directory_transformers_loads_with_the_same_weights(tmp_path, family):
    source = write_user_dir(tmp_path / "in", family)
    model, tok = load_policy(source)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained"
    exported = export_policy(model.state_dict(), source, tmp_path / "out" / "final", max_shard_bytes=20_000)
    out = tmp_path / "out" / "final"
    assert exported.path == out and len(exported.shards) >= 2
    assert (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.joinpath("out").iterdir()) == ["final"]  # no scratch left
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    stored = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    if family != "qwen3":  # experts stored one projection per expert, as checkpoints do
        assert any(".experts.0.gate_proj.weight" in n for n in stored)
        assert not any(n.endswith("experts.gate_up_proj") for n in stored)
    ids = tok.encode(TEXT)
    with torch.no_grad():
        trained = model(input_ids=torch.tensor([ids])).logits[0]
    assert torch.equal(reference_logits(out, ids), trained)
    again, _ = load_policy(out)
    assert all(torch.equal(a, b) for a, b in zip(unique_state(again).values(), unique_state(model).values()))
    # a second export replaces the first
    export_policy(again.state_dict(), source, out)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()


def test_export_of_a_tied_model_stores_the_embedding_once_and_refuses_untied_values(tmp_path):
    model, tok = tiny_llama(tie=True), char_tokenizer(AdditionTask.ALPHABET)
    save_policy(model, tok, tmp_path / "src")
    state = {name: t.clone() for name, t in model.state_dict().items()}  # received: no aliasing left
    export_policy(state, tmp_path / "src", tmp_path / "out")
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))
    load_policy(tmp_path / "out")
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="lm_head.weight is tied to model.embed_tokens.weight"):
        export_policy(state, tmp_path / "src", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_example_checkpoint_is_a_small_hf_directory_that_adds():
    assert (EXAMPLE / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    assert json.loads((EXAMPLE / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    model, tok = load_policy(EXAMPLE)
    task = AdditionTask()
    assert tok.encode("0123456789+=") == [1, *range(3, 15)] and tok.eos_ids == (2,)
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
