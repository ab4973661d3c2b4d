"""Synchronous RL steps through Furlong's running services against TRL's GRPOTrainer doing the same
job in one process, on the Hugging Face path.

    python bench/rl_step.py [--quick] [--json] [--torch-threads N] [--dtype float32|bfloat16]
                            [--steps N]

Job: a Qwen3-architecture model directory as a user brings it (`bench/model_dirs.py`: random
weights, a byte-level BPE tokenizer of 16,384 ids trained with `tokenizers`, hidden 512, 6 layers,
8 query / 4 key-value heads of 64, gated MLP 1536, tied embeddings: 27 M parameters), a JSONL
dataset of 16 x steps prompt strings (sentences of the tokenizer's corpus), 16 prompts x 8 samples
a step, 64 new tokens, temperature 1.0, GRPO, no KL, learning rate 1e-5. The reward is the regex
`^\\s*[a-m]` (the response starts with a letter a-m): about half of a random policy's samples pass,
so the reward varies within groups and both sides do real training work. `--quick`: hidden 128,
2 layers, 4 prompts x 8, 32 new tokens, 3 steps. Both sides start from the same weights and read
the same prompts in the same order.

- ours: the local stack started as `furlong up` starts it (`local_stack.start_stack`: Redis, weight
  broker, trainer, rollout and controller as separate processes on 127.0.0.1, gRPC authenticated
  with the stack's internal token, trainer and rollout with `--torch-threads` torch threads each,
  default 1 like `furlong up`; TRL gets the same number). Each step is driven over gRPC with the
  controller's own clients, in the order its run driver calls them: rollout.Generate (generate +
  reward -> Redis stream) -> trainer.TrainStep -> trainer.PublishWeights -> broker.WaitCommitted
  (every engine serves the new version). The run is configured as the REST API's run spec makes it
  (`data.train` = the JSONL, `reward.regex`, `precision.dtype`), with `rollout.num_engines` equal
  to the torch threads: the engines' shares run at once, one thread each (core.engine_set).
- TRL: `GRPOTrainer` (trl, benchmark-only dependency) on the same CPU, one optimizer step per
  generation batch, `beta=0`, the same dtype (`bf16=True` for bfloat16).

Reported per phase (medians of the steps after a warm-up step): generate (rollout.Generate, the
reward included: it is computed while generation goes on), train (trainer.TrainStep) split into
the trainer's own `score_seconds` (log-prob passes outside the gradient pass),
`forward_backward_seconds` and `optimizer_seconds` where the trainer reports them, publish
(PublishWeights) and switch (WaitCommitted); tokens per second; the train step's achieved model
FLOP/s (matmul FLOPs of forward + backward, 3 x the forward's, over the train step's time) and the
FLOP/s of a large torch matmul in the run's dtype measured in this process on the same number of
threads, before and after the runs (the better of the two).

Ratios: `rl_step_vs_trl` = samples per second, ours / TRL's (higher is better);
`train_step_vs_matmul_roofline` = the train step's achieved model FLOP/s over the large matmul's.
Stack start-up and run configuration are excluded from the step time; so is TRL's set-up. When
TRL is not installed `rl_step_vs_trl` is null and `notes` says so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import model_dirs
import torch

from furlong import rpc
from furlong.controller.core.step_record import sampling_seed
from furlong.controller.local_stack import StackConfig, start_stack, stop_stack
from furlong.core.settings import (
    AlgorithmSettings,
    DataSettings,
    PrecisionSettings,
    RewardSettings,
    RolloutSettings,
    SamplingSettings,
)
from furlong.core.settings.reward import RegexReward
from furlong.rollout.client import GrpcRolloutClient, RolloutDeadlines
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.trainer.api import TrainerRunConfig, TrainStepRequest
from furlong.trainer.client import GrpcTrainerClient, TrainerDeadlines
from furlong.transfer.broker_client import GrpcBrokerClient

LR = 1e-5
VOCAB = 16384
PATTERN = r"^\s*[a-m]"
STACK_SERVICES = ("redis", "weight_broker", "trainer", "rollout", "controller")
WAIT_S = 900.0
RUN = "bench"


def regex_reward(text: str) -> float:
    return 1.0 if re.search(PATTERN, text) else 0.0


def write_job(tmp: Path, hidden: int, layers: int, num_prompts: int) -> tuple[Path, Path, Any, list[str]]:
    """The model directory, the prompts' JSONL, the transformers model and the prompts."""
    text = model_dirs.corpus(200_000, 30_000)
    tokenizer = model_dirs.bpe_tokenizer(VOCAB, text)
    config = model_dirs.qwen3_config(VOCAB, hidden, layers, max_positions=256)
    config.intermediate_size = 3 * hidden
    model_dir = model_dirs.write_model_dir(tmp / "model", config, tokenizer, max_shard_size="40MB")
    prompts = [" ".join(line.split()[:12]) for line in text[1000 : 1000 + num_prompts]]
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    return model_dir, data, model, prompts


