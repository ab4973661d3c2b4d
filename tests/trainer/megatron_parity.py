"""Run as a script (its own process: megatron-core needs a torch.distributed group): builds a tiny
Llama, converts it to a megatron-core GPTModel, and prints one JSON line comparing them."""

import copy
import json
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.samples import SampleGroup
from furlong.core.settings import AlgorithmSettings
from furlong.rpc.ports import free_port
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.logprobs import log_probs_with_support
from furlong.trainer.megatron._compat import megatron_version
from furlong.trainer.megatron.gpt import MegatronCausalLM, init_model_parallel

warnings.filterwarnings("ignore")


def main() -> None:
    tie = sys.argv[1] == "tied" if len(sys.argv) > 1 else False
    torch.manual_seed(0)
    config = LlamaConfig(
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
    hf = LlamaForCausalLM(config).eval()
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
    s_hf = Learner(hf, LearnerConfig(AlgorithmSettings(learning_rate=1e-2))).train_step(groups)
    s_mg = Learner(mg, LearnerConfig(AlgorithmSettings(learning_rate=1e-2))).train_step(groups)
    trained = mg.hf_state_dict()
    after = max(float((trained[k] - v).abs().max()) for k, v in hf.state_dict().items())
    print(
        json.dumps(
            {
                "megatron_core": megatron_version(),
                "logprob_max_abs_diff": float((a - b).abs().max()),
                "num_tokens": int(targets.numel()),
                "round_trip_exact": round_trip,
                "loss_hf": s_hf.loss,
                "loss_megatron": s_mg.loss,
                "grad_norm_hf": s_hf.grad_norm,
                "grad_norm_megatron": s_mg.grad_norm,
                "param_max_abs_diff_after_step": after,
            }
        )
    )


if __name__ == "__main__":
    main()
