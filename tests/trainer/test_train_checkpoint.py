"""Resume is bit-identical; offload/restore keeps every tensor bit for bit."""

import hashlib
import json

import pytest
import torch
from test_learner import batch, tiny_model
from tiny_policy import learner_config

from furlong.trainer.core.learner import Learner
from furlong.trainer.offload import Offloader, learner_offloader
from furlong.trainer.train_checkpoint import load_training_checkpoint, save_training_checkpoint

pytestmark = pytest.mark.unit

CONFIG = dict(learning_rate=1e-2, epochs_per_batch=2, kl_coef=0.05, entropy_coef=0.01)


def run(learner, steps):
    return [learner.train_step(batch(learner.model, learner.version)).loss for _ in range(steps)]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_gives_the_same_next_step_bit_for_bit(tmp_path, algorithm):
    k = 2
    straight = Learner(tiny_model(), learner_config(algorithm=algorithm, **CONFIG))
    losses = run(straight, k + 1)
    first = Learner(tiny_model(), learner_config(algorithm=algorithm, **CONFIG))
    assert run(first, k) == losses[:k]
    torch.manual_seed(1234)  # the generator state is part of the checkpoint
    save_training_checkpoint(first, tmp_path / "ckpt", step=k, data_cursor={"last_entry": "5-0"})
    del first
    torch.manual_seed(999)
    resumed = Learner(tiny_model(seed=7), learner_config(algorithm=algorithm, **CONFIG))  # other weights
    info = load_training_checkpoint(resumed, tmp_path / "ckpt")
    assert (info.step, info.version, info.data_cursor) == (k, k, {"last_entry": "5-0"})
    assert torch.get_rng_state().equal(_rng_after_seed(1234))
    assert run(resumed, 1)[0] == losses[k]  # exact float equality
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


def _rng_after_seed(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.get_rng_state()


def test_corrupt_or_mismatched_checkpoints_are_refused(tmp_path):
    learner = Learner(tiny_model(), learner_config(learning_rate=1e-2))
    run(learner, 1)
    info = save_training_checkpoint(learner, tmp_path / "c", step=1)
    other = Learner(tiny_model(), learner_config(learning_rate=2e-2))
    with pytest.raises(ValueError, match="learning_rate"):
        load_training_checkpoint(other, info.path)
    blob = bytearray((info.path / "optimizer.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (info.path / "optimizer.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="optimizer.safetensors: SHA-256"):
        load_training_checkpoint(Learner(tiny_model(), learner_config(learning_rate=1e-2)), info.path)
    with pytest.raises(ValueError, match="manifest.json"):
        load_training_checkpoint(learner, tmp_path / "nothing")
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["step"] == 1 and "policy.safetensors" in manifest["sha256"]
    # A second save replaces the first atomically and leaves no temporary directory behind.
    save_training_checkpoint(learner, tmp_path / "c", step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def _digests(learner) -> dict[str, str]:
    out = {}
    for prefix, module in (
        ("policy", learner.model),
        ("reference", learner.reference),
        ("critic", learner.critic),
    ):
        if module is None:
            continue
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            out[f"{prefix}.{name}"] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
    for i, state in enumerate(learner.optimizer.state.values()):
        for name, t in state.items():
            out[f"optim.{i}.{name}"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return out


def test_offload_restore_twice_keeps_every_tensor():
    model = tiny_model()
    model.model.norm.weight.requires_grad_(False)  # a frozen parameter without optimizer state
    learner = Learner(model, learner_config(algorithm="ppo", **CONFIG))
    run(learner, 1)
    before = _digests(learner)
    assert any(k.startswith("reference.") for k in before) and any("rotary_emb" in k for k in before)
    offloader = learner_offloader(learner)
    for _ in range(2):
        released = offloader.offload()
        assert released > 0 and model.model.norm.weight.numel() == 0
        assert all(t.numel() == 0 for s in learner.optimizer.state.values() for t in s.values())
        offloader.restore()
        assert _digests(learner) == before
    stats = learner.train_step(batch(model, learner.version))  # still trains after restore
    assert learner.version == 2 and stats.grad_norm > 0 and _digests(learner) != before


def test_tensors_with_a_master_are_rebuilt_from_it_and_others_backed_up():
    layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    layer.bias.requires_grad_(False)  # frozen: no master, must be backed up
    master = layer.weight.detach().float().clone()  # an fp32 master of the bf16 weight
    bias = layer.bias.detach().clone()
    offloader = Offloader([layer], masters={layer.weight: master})
    offloader.offload()
    assert offloader._slots[0].backup is None and offloader._slots[1].backup is not None
    master.add_(1.0)  # the optimizer moved the master while offloaded
    offloader.restore()
    assert torch.equal(layer.weight, master.to(torch.bfloat16)) and torch.equal(layer.bias, bias)
    with pytest.raises(RuntimeError):
        offloader.restore()