def forward_flops(model: Any, tokens: int, sequences: list[int]) -> float:
    """Matmul FLOPs of one forward pass over sequences of the given lengths (tokens in all): 2 per
    weight of every linear layer (the LM head included) per token, plus attention's QK^T and AV
    (2 x 2 x layers x heads x head_dim per query-key pair, causal: n(n+1)/2 pairs per sequence)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    pairs = sum(n * (n + 1) // 2 for n in sequences)
    return 2.0 * linear * tokens + 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs


def matmul_flops_per_s(threads: int, dtype: torch.dtype, size: int = 2048, repeats: int = 8) -> float:
    """The best FLOP/s of a size x size matmul on `threads` torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(previous)
    return 2.0 * size**3 / best


def run_ours(
    model_dir: Path,
    data: Path,
    tmp: Path,
    prompts_per_step: int,
    samples: int,
    max_new: int,
    steps: int,
    torch_threads: int,
    dtype: str,
) -> dict:
    """Start the stack, run `steps` synchronous steps through it over gRPC, stop it."""
    started = time.perf_counter()
    stack = start_stack(
        StackConfig(state_dir=tmp / "stack", services=STACK_SERVICES, torch_threads=torch_threads)
    )
    out: dict = {"startup_s": time.perf_counter() - started, "steps": []}
    clients: list[Any] = []
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
        precision = PrecisionSettings(dtype=dtype)
        configured = time.perf_counter()
        rollout.configure_run(
            RolloutRunConfig(
                run_id=RUN,
                model_dir=str(model_dir),
                seed=0,
                precision=precision,
                data=DataSettings(train=str(data), shuffle=False),
                reward_config=RewardSettings(regex=RegexReward(weight=1.0, pattern=PATTERN)),
                rollout=RolloutSettings(num_engines=torch_threads),
            )
        )
        version = trainer.configure_run(
            TrainerRunConfig(
                run_id=RUN,
                model_dir=str(model_dir),
                algorithm=AlgorithmSettings(name="grpo", learning_rate=LR),
                sampling_temperature=sampling.temperature,
                seed=0,
                total_steps=steps,
                precision=precision,
            )
        ).policy_version
        out["configure_s"] = time.perf_counter() - configured
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            gen = rollout.generate(
                GenerateRequest(
                    run_id=RUN,
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
                TrainStepRequest(run_id=RUN, step=step, num_groups=prompts_per_step, timeout_s=WAIT_S)
            )
            t2 = time.perf_counter()
            trainer.publish_weights(RUN, train.policy_version)
            t3 = time.perf_counter()
            status = broker.wait_committed(RUN, train.policy_version, WAIT_S)
            t4 = time.perf_counter()
            if status.committed_version != train.policy_version:
                raise RuntimeError(f"step {step}: version {train.policy_version} not committed: {status}")
            version = train.policy_version
            m = train.metrics
            out["steps"].append(
                {
                    "step_s": t4 - t0,
                    "generate_s": t1 - t0,
                    "train_s": t2 - t1,
                    "publish_s": t3 - t2,
                    "switch_s": t4 - t3,
                    "score_s": m.get("score_seconds"),
                    "forward_backward_s": m.get("forward_backward_seconds"),
                    "optimizer_s": m.get("optimizer_seconds"),
                    "trainer_step_s": m.get("train_seconds", m.get("step_seconds")),
                    "padding_fraction": m.get("padding_fraction"),
                    "completion_tokens": gen.num_tokens / gen.num_samples,
                    "generated_tokens": gen.num_tokens,
                    "reward_mean": gen.reward_mean,
                    "trained_samples": m.get("num_trained_samples"),
                }
            )
        for client in (rollout, trainer, broker):
            client.end_run(RUN)
    finally:
        for client in clients:
            client.close()
        stop_stack(Path(stack.state_dir))
    return out


def run_trl(
    model: Any,
    model_dir: Path,
    prompts: list[str],
    tmp: Path,
    prompts_per_step: int,
    samples: int,
    max_new: int,
    steps: int,
    dtype: str,
) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def reward(prompts, completions, **_):
        return [regex_reward(c) for c in completions]

    times: list[float] = []
    lengths: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))
                rewards.append(float(logs.get("reward", "nan")))

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
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
        bf16=dtype == "bfloat16",
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
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    setup_s = time.perf_counter() - started
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs: keep stdout for the result
        trainer.train()
    return {"times": times, "lengths": lengths, "rewards": rewards, "setup_s": setup_s}


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


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
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--steps", type=int, default=None, help="steps per side, the first a warm-up")
    p.add_argument("--skip-trl", action="store_true", help="measure our side only")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, seen by TRL
    hidden, layers, prompts_per_step, max_new, steps = (
        (128, 2, 4, 32, 3) if args.quick else (512, 6, 16, 64, 6)
    )
    steps = args.steps or steps
    samples = 8
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir, data, model, prompts = write_job(tmp, hidden, layers, prompts_per_step * steps)
        # the machine's matmul rate, before and after the runs (the better one is the roofline)
        matmuls = [matmul_flops_per_s(args.torch_threads, getattr(torch, args.dtype))]
        num_params = sum(t.numel() for t in model.parameters())
        ours = run_ours(
            model_dir, data, tmp, prompts_per_step, samples, max_new, steps, args.torch_threads, args.dtype
        )
        try:
            import trl

            trl_version = None if args.skip_trl else trl.__version__
        except ImportError:
            trl_version = None
        trl_out: dict = {"times": [], "lengths": [], "rewards": [], "setup_s": None}
        torch.set_num_threads(args.torch_threads)  # the same threads as each of our processes
        if trl_version:
            trl_out = run_trl(
                copy.deepcopy(model),
                model_dir,
                prompts,
                tmp,
                prompts_per_step,
                samples,
                max_new,
                steps,
                args.dtype,
            )
        matmuls.append(matmul_flops_per_s(args.torch_threads, getattr(torch, args.dtype)))
        matmul = max(matmuls)
        # Model FLOPs of one step's train pass: every sample is prompt + completion; the prompt
        # lengths are the tokenizer's, the completion lengths the measured means.
        tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(model_dir))
        prompt_lens = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    batch = prompts_per_step * samples
    measured = ours["steps"][1:]
    ours_step = _median([s["step_s"] for s in measured])
    ours_sps = batch / ours_step
    trl_step = _median(trl_out["times"][1:])
    trl_sps = batch / trl_step if trl_step else None
    completion = statistics.mean(s["completion_tokens"] for s in measured)
    per_step_prompts = statistics.mean(prompt_lens) if prompt_lens else 0.0
    seq = [int(round(per_step_prompts + completion))] * batch
    train_flops = 3.0 * forward_flops(model, sum(seq), seq)
    train_s = _median([s["trainer_step_s"] or s["train_s"] for s in measured])
    achieved = train_flops / train_s
    notes = (
        "ours: Redis, weight broker, trainer, rollout and controller as processes (local_stack), steps "
        f"driven over authenticated gRPC (Generate, TrainStep, PublishWeights, WaitCommitted), "
        f"{args.torch_threads} torch thread(s) per trainer/rollout process (rollout.num_engines "
        f"{args.torch_threads}, one thread each) and for TRL; TRL: GRPOTrainer "
        f"in one process, same weights, prompts, reward and sampling, dtype {args.dtype} on both sides; "
        "medians after one warm-up step; start-up excluded; model FLOPs from the mean measured lengths"
    )
    if trl_version is None:
        notes = "TRL NOT MEASURED (not installed, or --skip-trl): rl_step_vs_trl is null. " + notes
    result = {
        "bench": "rl_step",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "model": "qwen3",
            "hidden": hidden,
            "layers": layers,
            "vocab_size": VOCAB,
            "num_parameters": num_params,
            "prompts": prompts_per_step,
            "samples_per_prompt": samples,
            "max_new_tokens": max_new,
            "steps": steps,
            "torch_threads": args.torch_threads,
            "dtype": args.dtype,
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
            "ours_score_s": _median([s["score_s"] for s in measured]),
            "ours_forward_backward_s": _median([s["forward_backward_s"] for s in measured]),
            "ours_optimizer_s": _median([s["optimizer_s"] for s in measured]),
            "ours_publish_s": _median([s["publish_s"] for s in measured]),
            "ours_switch_s": _median([s["switch_s"] for s in measured]),
            "ours_padding_fraction": _median([s["padding_fraction"] for s in measured]),
            "ours_generated_tokens_per_s": _median(
                [s["generated_tokens"] / s["generate_s"] for s in measured]
            ),
            "ours_trained_tokens_per_s": sum(seq) / train_s,
            "train_step_model_flops": train_flops,
            "train_step_achieved_flops_per_s": achieved,
            "matmul_flops_per_s": matmul,
            "ours_warmup_step_s": ours["steps"][0]["step_s"],
            "trl_warmup_step_s": trl_out["times"][0] if trl_out["times"] else None,
            "ours_stack_startup_s": ours["startup_s"],
            "ours_configure_s": ours["configure_s"],
            "trl_setup_s": trl_out["setup_s"],
            "ours_mean_completion_tokens": completion,
            "trl_mean_completion_tokens": statistics.mean(trl_out["lengths"]) if trl_out["lengths"] else None,
            "ours_reward_mean": statistics.mean(s["reward_mean"] for s in ours["steps"]),
            "trl_reward_mean": statistics.mean(trl_out["rewards"]) if trl_out["rewards"] else None,
        },
        "ratios": {
            "rl_step_vs_trl": ours_sps / trl_sps if trl_sps else None,
            "train_step_vs_matmul_roofline": achieved / matmul,
        },
        "notes": notes,
    }
    if not args.json:
        for key, value in {**result["metrics"], **result["ratios"]}.items():
            print(f"{key:>32}: {value}")
        if trl_version is None:
            print("TRL was not measured: only our side", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
