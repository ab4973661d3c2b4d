"""A run with `trainer.backend: megatron` through the trainer service (real Redis, the in-process
broker, real NIXL publishing): per-step losses equal the torch backend's, the weights it publishes
under the Hugging Face names equal the trained ones, a one-rank checkpoint resumes bit for bit,
tensor parallelism over two ranks (gloo) trains what one rank does, and a training checkpoint
written at tensor_parallel 2 resumes at 2 (bit for bit) and at 1, one written at 1 resumes at 2;
two pipeline stages (alone, with a tied embedding, and with two tensor-parallel ranks each) train
what one rank does, and their checkpoints resume in any layout; so do two replicas of a layout
(strategy ddp), whose first replica writes the checkpoint, and two context-parallel ranks (alone
and with two tensor-parallel shards each), whose checkpoint resumes at one rank.

Each run is its own process (`megatron_service_run.py`): megatron-core needs a torch.distributed
group and process-wide parallel state. Measured on this machine over 3 AdamW steps at lr 1e-2:
megatron vs torch losses agree to <= 2e-7 and the published tensors to 2.9e-5 (Adam's normalised
update magnifies the float32 rounding differences of the gradients); two ranks vs one: losses to
<= 1e-7, tensors below 1e-5. The tolerances leave a factor of 3-5. Step 3 after resuming the
checkpoint of step 2 at another tensor-parallel size: losses within 3e-8 of the uninterrupted run's,
published tensors within 1.2e-7."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from furlong.rpc.ports import free_port
from furlong.trainer.train_checkpoint import FORMAT

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/trainer/megatron_service_run.py"
LOSS_ABS = 1e-6
WEIGHT_ABS_BACKENDS = 1e-4  # megatron vs torch after 3 steps
WEIGHT_ABS_RANKS = 1e-5  # two tensor-parallel ranks vs one
# two context-parallel ranks (of two tensor-parallel shards each) vs one: attention over gathered
# keys and values sums in another order (measured 3.8e-6 alone, 1.15e-5 with tensor parallelism)
WEIGHT_ABS_CONTEXT = 5e-5


def _env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "FURLONG_TEST_REDIS_URL": redis_url}


def _run(redis_url, out: Path, model: Path, backend: str, layout: int | str = 1, *extra: str) -> dict:
    """The leader's result of a run over `layout` ranks: a tensor-parallel size, `TPxPP` or
    `TPxPPxDP` (DP replicas of the layout)."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    args = [backend, model.parent.name.split("-")[0], str(layout)]
    world = math.prod(int(n) for n in str(layout).split("x"))
    followers = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, str(rank), port, str(model), str(out)],
            cwd=ROOT,
            env=_env(redis_url),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(1, world)
    ]
    leader = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "0", port, str(model), str(out), *extra],
        cwd=ROOT,
        env=_env(redis_url),
        capture_output=True,
        text=True,
        timeout=300,
    )
    for follower in followers:
        _, err = follower.communicate(timeout=120)
        assert follower.returncode == 0, err[-3000:]
    assert leader.returncode == 0, leader.stderr[-3000:]
    result = json.loads(leader.stdout.strip().splitlines()[-1])
    result["published"] = load_file(out / "published.safetensors")
    return result


def _resume(redis_url, out: Path, model: Path, layout: int | str, checkpoint: Path) -> dict:
    """A megatron run over `layout` resumed from a copy of training checkpoint `checkpoint`."""
    return _run(redis_url, out, model, "megatron", layout, "--resume-from", str(checkpoint))


def _write_model(family: str, tmp_path_factory, vocab: int = 16, tied: bool = False) -> Path:
    directory = tmp_path_factory.mktemp(f"{family}-vocab{vocab}{'-tied' if tied else ''}") / "model"
    subprocess.run(
        [sys.executable, str(SCRIPT), "write-model", family, str(directory), str(vocab)]
        + (["--tied"] if tied else []),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return directory


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory) -> Path:
    return _write_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory) -> Path:
    """The tensor-parallel runs use one family (llama) to keep the suite short."""
    return _write_model("llama", tmp_path_factory)


