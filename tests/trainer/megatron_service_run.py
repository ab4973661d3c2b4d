"""Run as a script (one process per trainer rank: megatron-core's parallel state is process-wide):
a trainer service trains a tiny model for a few steps on fixed sample groups written to Redis, with
the backend and tensor-parallel size given, and rank 0 prints one JSON line (per-step losses and
gradient norms) and writes the policy it published after the last step to OUT/published.safetensors.
Every step is checkpointed under OUT/checkpoints (the newest two are kept).

    megatron_service_run.py BACKEND FAMILY TP[xPP] RANK PORT MODEL_DIR OUT [--resume-check]
        [--resume-from CHECKPOINT [--refuse-tampered]]

TP[xPP[xDP[xCP]]]: the tensor-parallel size, the pipeline-parallel one after an x, the replicas of
that layout after another, and the context-parallel size after a third (`2x2`: four ranks;
`2x1x2`: two replicas of two tensor-parallel ranks; `1x1x1x2`: two context-parallel ranks).

`--resume-from`: the run starts from a copy of that training checkpoint (`step-N`) and trains the
steps after N; with `--refuse-tampered` it first tries two altered copies (a policy tensor and an
optimizer state tensor of the wrong shape, the manifest's hashes updated) and records the errors.

Rank 0 serves the run; the other ranks follow it (`RankFollower`), as under torchrun.
"""

import contextlib
import hashlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import redis
import torch
from safetensors.torch import load_file, save_file

from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.core.settings import AlgorithmSettings, CheckpointSettings, MegatronSettings, ParallelSettings
from furlong.trainer.api import TrainerRunConfig, TrainStepRequest
from furlong.trainer.rank_follower import RankFollower
from furlong.trainer.ranks import join
from furlong.trainer.service import TrainerService
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.round_tensors import WholeState
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

warnings.filterwarnings("ignore")
ALPHABETS = {16: "0123456789+=-", 15: "0123456789+="}  # 3 special tokens each
STEPS = 3
RUN = "mg"


def write_model(directory: Path, family: str, vocab: int, tied: bool = False) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from furlong.core.checkpoint import save_policy
    from furlong.core.tokenizer import char_tokenizer

    tokenizer = char_tokenizer(ALPHABETS[vocab])
    assert tokenizer.vocab_size == vocab
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    save_policy(AutoModelForCausalLM.from_config(config), tokenizer, directory)


