"""A tiny, untrained Llama policy on the addition alphabet, written as a Hugging Face directory:
the smallest model every service accepts, for tests that need a checkpoint but not a good policy."""

from __future__ import annotations

from pathlib import Path


def write_tiny_checkpoint(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from furlong.core.checkpoint import save_policy
    from furlong.core.tasks import AdditionTask
    from furlong.core.tokenizer import char_tokenizer

    tokenizer = char_tokenizer(AdditionTask.ALPHABET)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    save_policy(LlamaForCausalLM(config), tokenizer, directory)
    return directory


def learner_config(*, temperature: float = 1.0, seed: int = 0, algorithm: str = "grpo", **settings):
    """A LearnerConfig with AlgorithmSettings(name=algorithm, **settings)."""
    from furlong.core.settings import AlgorithmSettings
    from furlong.trainer.core.learner import LearnerConfig

    return LearnerConfig(
        algorithm=AlgorithmSettings(name=algorithm, **settings), temperature=temperature, seed=seed
    )


def trainer_run(
    run_id: str,
    model_dir,
    total_steps: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    every_steps: int = 1,
    keep_last: int = 2,
    **algorithm,
):
    """A trainer ConfigureRun request with AlgorithmSettings(**algorithm)."""
    from furlong.core.settings import AlgorithmSettings, CheckpointSettings
    from furlong.trainer.api import TrainerRunConfig

    return TrainerRunConfig(
        run_id=run_id,
        model_dir=str(model_dir),
        algorithm=AlgorithmSettings(**algorithm),
        sampling_temperature=temperature,
        seed=seed,
        total_steps=total_steps,
        checkpoint=CheckpointSettings(every_steps=every_steps, keep_last=keep_last),
    )


def rollout_run(
    run_id: str,
    model_dir,
    *,
    num_engines: int = 1,
    seed: int = 0,
    reward: str = "addition_exact_match",
    task: str = "",
    **rollout,
):
    """A rollout ConfigureRun request with RolloutSettings(num_engines=..., **rollout)."""
    from furlong.core.settings import RolloutSettings
    from furlong.rollout.core.types import RolloutRunConfig

    return RolloutRunConfig(
        run_id=run_id,
        model_dir=str(model_dir),
        seed=seed,
        task=task,
        reward=reward,
        rollout=RolloutSettings(num_engines=num_engines, **rollout),
    )


def addition_prompts(step: int, count: int, seed: int = 0):
    """The addition task's prompts of a step, as rollout Prompts."""
    from furlong.core.tasks import get_task
    from furlong.rollout.core.types import Prompt

    return tuple(
        Prompt(p.prompt_id, p.text, p.answer) for p in get_task("addition").prompts(seed, step, count)
    )


def train(run_id: str, step: int, num_groups: int, timeout_s: float = 30.0):
    from furlong.trainer.api import TrainStepRequest

    return TrainStepRequest(run_id=run_id, step=step, num_groups=num_groups, timeout_s=timeout_s)
