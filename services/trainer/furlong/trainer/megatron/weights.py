"""Weight names and layouts of the megatron backend: Hugging Face Llama/Qwen2/Qwen3 state dicts <->
megatron-core GPTModel state dicts, and a GPTModel state dict <-> one tensor-parallel rank's shards.

Megatron fuses q/k/v into `linear_qkv`, interleaved per query group ([q of the group's heads, k, v]
for each key/value head), and gate/up into `linear_fc1` ([gate; up]). Under tensor parallelism
column-parallel weights (qkv, fc1, the embedding and the output layer) are split by rows and
row-parallel ones (proj, fc2) by columns; fc1 is split as gate and up separately (each rank holds
[its gate rows; its up rows]); norms are whole on every rank. `hf_sources` names the Megatron
tensor each Hugging Face tensor comes from and `hf_tensor` cuts it out, one name at a time (a
publish gathers round by round). Knows nothing about models or process groups beyond the shard
arithmetic; `gather_tensor_parallel` runs the all-gather.

A vocabulary the ranks cannot split evenly is padded (as Megatron-LM does) to the next multiple of
the tensor-parallel size (`padded_vocab_size`): `tensor_parallel_shard` appends zero rows to the
embedding and the output layer before splitting them, `gather_tensor_parallel` cuts them off
again, so whole tensors always have the model's real vocabulary size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from furlong.trainer.megatron.spec import HfConfig, head_layout

# Megatron name suffix -> the dimension its tensor-parallel shards split (absent: whole on every rank)
_SPLIT_DIMS = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
_FC1 = "mlp.linear_fc1.weight"
# the tensors whose rows are vocabulary ids (split by rows; padded under tensor parallelism)
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab_size(vocab_size: int, world: int) -> int:
    """`vocab_size` rounded up to a multiple of `world`: the rows the split vocabulary has."""
    return -(-vocab_size // world) * world


def is_vocab_rows(name: str) -> bool:
    """Whether `name`'s rows are vocabulary ids (the embedding, the output layer)."""
    return name.endswith(_VOCAB_ROWS)


def split_dim(name: str) -> int | None:
    """The dimension tensor-parallel ranks split `name` along (None: each holds it whole)."""
    for suffix, dim in _SPLIT_DIMS.items():
        if name.endswith(suffix):
            return dim
    return None