def groups(step: int, vocab: int) -> list[SampleGroup]:
    """Two groups of four samples, the same for every backend: random tokens, distinct rewards, and
    a sampling support of three ids (the target among them) on every other response token."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for g in range(2):
        prompt = torch.randint(0, vocab, (3,), generator=gen).tolist()
        samples = []
        for i in range(4):
            response = torch.randint(0, vocab, (4,), generator=gen).tolist()
            support = [
                sorted({t, (t + 5) % vocab, (t + 11) % vocab}) if j % 2 else list(range(vocab))
                for j, t in enumerate(response)
            ]
            samples.append(
                Sample(
                    sample_id=f"s{step}-{g}-{i}",
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=[-1.5] * 4,
                    sampling_support=RolloutSamplingMask.from_lists(support, vocab_size=vocab),
                    reward=float(i) - 1.5 * g,
                    policy_version=step - 1,
                    finish_reason="length",
                )
            )
        out.append(SampleGroup(run_id=RUN, step=step, prompt_id=f"p{step}-{g}", samples=samples))
    return out


def run_config(
    model_dir: Path, backend: str, tp: int, pp: int = 1, dp: int = 1, cp: int = 1
) -> TrainerRunConfig:
    return TrainerRunConfig(
        run_id=RUN,
        model_dir=str(model_dir),
        algorithm=AlgorithmSettings(learning_rate=1e-2, kl_coef=0.05, micro_batch_size=4),
        sampling_temperature=0.8,
        seed=3,
        total_steps=STEPS + 1,
        checkpoint=CheckpointSettings(every_steps=1),
        parallel=ParallelSettings(strategy="ddp" if dp > 1 else "none", world_size=tp * pp * dp * cp),
        backend=backend,
        megatron=MegatronSettings(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp)
        if backend == "megatron"
        else MegatronSettings(),
    )


class RecordingPublisher(WeightPublisher):
    """The real publisher, keeping what it read from the state it was asked to publish last (a
    whole state dict, or the rounds gathered one at a time from tensor-parallel ranks)."""

    last: dict[str, torch.Tensor] = {}
    round_by_round = False  # whether the last publish came from gathered rounds

    def publish(self, version, state):  # type: ignore[no-untyped-def]
        RecordingPublisher.round_by_round = not isinstance(state, Mapping)
        source = WholeState(state) if isinstance(state, Mapping) else state
        read: dict[str, torch.Tensor] = {}

        class Recording:
            @contextlib.contextmanager
            def round(self, names):  # type: ignore[no-untyped-def]
                with source.round(names) as tensors:
                    for name in names:
                        read.setdefault(name, tensors[name].detach().clone())
                    yield tensors

        result = super().publish(version, Recording())
        RecordingPublisher.last = read
        return result


def _rewrite(directory: Path, file: str, key: str) -> None:
    """Replace tensor `key` of `directory/file` by one row short of it and update the manifest's
    hash of the file: a consistent checkpoint of another shape, refused by the shape checks."""
    tensors = load_file(directory / file)
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, directory / file)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["sha256"][file] = hashlib.sha256((directory / file).read_bytes()).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _refusals(trainer: TrainerService, config: TrainerRunConfig, source: Path, target: Path) -> list[str]:
    """The errors of configuring the run from two altered copies of `source` at `target`."""
    fc1 = "gpt.decoder.layers.0.mlp.linear_fc1.weight"
    optimizer = load_file(source / "optimizer.safetensors")
    exp_avg = next(k for k in sorted(optimizer, key=lambda k: int(k.split(".")[0])) if k.endswith("exp_avg"))
    errors = []
    for file, key in (("policy.safetensors", fc1), ("optimizer.safetensors", exp_avg)):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        _rewrite(target, file, key)
        try:
            trainer.configure_run(config)
        except Exception as exc:  # noqa: BLE001 - the test asserts on the message
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("configured")
            trainer.end_run(RUN)
    shutil.rmtree(target)
    return errors


def main() -> None:
    backend, family, layout, rank, port, model_dir, out = sys.argv[1:8]
    tp_size, pp_size, dp_size, cp_size = ([int(n) for n in layout.split("x")] + [1, 1, 1])[:4]
    world, model, out_dir = tp_size * pp_size * dp_size * cp_size, Path(model_dir), Path(out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    resume_check = "--resume-check" in sys.argv
    resume_from = Path(sys.argv[sys.argv.index("--resume-from") + 1]) if "--resume-from" in sys.argv else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=str(world))
    ranks = join("gloo", timeout_s=300.0) if world > 1 else None
    if ranks is not None and not ranks.is_leader:
        sys.exit(RankFollower(ranks, torch.device("cpu")).serve())
    client = redis.Redis.from_url(os.environ["FURLONG_TEST_REDIS_URL"])
    for pattern in (f"furlong:run:{RUN}:*", f"furlong:ledger:{RUN}:*"):  # an earlier run's stream and ledger
        for key in client.scan_iter(pattern):
            client.delete(key)
    broker = InProcessBrokerClient(BrokerCore())
    checkpoints = out_dir / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # an earlier run's: this one starts at step 1
    trainer = TrainerService(
        client,
        broker,
        consumer_name="trainer-0",
        publisher_factory=RecordingPublisher,
        checkpoint_root=checkpoints,
        check_weight_update_equal=True,
        ranks=ranks,
    )
    result: dict[str, object] = {
        "backend": backend,
        "family": family,
        "tensor_parallel": tp_size,
        "pipeline_parallel": pp_size,
        "replicas": dp_size,
        "context_parallel": cp_size,
    }
    try:
        config = run_config(model, backend, tp_size, pp_size, dp_size, cp_size)
        if resume_from is not None:
            target = checkpoints / RUN / resume_from.name
            if "--refuse-tampered" in sys.argv:
                result["refused"] = _refusals(trainer, config, resume_from, target)
            shutil.copytree(resume_from, target)
        trainer.configure_run(config)
        first = trainer._run(RUN).last_step + 1
        losses, norms = [], []
        for step in range(first, STEPS + 1):
            for group in groups(step, vocab):
                client.xadd(stream_key(RUN), {STREAM_FIELD: group.encode()})
            stats = trainer.train_step(TrainStepRequest(run_id=RUN, step=step, num_groups=2, timeout_s=60))
            losses.append(stats.loss)
            norms.append(stats.metrics["grad_norm"])
            trainer.publish_weights(RUN, stats.policy_version)
        published = RecordingPublisher.last
        save_file(published, out_dir / "published.safetensors")
        result.update(losses=losses, grad_norms=norms, names=sorted(published), first_step=first)
        result["published_round_by_round"] = RecordingPublisher.round_by_round
        if world > 1:  # what the rounds gave the publisher is the whole gather, bit for bit
            whole = trainer._run(RUN).state.full()
            result["published_equals_whole_gather"] = list(whole) == list(published) and all(
                torch.equal(whole[k], published[k]) for k in whole
            )
        learner = trainer._run(RUN).learner
        mg = getattr(learner.model, "gpt", None)
        if mg is not None and world == 1:
            from furlong.trainer.megatron.weights import hf_to_megatron

            trained = {k: v for k, v in mg.state_dict().items() if not k.endswith("_extra_state")}
            back = hf_to_megatron(published, learner.model.config)
            result["published_equals_trained"] = set(back) == set(trained) and all(
                torch.equal(back[k], trained[k]) for k in trained
            )
        if resume_check:
            trainer.end_run(RUN)
            trainer.configure_run(run_config(model, backend, tp_size, pp_size, dp_size, cp_size))
            resumed = trainer._run(RUN).learner.state_dict()
            result["resumed_equals_published"] = set(resumed) == set(published) and all(
                torch.equal(resumed[k], published[k]) for k in published
            )
            result["resumed_step"] = trainer._run(RUN).last_step
    finally:
        trainer.close()
        if ranks is not None:
            ranks.shutdown()
        broker.close()
    print(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1] == "write-model":
        write_model(Path(sys.argv[3]), sys.argv[2], int(sys.argv[4]), tied="--tied" in sys.argv)
    else:
        main()