def _max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_trains_like(run: dict, one: dict, weight_abs: float = WEIGHT_ABS_RANKS) -> None:
    """`run` (over several ranks) trained the steps the one-rank run `one` did: its losses, gradient
    norms and published tensors (within `weight_abs`)."""
    assert run["losses"] == pytest.approx(one["losses"], abs=LOSS_ABS)
    assert run["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert _max_weight_diff(run["published"], one["published"]) < weight_abs


def test_megatron_run_trains_and_publishes_what_the_torch_backend_does(model, tmp_path, redis_url):
    torch_run = _run(redis_url, tmp_path / "torch", model, "torch")
    megatron = _run(redis_url, tmp_path / "megatron", model, "megatron", 1, "--resume-check")
    assert len(megatron["losses"]) == 3
    assert megatron["losses"] == pytest.approx(torch_run["losses"], abs=LOSS_ABS)
    assert megatron["grad_norms"] == pytest.approx(torch_run["grad_norms"], rel=1e-5)
    # published under the Hugging Face names, the engines' layout, holding the trained weights
    assert megatron["names"] == torch_run["names"]
    assert megatron["published_equals_trained"]
    assert _max_weight_diff(megatron["published"], torch_run["published"]) < WEIGHT_ABS_BACKENDS
    # the one-rank training checkpoint of step 3 resumes the same policy at step 3
    assert megatron["resumed_equals_published"] and megatron["resumed_step"] == 3


@pytest.fixture(scope="module")
def straight_runs(llama_model, tmp_path_factory, redis_server_url) -> dict[int, tuple[dict, Path]]:
    """Uninterrupted megatron runs of the llama model at tensor_parallel 1 and 2 (their results and
    output directories, each checkpointed after every step)."""
    out = tmp_path_factory.mktemp("straight")
    return {
        tp: (_run(redis_server_url, out / f"tp{tp}", llama_model, "megatron", tp), out / f"tp{tp}")
        for tp in (1, 2)
    }


def test_tensor_parallel_two_ranks_train_what_one_rank_does(straight_runs):
    (one, _), (two, _) = straight_runs[1], straight_runs[2]
    assert two["tensor_parallel"] == 2
    # two ranks publish round by round what gathering the whole state gives, bit for bit
    assert (one["published_round_by_round"], two["published_round_by_round"]) == (False, True)
    assert two["published_equals_whole_gather"] is True
    assert two["losses"] == pytest.approx(one["losses"], abs=LOSS_ABS)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    # the gathered shards are whole Hugging Face tensors, equal to the one-rank run's
    assert two["names"] == one["names"]
    assert _max_weight_diff(two["published"], one["published"]) < WEIGHT_ABS_RANKS


def _step_2(out: Path) -> Path:
    return out / "checkpoints" / "mg" / "step-2"


def test_tensor_parallel_checkpoint_resumes_at_any_tensor_parallel_size(
    llama_model, straight_runs, tmp_path, redis_url
):
    model = llama_model
    (one, one_dir), (two, two_dir) = straight_runs[1], straight_runs[2]
    # the two-rank checkpoint is the whole-tensor format, gathered into the one-rank layout
    manifest = json.loads((_step_2(two_dir) / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and manifest["tensor_parallel"] == 2 and manifest["step"] == 2
    for name in ("policy.safetensors", "optimizer.safetensors"):
        whole, gathered = load_file(_step_2(one_dir) / name), load_file(_step_2(two_dir) / name)
        assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in gathered.items()}
        assert _max_weight_diff(whole, gathered) < WEIGHT_ABS_RANKS
    resume = ("--resume-from", str(_step_2(two_dir)))
    at_two = _run(redis_url, tmp_path / "tp2-at-tp2", model, "megatron", 2, *resume, "--refuse-tampered")
    at_one = _run(redis_url, tmp_path / "tp2-at-tp1", model, "megatron", 1, *resume)
    one_at_two = _resume(redis_url, tmp_path / "tp1-at-tp2", model, 2, _step_2(one_dir))
    _assert_resumes(one, two, at_two, at_one, one_at_two)


def _assert_resumes(one: dict, two: dict, at_two: dict, at_one: dict, one_at_two: dict) -> None:
    """Step 3 after resuming the step-2 checkpoint of the two-rank run `two` at two ranks (bit for
    bit), at one rank, and the one-rank run `one`'s at two ranks (what the uninterrupted runs
    train); the two-rank resume first refused two altered copies, naming file and tensor."""
    for resumed in (at_two, at_one, one_at_two):
        assert resumed["first_step"] == 3 and len(resumed["losses"]) == 1
    assert at_two["losses"] == two["losses"][2:] and at_two["grad_norms"] == two["grad_norms"][2:]
    assert all(torch.equal(at_two["published"][k], two["published"][k]) for k in two["published"])
    assert at_one["losses"] == pytest.approx(two["losses"][2:], abs=LOSS_ABS)
    assert _max_weight_diff(at_one["published"], two["published"]) < WEIGHT_ABS_RANKS
    assert one_at_two["losses"] == pytest.approx(one["losses"][2:], abs=LOSS_ABS)
    assert _max_weight_diff(one_at_two["published"], one["published"]) < WEIGHT_ABS_RANKS
    policy, optimizer = at_two["refused"]
    assert "policy.safetensors" in policy and "gpt.decoder.layers.0.mlp.linear_fc1.weight" in policy
    assert "(127, 32) in the checkpoint, (128, 32) in the model" in policy
    assert "optimizer.safetensors" in optimizer and "0.exp_avg (the state of gpt.embedding" in optimizer


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory) -> Path:
    """A llama model of 15 ids, which two tensor-parallel ranks hold padded to 16."""
    return _write_model("llama", tmp_path_factory, vocab=15)


def test_a_vocabulary_two_ranks_cannot_split_trains_like_one_torch_rank_and_resumes_at_one(
    odd_vocab_model, tmp_path, redis_url
):
    model = odd_vocab_model
    torch_run = _run(redis_url, tmp_path / "torch", model, "torch")
    two = _run(redis_url, tmp_path / "tp2", model, "megatron", 2)
    assert two["losses"] == pytest.approx(torch_run["losses"], abs=LOSS_ABS)
    assert two["grad_norms"] == pytest.approx(torch_run["grad_norms"], rel=1e-5)
    # the padding is never published: the real vocabulary, under the Hugging Face names and shapes
    assert two["names"] == torch_run["names"]
    assert two["published"]["model.embed_tokens.weight"].shape == (15, 32)
    assert two["published"]["lm_head.weight"].shape == (15, 32)
    assert _max_weight_diff(two["published"], torch_run["published"]) < WEIGHT_ABS_BACKENDS
    # nor checkpointed: the two-rank checkpoint holds the real vocabulary and resumes at one rank
    policy = load_file(_step_2(tmp_path / "tp2") / "policy.safetensors")
    assert policy["gpt.embedding.word_embeddings.weight"].shape == (15, 32)
    at_one = _resume(redis_url, tmp_path / "tp2-at-tp1", model, 1, _step_2(tmp_path / "tp2"))
    assert at_one["first_step"] == 3
    assert at_one["losses"] == pytest.approx(torch_run["losses"][2:], abs=LOSS_ABS)
    assert _max_weight_diff(at_one["published"], torch_run["published"]) < WEIGHT_ABS_BACKENDS


@pytest.fixture(scope="module")
def pipeline_run(llama_model, tmp_path_factory, redis_server_url) -> tuple[dict, Path]:
    """An uninterrupted megatron run of the llama model in two pipeline stages (one layer each)."""
    out = tmp_path_factory.mktemp("pipeline") / "pp2"
    return _run(redis_server_url, out, llama_model, "megatron", "1x2"), out


def test_two_pipeline_stages_train_what_one_rank_does(straight_runs, pipeline_run):
    (one, _), (two, _) = straight_runs[1], pipeline_run
    assert (two["tensor_parallel"], two["pipeline_parallel"]) == (1, 2)
    # each stage's tensors reach the publisher round by round, as the whole gather gives them
    assert two["published_round_by_round"] is True and two["published_equals_whole_gather"] is True
    assert two["losses"] == pytest.approx(one["losses"], abs=LOSS_ABS)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert two["names"] == one["names"]
    assert _max_weight_diff(two["published"], one["published"]) < WEIGHT_ABS_RANKS


def test_tensor_and_pipeline_parallel_together_train_what_one_rank_does(
    straight_runs, llama_model, tmp_path, redis_url
):
    one, _ = straight_runs[1]
    four = _run(redis_url, tmp_path / "tp2pp2", llama_model, "megatron", "2x2")
    assert (four["tensor_parallel"], four["pipeline_parallel"]) == (2, 2)
    assert four["published_equals_whole_gather"] is True
    assert four["losses"] == pytest.approx(one["losses"], abs=LOSS_ABS)
    assert four["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert _max_weight_diff(four["published"], one["published"]) < WEIGHT_ABS_RANKS
    # its checkpoint is the one-rank layout: the same names and shapes, numerically the same state
    for name in ("policy.safetensors", "reference.safetensors", "optimizer.safetensors"):
        whole = load_file(_step_2(straight_runs[1][1]) / name)
        gathered = load_file(_step_2(tmp_path / "tp2pp2") / name)
        assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in gathered.items()}
        assert _max_weight_diff(whole, gathered) < WEIGHT_ABS_RANKS


def test_a_tied_embedding_over_two_stages_trains_like_the_torch_backend(
    tmp_path_factory, tmp_path, redis_url
):
    model = _write_model("llama", tmp_path_factory, tied=True)
    torch_run = _run(redis_url, tmp_path / "torch", model, "torch")
    two = _run(redis_url, tmp_path / "pp2", model, "megatron", "1x2")
    # the first stage's embedding and the last stage's copy get the sum of both gradients
    assert two["losses"] == pytest.approx(torch_run["losses"], abs=LOSS_ABS)
    assert two["grad_norms"] == pytest.approx(torch_run["grad_norms"], rel=1e-5)
    assert two["names"] == torch_run["names"]
    assert torch.equal(two["published"]["lm_head.weight"], two["published"]["model.embed_tokens.weight"])
    assert _max_weight_diff(two["published"], torch_run["published"]) < WEIGHT_ABS_BACKENDS
    # the checkpoint stores the embedding once, and resumes at one rank
    policy = load_file(_step_2(tmp_path / "pp2") / "policy.safetensors")
    assert "gpt.output_layer.weight" not in policy
    at_one = _resume(redis_url, tmp_path / "pp2-at-1", model, 1, _step_2(tmp_path / "pp2"))
    assert at_one["losses"] == pytest.approx(torch_run["losses"][2:], abs=LOSS_ABS)
    assert _max_weight_diff(at_one["published"], torch_run["published"]) < WEIGHT_ABS_BACKENDS


def test_a_pipeline_checkpoint_resumes_at_any_layout(
    llama_model, straight_runs, pipeline_run, tmp_path, redis_url
):
    (one, one_dir), (two, two_dir) = straight_runs[1], pipeline_run
    manifest = json.loads((_step_2(two_dir) / "manifest.json").read_text())
    assert (manifest["tensor_parallel"], manifest["pipeline_parallel"], manifest["step"]) == (1, 2, 2)
    resume = ("--resume-from", str(_step_2(two_dir)))
    at_two = _run(
        redis_url, tmp_path / "pp2-at-pp2", llama_model, "megatron", "1x2", *resume, "--refuse-tampered"
    )
    at_one = _run(redis_url, tmp_path / "pp2-at-1", llama_model, "megatron", 1, *resume)
    one_at_two = _resume(redis_url, tmp_path / "1-at-pp2", llama_model, "1x2", _step_2(one_dir))
    # every stage checks the whole checkpoint before it keeps its layers
    _assert_resumes(one, two, at_two, at_one, one_at_two)


def test_replicas_of_the_layout_train_what_one_rank_does_and_checkpoint_once(
    straight_runs, llama_model, tmp_path, redis_url
):
    one, _ = straight_runs[1]
    # two replicas of one rank, then two replicas of two tensor-parallel ranks (strategy ddp)
    two = _run(redis_url, tmp_path / "dp2", llama_model, "megatron", "1x1x2")
    four = _run(redis_url, tmp_path / "tp2dp2", llama_model, "megatron", "2x1x2")
    for run in (two, four):
        assert run["replicas"] == 2
        _assert_trains_like(run, one)
    # the first replica writes the checkpoint (the one-rank layout), which resumes at one rank
    manifest = json.loads((_step_2(tmp_path / "tp2dp2") / "manifest.json").read_text())
    assert (manifest["tensor_parallel"], manifest["step"]) == (2, 2)
    at_one = _resume(redis_url, tmp_path / "at-1", llama_model, 1, _step_2(tmp_path / "tp2dp2"))
    assert at_one["first_step"] == 3
    assert at_one["losses"] == pytest.approx(one["losses"][2:], abs=LOSS_ABS)
    assert _max_weight_diff(at_one["published"], one["published"]) < WEIGHT_ABS_RANKS


def test_context_parallel_ranks_train_what_one_rank_does_and_resume_at_one(
    straight_runs, llama_model, tmp_path, redis_url
):
    one, one_dir = straight_runs[1]
    # every sequence split over two ranks, then over two ranks of two tensor-parallel shards each
    two = _run(redis_url, tmp_path / "cp2", llama_model, "megatron", "1x1x1x2")
    four = _run(redis_url, tmp_path / "tp2cp2", llama_model, "megatron", "2x1x1x2")
    for run in (two, four):
        assert run["context_parallel"] == 2
        _assert_trains_like(run, one, WEIGHT_ABS_CONTEXT)
    # the checkpoint (written by the first context-parallel rank) resumes at one rank, and back
    at_one = _resume(redis_url, tmp_path / "cp2-at-1", llama_model, 1, _step_2(tmp_path / "cp2"))
    one_at_two = _resume(redis_url, tmp_path / "1-at-cp2", llama_model, "1x1x1x2", _step_2(one_dir))
    for resumed in (at_one, one_at_two):
        assert resumed["first_step"] == 3
        assert resumed["losses"] == pytest.approx(one["losses"][2:], abs=LOSS_ABS)
        assert _max_weight_diff(resumed["published"], one["published"]) < WEIGHT_ABS_RANKS
