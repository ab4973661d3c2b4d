"""One synchronous RL step through Furlong's running services against TRL's GRPOTrainer doing the
same job in one process.

    python bench/rl_step.py [--quick] [--json] [--torch-threads N]

Job (the full run): a Llama-style model of ~17 M parameters (hidden 512, 6 layers, 8 heads, 4 KV
heads, intermediate 1376, the addition task's character vocabulary), 16 prompts x 8 samples, up to
64 new tokens, temperature 1.0, no KL, GRPO, learning rate 1e-5. The reward is `format_integer` (1 when
the completion is an integer literal): unlike exact match it varies within groups of a random initial
policy, so both sides do real training work. `--quick`: hidden 128, 2 layers, 4 prompts x 8, 32 new
tokens. Both sides start from the same weights.

- ours: the local stack started as `furlong up` starts it (`local_stack.start_stack`: Redis, weight
  broker, trainer, rollout and controller as separate processes on 127.0.0.1, gRPC authenticated
  with the stack's internal token, trainer and rollout with `--torch-threads` torch threads each,
  default 1 like `furlong up`; TRL gets the same number).
  Each step is driven over gRPC with the controller's own clients, in the order its run driver
  calls them: rollout.Generate (generate + reward -> Redis stream) -> trainer.TrainStep ->
  trainer.PublishWeights -> broker.WaitCommitted (every engine serves the new version). The
  controller's REST API cannot submit this job: a run's reward is its task's, and the only task
  (addition, exact match) gives a random initial policy no reward variance, hence no training work.
- TRL: `GRPOTrainer` (trl, benchmark-only dependency) on the same CPU, one optimizer step per
  generation batch, `beta=0`.

`rl_step_vs_trl` = samples per second, ours / TRL's, medians of the steps after a warm-up step
(higher is better). Stack start-up (processes healthy) and run configuration (checkpoint loading)
are reported separately and excluded from the step time; so is TRL's set-up. Mean completion
lengths of both are reported: both sample from the same initial policy, stopping at <eos>. When TRL
is not installed the ratio is null and `notes` says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong import rpc
from furlong.controller.core.step_record import sampling_seed
from furlong.controller.local_stack import StackConfig, start_stack, stop_stack
from furlong.core.checkpoint import save_policy
from furlong.core.settings import AlgorithmSettings, SamplingSettings
from furlong.core.tasks import AdditionTask, get_task
from furlong.core.tokenizer import Tokenizer, char_tokenizer
from furlong.rollout.client import GrpcRolloutClient, RolloutDeadlines
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.rollout.rewards import FORMAT_INTEGER, format_integer_reward
from furlong.trainer.api import TrainerRunConfig, TrainStepRequest
from furlong.trainer.client import GrpcTrainerClient, TrainerDeadlines
from furlong.transfer.broker_client import GrpcBrokerClient

LR = 1e-5
STACK_SERVICES = ("redis", "weight_broker", "trainer", "rollout", "controller")
WAIT_S = 600.0


def build_model(tokenizer: Tokenizer, hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 1376 // 512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def run_ours(
    model_dir: Path,
    tmp: Path,
    prompts_per_step: int,
    samples: int,
    max_new: int,
    steps: int,
    torch_threads: int,
) -> dict:
    """Start the stack, run `steps` synchronous steps through it over gRPC, stop it."""
    started = time.perf_counter()
    stack = start_stack(
        StackConfig(state_dir=tmp / "stack", services=STACK_SERVICES, torch_threads=torch_threads)
    )
    out: dict = {"startup_s": time.perf_counter() - started, "steps": []}
    clients = []
    try:
        ready = httpx.get(f"{stack.rest_url}/readyz", timeout=10.0).json()
        if not ready["ready"]:
            raise RuntimeError(f"controller is not ready: {ready}")
        rpc.use_auth_token(Path(stack.internal_token_file).read_text().strip())
        trainer = GrpcTrainerClient(
            stack.addresses["trainer"],
            TrainerDeadlines(call_s=WAIT_S, configure_s=WAIT_S, publish_s=WAIT_S, checkpoint_s=WAIT_S),
        )
        rollout = GrpcRolloutClient(
            stack.addresses["rollout"], RolloutDeadlines(call_s=WAIT_S, configure_s=WAIT_S)
        )
        broker = GrpcBrokerClient(stack.addresses["weight_broker"], timeout_s=WAIT_S)
        clients = [trainer, rollout, broker]
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_new)
        configured = time.perf_counter()
        # The addition task's prompts (run seed 0), scored by format_integer instead of its reward.
        rollout.configure_run(
            RolloutRunConfig(
                run_id="bench", model_dir=str(model_dir), seed=0, task="addition", reward=FORMAT_INTEGER
            )
        )
        version = trainer.configure_run(
            TrainerRunConfig(
                run_id="bench",
                model_dir=str(model_dir),
                algorithm=AlgorithmSettings(name="grpo", learning_rate=LR),
                sampling_temperature=sampling.temperature,
                seed=0,
                total_steps=steps,
            )
        ).policy_version
        out["configure_s"] = time.perf_counter() - configured
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            gen = rollout.generate(
                GenerateRequest(
                    run_id="bench",
                    step=step,
                    samples_per_prompt=samples,
                    sampling=SamplingConfig.of(sampling, sampling_seed(0, step)),
                    num_groups=prompts_per_step,
                    min_policy_version=version,
                    timeout_s=WAIT_S,
                )
            )
            t1 = time.perf_counter()
            train = trainer.train_step(
                TrainStepRequest(run_id="bench", step=step, num_groups=prompts_per_step, timeout_s=WAIT_S)
            )
            t2 = time.perf_counter()
            trainer.publish_weights("bench", train.policy_version)
            status = broker.wait_committed("bench", train.policy_version, WAIT_S)
            t3 = time.perf_counter()
            if status.committed_version != train.policy_version:
                raise RuntimeError(f"step {step}: version {train.policy_version} not committed: {status}")
            version = train.policy_version
            out["steps"].append(
                {
                    "step_s": t3 - t0,
                    "generate_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_s": t3 - t2,
                    "completion_tokens": gen.num_tokens / gen.num_samples,
                    "reward_mean": gen.reward_mean,
                    "trained_samples": train.metrics.get("num_trained_samples"),
                }
            )
        for client in (rollout, trainer, broker):
            client.end_run("bench")
    finally:
        for client in clients:
            client.close()
        stop_stack(Path(stack.state_dir))
    return out


def hf_tokenizer(tokenizer: Tokenizer):
    """The policy's own transformers tokenizer, padding on the left as TRL's generation needs."""
    hf = copy.deepcopy(tokenizer.hf)
    hf.padding_side = "left"
    return hf


def run_trl(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    tmp: Path,
    prompts_per_step: int,
    samples: int,
    max_new: int,
    steps: int,
):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = get_task("addition")
    rows = [
        {"prompt": p.text, "answer": p.answer}
        for step in range(1, steps + 1)
        for p in task.prompts(0, step, prompts_per_step)
    ]

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

    config = GRPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=prompts_per_step * samples,
        gradient_accumulation_steps=1,
        num_generations=samples,
        max_completion_length=max_new,
        temperature=1.0,
        beta=0.0,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
    )
    started = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=hf_tokenizer(tokenizer),
        callbacks=[Timer()],
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    return times, lengths, rewards, setup_s


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the trainer and rollout processes (`furlong up "
        "--torch-threads`, default 1) and of TRL's process",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    hidden, layers, prompts, max_new, steps = (128, 2, 4, 32, 3) if args.quick else (512, 6, 16, 64, 4)
    samples = 8
    tokenizer = char_tokenizer(AdditionTask.ALPHABET)
    model = build_model(tokenizer, hidden, layers)
    num_params = sum(t.numel() for t in model.parameters())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        save_policy(copy.deepcopy(model), tokenizer, tmp / "model")
        ours = run_ours(tmp / "model", tmp, prompts, samples, max_new, steps, args.torch_threads)
        try:
            import trl

            trl_version = trl.__version__
        except ImportError:
            trl_version = None
        trl_t, trl_len, trl_reward, trl_setup = [], [], [], None
        if trl_version:
            torch.set_num_threads(args.torch_threads)  # the same threads as each of our processes
            trl_t, trl_len, trl_reward, trl_setup = run_trl(
                model, tokenizer, tmp, prompts, samples, max_new, steps
            )
    batch = prompts * samples
    measured = ours["steps"][1:]
    ours_step = _median([s["step_s"] for s in measured])
    ours_sps = batch / ours_step
    trl_step = _median(trl_t[1:])
    trl_sps = batch / trl_step if trl_step else None
    notes = (
        "ours: Redis, weight broker, trainer, rollout and controller as processes (local_stack), steps "
        f"driven over authenticated gRPC (Generate, TrainStep, PublishWeights, WaitCommitted), "
        f"{args.torch_threads} torch thread(s) per trainer/rollout process and for TRL; TRL: GRPOTrainer in "
        "one process, same weights, prompts and sampling; medians after one warm-up step; start-up excluded"
    )
    if trl_version is None:
        notes = "TRL IS NOT INSTALLED: rl_step_vs_trl not measured (pip install trl). " + notes
    result = {
        "bench": "rl_step",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "hidden": hidden,
            "layers": layers,
            "num_parameters": num_params,
            "prompts": prompts,
            "samples_per_prompt": samples,
            "max_new_tokens": max_new,
            "steps": steps,
            "torch_threads": args.torch_threads,
            "trl": trl_version,
            "quick": args.quick,
        },
        "metrics": {
            "ours_samples_per_s": ours_sps,
            "trl_samples_per_s": trl_sps,
            "ours_step_s": ours_step,
            "trl_step_s": trl_step,
            "ours_generate_s": _median([s["generate_s"] for s in measured]),
            "ours_train_s": _median([s["train_s"] for s in measured]),
            "ours_sync_s": _median([s["sync_s"] for s in measured]),
            "ours_warmup_step_s": ours["steps"][0]["step_s"],
            "trl_warmup_step_s": trl_t[0] if trl_t else None,
            "ours_stack_startup_s": ours["startup_s"],
            "ours_configure_s": ours["configure_s"],
            "trl_setup_s": trl_setup,
            "ours_mean_completion_tokens": statistics.mean(s["completion_tokens"] for s in ours["steps"]),
            "trl_mean_completion_tokens": statistics.mean(trl_len) if trl_len else None,
            "ours_reward_mean": statistics.mean(s["reward_mean"] for s in ours["steps"]),
            "trl_reward_mean": statistics.mean(trl_reward) if trl_reward else None,
        },
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
