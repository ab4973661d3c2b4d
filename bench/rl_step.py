"""One synchronous RL step through Furlong's services against TRL's GRPOTrainer doing the same job.

    python bench/rl_step.py [--quick] [--json]

Job (the full run): a Llama-style model of ~17 M parameters (hidden 512, 6 layers, 8 heads, 4 KV
heads, intermediate 1376, the addition task's character vocabulary), 16 prompts x 8 samples, up to
64 new tokens, temperature 1.0, no KL, GRPO, learning rate 1e-5. The reward is `format_integer` (1 when
the completion is an integer literal): unlike exact match it varies within groups of a random initial
policy, so both sides do real training work. `--quick`:
hidden 128, 2 layers, 4 prompts x 8, 32 new tokens. Both sides start from the same weights.

- ours: the rollout service, the trainer service and the weight broker in this process through
  their in-process clients (real Redis stream, the real publisher and engine switch): generate +
  reward -> Redis -> train -> publish -> every engine on the new version.
- TRL: `GRPOTrainer` (trl, benchmark-only dependency) on the same CPU, one optimizer step per
  generation batch, `beta=0`.

`rl_step_vs_trl` = samples per second, ours ÷ TRL's, medians of steps after a warm-up step (higher is
better). Mean completion lengths of both are reported: both sample from the same initial policy,
stopping at <eos>. When TRL is not installed the ratio is null and `notes` says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import save_policy
from furlong.core.redis_server import RedisServer
from furlong.core.tasks import AdditionTask, get_task
from furlong.core.tokenizer import CharTokenizer
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import Prompt
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.rewards import FORMAT_INTEGER, format_integer_reward
from furlong.trainer.core.learner import LearnerConfig
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

LR = 1e-5


def build_model(tokenizer: CharTokenizer, hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, intermediate_size=hidden * 1376 // 512,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def run_ours(model_dir: Path, tmp: Path, prompts_per_step: int, samples: int, max_new: int, steps: int):
    server = RedisServer(data_dir=tmp / "redis").start()
    client = redis.Redis.from_url(server.url)
    broker = InProcessBrokerClient(BrokerCore())
    rollout = RolloutService(client, broker_receiver_factory(broker))
    trainer = TrainerService(client, broker, consumer_name="trainer-0")
    task = get_task("addition")
    times, lengths, rewards = [], [], []
    try:
        rollout.configure_run("bench", str(model_dir), FORMAT_INTEGER, num_engines=1, seed=0)
        trainer.configure_run("bench", str(model_dir), LearnerConfig(learning_rate=LR, temperature=1.0),
                              total_steps=steps)
        for step in range(1, steps + 1):
            prompts = [Prompt(p.prompt_id, p.text, p.answer) for p in task.prompts(0, step, prompts_per_step)]
            t0 = time.perf_counter()
            rollout.generate("bench", step, prompts, samples, SamplingConfig(temperature=1.0, max_new_tokens=max_new,
                                                                              seed=step), step - 1, 300)
            stats, version = trainer.train_step("bench", step, prompts_per_step, 300)
            trainer.publish_weights("bench", version)
            broker.wait_committed("bench", version, 300)
            times.append(time.perf_counter() - t0)
            lengths.append(stats.num_tokens / stats.num_samples)
            rewards.append(stats.reward_mean)
    finally:
        trainer.close()
        rollout.close()
        broker.close()
        server.stop()
    return times, lengths, rewards


def hf_tokenizer(tokenizer: CharTokenizer):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": tokenizer.pad_id, "<bos>": tokenizer.bos_id, "<eos>": tokenizer.eos_id}
    vocab.update({ch: tokenizer.encode(ch, add_bos=False)[0] for ch in tokenizer.chars})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_id)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   padding_side="left")


def run_trl(model: LlamaForCausalLM, tokenizer: CharTokenizer, tmp: Path, prompts_per_step: int, samples: int,
            max_new: int, steps: int):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = get_task("addition")
    rows = [{"prompt": p.text, "answer": p.answer} for step in range(1, steps + 1)
            for p in task.prompts(0, step, prompts_per_step)]

    def reward(prompts, completions, answer, **_):
        return [format_integer_reward(c, a) for c, a in zip(completions, answer)]

    times, lengths, rewards = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))
                rewards.append(float(logs.get("reward", "nan")))

    config = GRPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=prompts_per_step * samples,
                        gradient_accumulation_steps=1, num_generations=samples, max_completion_length=max_new,
                        temperature=1.0, beta=0.0, learning_rate=LR, max_steps=steps, logging_steps=1,
                        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                        shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=hf_tokenizer(tokenizer), callbacks=[Timer()])
    trainer.train()
    return times, lengths, rewards


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    hidden, layers, prompts, max_new, steps = (128, 2, 4, 32, 3) if args.quick else (512, 6, 16, 64, 4)
    samples = 8
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer = CharTokenizer(AdditionTask.ALPHABET)
    model = build_model(tokenizer, hidden, layers)
    num_params = sum(t.numel() for t in model.parameters())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        save_policy(copy.deepcopy(model), tokenizer, tmp / "model")
        ours_t, ours_len, ours_reward = run_ours(tmp / "model", tmp, prompts, samples, max_new, steps)
        try:
            import trl  # noqa: F401
            trl_version = trl.__version__
        except ImportError:
            trl_version = None
        trl_t, trl_len, trl_reward = (run_trl(model, tokenizer, tmp, prompts, samples, max_new, steps)
                                      if trl_version else ([], [], []))
    batch = prompts * samples
    ours_sps = batch / statistics.median(ours_t[1:])
    trl_sps = batch / statistics.median(trl_t[1:]) if len(trl_t) > 1 else None
    notes = ("ours: services in one process via in-process clients (Redis stream, publish, engine switch); "
             "TRL: GRPOTrainer, same weights, prompts and sampling; medians after one warm-up step")
    if trl_version is None:
        notes = "TRL IS NOT INSTALLED: rl_step_vs_trl not measured (pip install trl). " + notes
    result = {
        "bench": "rl_step",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {"hidden": hidden, "layers": layers, "num_parameters": num_params, "prompts": prompts,
                   "samples_per_prompt": samples, "max_new_tokens": max_new, "steps": steps,
                   "trl": trl_version, "quick": args.quick},
        "metrics": {"ours_samples_per_s": ours_sps, "trl_samples_per_s": trl_sps,
                    "ours_step_s": statistics.median(ours_t[1:]),
                    "trl_step_s": statistics.median(trl_t[1:]) if trl_sps else None,
                    "ours_mean_completion_tokens": statistics.mean(ours_len),
                    "trl_mean_completion_tokens": statistics.mean(trl_len) if trl_len else None,
                    "ours_reward_mean": statistics.mean(ours_reward),
                    "trl_reward_mean": statistics.mean(trl_reward) if trl_reward else None},
        "ratios": {"rl_step_vs_trl": ours_sps / trl_sps if trl_sps else None},
        "notes": notes,
    }
    if not args.json:
        for key, value in {**result["metrics"], **result["ratios"]}.items():
            print(f"{key:>30}: {value}")
        if trl_version is None:
            print("TRL is not installed: only our side was measured", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
