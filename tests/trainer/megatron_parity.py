"""Run as a script (its own process: megatron-core needs a torch.distributed group): builds a tiny
model of a family the megatron backend takes (Llama; Qwen2 with its q/k/v bias; Qwen3 with its
per-head q/k norms), converts it to a megatron-core GPTModel, and prints one JSON line comparing
them.

    python tests/trainer/megatron_parity.py {untied|tied} [llama|qwen2|qwen3]
"""

import copy
import json
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from furlong.core.samples import SampleGroup
from furlong.core.settings import AlgorithmSettings
from furlong.rpc.ports import free_port
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.logprobs import log_probs_with_support
from furlong.trainer.megatron._compat import megatron_version
from furlong.trainer.megatron.gpt import MegatronCausalLM
from furlong.trainer.megatron.parallel import init_model_parallel

warnings.filterwarnings("ignore")


def main() -> None:
    tie = sys.argv[1] == "tied" if len(sys.argv) > 1 else False
    family = sys.argv[2] if len(sys.argv) > 2 else "llama"
    torch.manual_seed(0)
    shape = dict(
        vocab_size=15,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    configs = {
        "llama": lambda: LlamaConfig(**shape),
        "qwen2": lambda: Qwen2Config(**shape),
        "qwen3": lambda: Qwen3Config(**shape, head_dim=8),
    }
    hf = AutoModelForCausalLM.from_config(configs[family]()).eval()
    if family == "qwen2":  # its q/k/v biases start at zero: give them values the conversion must carry
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, 0.5)
    init_model_parallel(free_port())
    mg = MegatronCausalLM.from_hf(copy.deepcopy(hf))
    ids = torch.randint(0, 15, (3, 11), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:].reshape(-1)
    with torch.no_grad():
        a = log_probs_with_support(hf(input_ids=ids[:, :-1]).logits, targets, temperature=0.7).logprobs
        b = log_probs_with_support(mg(input_ids=ids[:, :-1]).logits, targets, temperature=0.7).logprobs
    back = mg.hf_state_dict()
    round_trip = all(torch.equal(back[k], v) for k, v in hf.state_dict().items())

    sys.path[:0] = ["tests/trainer", "tests"]
    from test_learner import batch  # samples drawn from the HF model

    groups: list[SampleGroup] = batch(hf)
    algorithm = AlgorithmSettings(learning_rate=1e-2)
    # the forward under bfloat16 autocast (the trainer refuses megatron's backward under CPU autocast)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_hf, bf16_mg = (
            log_probs_with_support(m(input_ids=ids[:, :-1]).logits.float(), targets, temperature=0.7).logprobs
            for m in (hf, mg)
        )
    # a trainer that packs micro-batches: the megatron learner pads them (its layers take no
    # per-sequence positions), so the step is the padded one
    s_mg_packed = Learner(copy.deepcopy(mg), LearnerConfig(algorithm, micro_batch_tokens=64)).train_step(
        groups
    )
    s_hf = Learner(hf, LearnerConfig(algorithm)).train_step(groups)
    s_mg = Learner(mg, LearnerConfig(algorithm)).train_step(groups)
    trained = mg.hf_state_dict()
    diffs = {k: float((trained[k] - v).abs().max()) for k, v in hf.state_dict().items()}
    after = max(diffs.values())
    print(
        json.dumps(
            {
                "megatron_core": megatron_version(),
                "family": hf.config.model_type,
                "logprob_max_abs_diff": float((a - b).abs().max()),
                "num_tokens": int(targets.numel()),
                "round_trip_exact": round_trip,
                "loss_hf": s_hf.loss,
                "loss_megatron": s_mg.loss,
                "grad_norm_hf": s_hf.grad_norm,
                "grad_norm_megatron": s_mg.grad_norm,
                "param_max_abs_diff_after_step": after,
                "bf16_logprob_max_abs_diff": float((bf16_hf - bf16_mg).abs().max()),
                "bf16_vs_fp32_logprob_max_abs_diff": float((bf16_mg - b).abs().max()),
                "packed_equals_padded": (s_mg_packed.loss, s_mg_packed.grad_norm)
                == (s_mg.loss, s_mg.grad_norm),
            }
        )
    )


if __name__ == "__main__":
    main()