def hf_to_megatron(state: dict[str, torch.Tensor], config: HfConfig) -> dict[str, torch.Tensor]:
    """HF names -> Megatron GPTModel names (QKV interleaved per query group, gate|up fused); Qwen2's
    q/k/v biases and Qwen3's per-head q/k norms when the config has them."""
    d, groups, per_group = head_layout(config)
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            if hf + f"self_attn.q_proj.{kind}" not in state:
                continue
            q = state[hf + f"self_attn.q_proj.{kind}"].reshape(groups, per_group * d, -1)
            k = state[hf + f"self_attn.k_proj.{kind}"].reshape(groups, d, -1)
            v = state[hf + f"self_attn.v_proj.{kind}"].reshape(groups, d, -1)
            fused = torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * d, -1)
            out[mg + f"self_attention.linear_qkv.{kind}"] = fused if kind == "weight" else fused.reshape(-1)
        if hf + "self_attn.q_norm.weight" in state:
            out[mg + "self_attention.q_layernorm.weight"] = state[hf + "self_attn.q_norm.weight"]
            out[mg + "self_attention.k_layernorm.weight"] = state[hf + "self_attn.k_norm.weight"]
        out[mg + "self_attention.linear_proj.weight"] = state[hf + "self_attn.o_proj.weight"]
        out[mg + "input_layernorm.weight"] = state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = state[hf + "post_attention_layernorm.weight"]
        out[mg + _FC1] = torch.cat([state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]])
        out[mg + "mlp.linear_fc2.weight"] = state[hf + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], config: HfConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` on whole tensors (a tied model's `lm_head.weight` is the
    embedding, as transformers' own state dict lists it)."""
    return {
        name: hf_tensor(name, state[source], config) for name, source in hf_sources(state, config).items()
    }


_EMBEDDING = "embedding.word_embeddings.weight"
_QKV_PARTS = ("q_proj", "k_proj", "v_proj")


def hf_sources(names: Iterable[str], config: HfConfig) -> dict[str, str]:
    """Every Hugging Face name of the policy, in `megatron_to_hf`'s order, and the Megatron tensor
    (one of `names`) it is made of: q, k and v come from one `linear_qkv`, gate and up from one
    `linear_fc1`, a tied `lm_head.weight` from the embedding."""
    present = set(names)
    out = {
        "model.embed_tokens.weight": _EMBEDDING,
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": _EMBEDDING if config.tie_word_embeddings else "output_layer.weight",
    }
    for i in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            fused = mg + f"self_attention.linear_qkv.{kind}"
            if fused in present:
                out.update({hf + f"self_attn.{part}.{kind}": fused for part in _QKV_PARTS})
        if mg + "self_attention.q_layernorm.weight" in present:
            out[hf + "self_attn.q_norm.weight"] = mg + "self_attention.q_layernorm.weight"
            out[hf + "self_attn.k_norm.weight"] = mg + "self_attention.k_layernorm.weight"
        out[hf + "self_attn.o_proj.weight"] = mg + "self_attention.linear_proj.weight"
        out[hf + "input_layernorm.weight"] = mg + "input_layernorm.weight"
        out[hf + "post_attention_layernorm.weight"] = mg + "pre_mlp_layernorm.weight"
        out[hf + "mlp.gate_proj.weight"] = mg + _FC1
        out[hf + "mlp.up_proj.weight"] = mg + _FC1
        out[hf + "mlp.down_proj.weight"] = mg + "mlp.linear_fc2.weight"
    return out


def hf_tensor(name: str, source: torch.Tensor, config: HfConfig) -> torch.Tensor:
    """Hugging Face tensor `name` from the whole Megatron tensor it is made of (`hf_sources`): its
    slice of a fused q|k|v (interleaved per query group) or gate|up, or the tensor itself."""
    part = name.rsplit(".", 2)[-2]  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
    if ".self_attn." in name and part in _QKV_PARTS:
        d, groups, per_group = head_layout(config)
        qkv = source.reshape(groups, (per_group + 2) * d, -1)
        start, stop = {
            "q_proj": (0, per_group * d),
            "k_proj": (per_group * d, (per_group + 1) * d),
            "v_proj": ((per_group + 1) * d, (per_group + 2) * d),
        }[part]
        flat = qkv[:, start:stop].reshape(-1, qkv.shape[-1])
        return flat if name.endswith(".weight") else flat.reshape(-1)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        gate, up = source.chunk(2)
        return gate if part == "gate_proj" else up
    return source


def tensor_parallel_shard(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of the whole Megatron tensor `name` among `world` tensor-parallel ranks
    (vocabulary rows: of the tensor padded with zero rows to `padded_vocab_size`)."""
    dim = split_dim(name)
    if dim is None or world == 1:
        return tensor
    if is_vocab_rows(name):
        padding = padded_vocab_size(tensor.shape[0], world) - tensor.shape[0]
        if padding:
            tensor = torch.cat([tensor, tensor.new_zeros((padding, *tensor.shape[1:]))])
    if name.endswith(_FC1):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(world)[rank], up.chunk(world)[rank]])
    return tensor.chunk(world, dim=dim)[rank]


def gather_tensor_parallel(
    name: str, shard: torch.Tensor, group: dist.ProcessGroup, vocab_size: int
) -> torch.Tensor:
    """The whole Megatron tensor `name` from every rank's `shard` (a collective over `group`: every
    rank calls it, in the same order of names), vocabulary rows cut to the first `vocab_size`
    (the padding dropped). Inverse of `tensor_parallel_shard`."""
    dim, world = split_dim(name), dist.get_world_size(group)
    if dim is None or world == 1:
        return shard
    pieces = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    if name.endswith(_FC1):
        halves = [p.chunk(2) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    whole = torch.cat(pieces, dim=dim)
    return whole[:vocab_size] if is_vocab_rows(name) else whole
