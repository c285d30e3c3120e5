"""A launch split into engine and trainer processes (issue 49: ``rollout.engine_processes``, ``rollout.max_staleness``).

In one process: the bridge (objects, bucketed weights), the engine's weight inbox (versions in order, waiting only
when it must), the staleness bound, the refusals, the importance weights' figures, and a real engine serving trees
to a scripted trainer while new weights arrive mid-sampling: every tree must come from exactly the version it is
recorded with. Launched (slow): S = 0 equals the one-process run step for step and in its weights; S = 1 trains a
grounding + code mixture with staleness at most 1; an engine killed mid-run is named in one line and the run resumes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from vlm_grpo_ma.run import bridge as bridge_module
from vlm_grpo_ma.run.bridge import TREE, Bridge, PeerLost
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.split_launch import Placement, check_split, fresh_trees, in_flight_at_resume

ROOT = Path(__file__).resolve().parents[1]
LENGTH_TASK = ROOT / "tests" / "fixtures" / "answer_length_task.py"  # rewards an untrained model's answers unequally


def _bridges(size: int = 2) -> list[Bridge]:
    """``size`` bridges in this process (one per rank; each side driven by its own thread)."""
    import torch.distributed as dist

    store = dist.HashStore()
    made = [None] * size

    def open_rank(rank):
        made[rank] = Bridge.open(store, rank, size)

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in range(size)]
    [thread.start() for thread in threads]
    [thread.join(30) for thread in threads]
    return made


def _in_thread(work):
    """Run ``work()`` in a thread; returns a function that joins it (20 s at most) and gives its result."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result():
        thread.join(20)
        assert not thread.is_alive(), "the other side is still waiting (a deadlock)"
        if "error" in box:
            raise box["error"]
        return box.get("result")

    return result


# ------------------------------------------------------------------------------------------------------ the bridge


def test_the_bridge_carries_objects_and_weights_in_buckets_exactly(monkeypatch):
    """Planted and seen to fail: each bucket's offset not advanced (every tensor read from the bucket's start; it
    passed until two tensors shared a bucket, as a and c do now)."""
    monkeypatch.setattr(bridge_module, "BUCKET_BYTES", 64)  # 16 float32s: several buckets, one tensor over the size
    trainer, engine = _bridges()
    generator = torch.Generator().manual_seed(0)
    # a and c share a bucket; b is larger than one; d follows it
    weights = {name: torch.randn(shape, generator=generator) for name, shape in (("a", (3, 4)), ("c", (2,)), ("b", (40,)), ("d", (3,)))}
    trainer.send_object({"step": 3, "text": "é" * 1000}, 1, TREE)
    sent = trainer.send_weights(iter(weights.items()), [1], {"version": 7})
    assert sent == sum(t.numel() * 4 for t in weights.values())
    assert engine.recv_object(0, TREE) == {"step": 3, "text": "é" * 1000}
    header = engine.recv_object(0, bridge_module.WEIGHTS_HEADER)
    assert header["version"] == 7 and header["names"] == ["a", "c", "b", "d"]
    received = {name: tensor.clone() for name, tensor in engine.recv_weights(0, header, torch.float32)}
    assert received.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(received[name], tensor), name
    trainer.flush()


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)


class _Policy:
    def __init__(self):
        self.model = _Model()


class _Engine:
    def __init__(self):
        self.pushed = 0

    def push_weights(self, policy):
        self.pushed += 1


def _send_version(trainer: Bridge, version: int) -> None:
    weights = {"layer.weight": torch.full((2, 3), float(version)), "layer.bias": torch.full((2,), float(version))}
    trainer.send_weights(iter(weights.items()), [1], {"version": version, "dtype": "float32"})
    trainer.announce(version)


def test_the_engine_takes_weights_in_order_and_waits_only_for_a_version_it_needs():
    """``take(at_least)``: loads what has arrived, waits while the newest is below the bound, not beyond it.
    Planted and seen to fail: the versions already sent ignored (version 1 kept where 2 had been sent)."""
    from vlm_grpo_ma.run.engine_process import WeightsInbox

    trainer, engine_side = _bridges()
    policy, engine = _Policy(), _Engine()
    inbox = WeightsInbox(engine_side, policy, engine)
    _send_version(trainer, 0)
    inbox.take(at_least=0)
    assert inbox.version == 0 and float(policy.model.layer.weight[0, 0]) == 0.0
    inbox.take(at_least=-1)  # nothing new has come: no wait
    assert inbox.version == 0
    _send_version(trainer, 1)
    _send_version(trainer, 2)
    inbox.take(at_least=1)  # both sent: both loaded, though one would do
    assert inbox.version == 2 and float(policy.model.layer.bias[1]) == 2.0 and engine.pushed == 3
    later = _in_thread(lambda: inbox.take(at_least=3))  # must wait for version 3
    time.sleep(0.3)
    _send_version(trainer, 3)
    assert later() > 0 and inbox.version == 3


def test_a_receive_from_a_process_that_has_gone_names_it():
    trainer, engine = _bridges()
    engine.describe = lambda rank: f"trainer process {rank} (launch rank {rank})"
    del trainer  # its connections close with it
    import gc

    gc.collect()
    with pytest.raises(PeerLost, match=r"trainer process 0 \(launch rank 0\) stopped mid-run \(.*Connection closed"):
        engine.recv_object(0, TREE)


# ----------------------------------------------------------------------------------------------- the schedule


def _tiny_rollout(policy, count: int):
    from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
    from vlm_grpo_ma.engines.rollout import generate_rollout
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task

    samples = get_task("grounding").load("train", None)[:count]
    prompts = [encode_prompt(policy, sample, "") for sample in samples]
    settings = SamplingSettings(max_thought_tokens=4, max_answer_tokens=3, generators=prompt_generators(5, 0, count))
    return generate_rollout(policy, samples, prompts, num_thoughts=2, num_answers=2, settings=settings)


def test_trees_older_than_the_bound_are_dropped_and_counted(tiny_policy):
    """Planted and seen to fail: the bound compared with < (trees exactly S old dropped)."""
    rollout = _tiny_rollout(tiny_policy, 3)
    kept, staleness, dropped = fresh_trees(rollout, [5, 4, 3], step=5, max_staleness=1)
    assert dropped == 1 and staleness == [0, 1] and [s.id for s in kept.samples] == [s.id for s in rollout.samples[:2]]
    assert kept.tree.thought_ids == rollout.tree.thought_ids[:4] and kept.completions == rollout.completions[:8]
    same, staleness, dropped = fresh_trees(rollout, [4, 4, 4], step=5, max_staleness=1)
    assert same is rollout and staleness == [1, 1, 1] and dropped == 0
    with pytest.raises(RuntimeError, match="every tree of step 5"):
        fresh_trees(rollout, [1, 1, 1], step=5, max_staleness=1)


def test_a_resume_counts_the_trees_the_engines_had_sampled_ahead(untrained_tiny_dir, tmp_path):
    from conftest import tiny_run_config

    cfg = tiny_run_config(untrained_tiny_dir, tmp_path, "rollout.max_staleness=2", steps=10)
    assert in_flight_at_resume(cfg, 4) == 2 * 2  # two steps of 2 prompts
    assert in_flight_at_resume(cfg, 9) == 2  # one step left
    assert in_flight_at_resume(tiny_run_config(untrained_tiny_dir, tmp_path, steps=10), 4) == 0  # S = 0 samples nothing ahead


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        (["rollout.engine_processes=1"], 1, r"rollout.engine_processes=1 leaves no trainer in a launch of 1 process\(es\).*accelerate launch"),
        (["rollout.engine_processes=2"], 2, r"leaves no trainer in a launch of 2"),
        (["rollout.engine_processes=1", "train.prompts_per_step=3"], 3, r"train.prompts_per_step=3 must be a multiple of the 2 trainer processes"),
        (["rollout.engine_processes=2", "train.prompts_per_step=3"], 3, r"multiple of the 2 engine processes"),
        (["rollout.engine_processes=1", "algorithm.dynamic_sampling=true"], 2, r"algorithm.dynamic_sampling"),
        (["rollout.engine_processes=1", "rollout.vllm_tensor_parallel_size=2"], 2, r"vllm_tensor_parallel_size"),
    ],
)
def test_a_split_the_run_cannot_make_is_refused_naming_the_values(untrained_tiny_dir, tmp_path, overrides, size, message):
    from conftest import tiny_run_config

    with pytest.raises(ConfigError, match=message):
        check_split(tiny_run_config(untrained_tiny_dir, tmp_path, *overrides), size)


def test_negative_split_settings_are_refused(untrained_tiny_dir, tmp_path):
    from conftest import tiny_run_config

    for key in ("rollout.engine_processes", "rollout.max_staleness"):
        with pytest.raises(ConfigError, match=rf"{key}=-1 must be >= 0"):
            tiny_run_config(untrained_tiny_dir, tmp_path, f"{key}=-1")


def test_the_placement_puts_the_engines_last():
    placement = Placement(rank=3, size=4, engines=1)
    assert placement.trainers == 3 and placement.is_engine and placement.engine_ranks == [3]
    assert placement.describe(3) == "engine process 0 (launch rank 3)" and placement.describe(1) == "trainer process 1 (launch rank 1)"
    assert not Placement(rank=2, size=4, engines=1).is_engine


def test_the_importance_weights_effective_sample_size_on_each_level():
    """(sum w)^2 / (n sum w^2) over the trained thought tokens and answer tokens apart, and the gap per staleness.
    Planted and seen to fail: the thought and answer masks swapped; the square of the sum taken without n."""
    from collections import Counter

    from vlm_grpo_ma.run.update import importance_stats, staleness_figures

    stats = Counter()
    importance = torch.tensor([[1.0, 3.0, 2.0, 2.0, 9.0]])
    trained = torch.tensor([[True, True, True, True, False]])
    thought = torch.tensor([[True, True, False, False, False]])
    importance_stats(stats, importance, trained, thought)
    stats.update({"gap_sum_1": 3.0, "gap_count_1": 4})
    figures = staleness_figures(stats)
    assert figures["rollout/importance_ess_thought"] == pytest.approx(16 / (2 * 10))
    assert figures["rollout/importance_ess_answer"] == pytest.approx(1.0)
    assert figures["rollout/logprob_gap_mean_staleness_1"] == pytest.approx(0.75)


def test_stale_trees_are_always_corrected(untrained_tiny_dir, tmp_path):
    """Truncated importance weights on every token when engines may sample ahead, whatever rollout_correction
    says; as configured otherwise. Planted and seen to fail: the staleness ignored."""
    from conftest import tiny_run_config

    from vlm_grpo_ma.run.update import corrected

    assert corrected(tiny_run_config(untrained_tiny_dir, tmp_path, "rollout.max_staleness=1"))
    assert not corrected(tiny_run_config(untrained_tiny_dir, tmp_path))
    assert corrected(tiny_run_config(untrained_tiny_dir, tmp_path, "algorithm.rollout_correction=tis"))


# ------------------------------------------------------------------------ an engine while weights arrive


def _rescored(policy, rollout, weights) -> torch.Tensor:
    """The largest |log-prob under ``weights`` - the log-prob the engine recorded| over the tree's sampled tokens."""
    from vlm_grpo_ma.model.logprobs import shared_prefix_logprobs
    from vlm_grpo_ma.run.loop import encode_sample

    policy.model.load_state_dict(weights)
    tree, M = rollout.tree, rollout.num_answers
    rows = range(len(tree.answer_ids))
    completions = [tree.thought_ids[a // M] + tree.answer_ids[a] for a in rows]
    prompts = [encode_sample(policy, sample) for sample in rollout.samples]
    with torch.no_grad():
        logprobs = shared_prefix_logprobs(policy, prompts, [a // (rollout.num_thoughts * M) for a in rows], completions,
                                          [len(tree.thought_ids[a // M]) for a in rows], temperature=1.0)  # fmt: skip
    gap = 0.0
    for a in rows:
        recorded = torch.tensor(tree.thought_logprobs[a // M] + tree.answer_logprobs[a])
        sampled = ~torch.tensor(tree.thought_forced[a // M] + [False] * len(tree.answer_ids[a]))
        gap = max(gap, float((logprobs[a, : len(completions[a])] - recorded).abs()[sampled].max()))
    return gap


def test_every_tree_comes_from_the_one_version_it_is_recorded_with(untrained_tiny_dir, tmp_path, monkeypatch):
    """A real engine process's loop (``serve_rollouts``, HF engine, in a thread) and a scripted trainer over a real
    bridge, at max_staleness 1. The trainer sends each new version the moment the engine starts sampling a step, so
    every version arrives mid-tree. Each tree's recorded log-probs must equal, within float32's 1e-4, the log-probs
    under the version it is recorded with, on every thought and answer token, and differ from every other version's.
    Planted and seen to fail: weights loaded as they arrive, from a thread (trees mixed two versions), and the
    version read after sampling instead of before (recorded with the wrong one)."""
    from conftest import tiny_run_config

    from vlm_grpo_ma.engines.hf import HFEngine
    from vlm_grpo_ma.engines.vllm import streamed_weights
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.run.bridge import START
    from vlm_grpo_ma.run.engine_process import serve_rollouts

    steps = 3
    cfg = tiny_run_config(untrained_tiny_dir, tmp_path, "data.task=grounding", "rollout.engine_processes=1",
                          "rollout.max_staleness=1", "rollout.max_thought_tokens=12", "train.num_threads=1", steps=steps)  # fmt: skip
    sampling_started = [threading.Event() for _ in range(steps)]
    original = HFEngine.sample

    def sample_and_say(self, policy, samples, prompts, *, settings, **sizes):
        sampling_started[sample_and_say.calls].set()
        sample_and_say.calls += 1
        time.sleep(0.2)  # the new version is on its way while the tree is sampled
        return original(self, policy, samples, prompts, settings=settings, **sizes)

    sample_and_say.calls = 0
    monkeypatch.setattr(HFEngine, "sample", sample_and_say)
    trainer, engine_side = _bridges()
    trainer.watch([1])  # as a trainer does: the engine's goodbye has a receive
    placement = Placement(rank=1, size=2, engines=1)
    engine_done = _in_thread(lambda: serve_rollouts(cfg, placement, engine_side))

    policy = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    policy.model.eval()
    from vlm_grpo_ma.run.setup import load_prompt_stream

    _, stream = load_prompt_stream(cfg)
    versions = {}
    generator = torch.Generator().manual_seed(1)

    def send(version):
        if version:
            with torch.no_grad():
                for parameter in policy.model.parameters():
                    parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        versions[version] = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
        trainer.send_weights(streamed_weights(policy, torch.float32), [1], {"version": version, "dtype": "float32"})
        trainer.announce(version)

    trainer.send_object({"start_step": 0, "data": stream.state_dict()}, 1, START)
    send(0)
    trees = []
    for step in range(steps):
        assert sampling_started[step].wait(60), f"the engine never sampled step {step}"
        if step + 1 < steps:
            send(step + 1)  # arrives while step `step` is sampled
        trees.append(trainer.recv_object(1, TREE))
    engine_done()
    assert [tree["step"] for tree in trees] == list(range(steps))
    for tree in trees:
        gaps = {version: _rescored(policy, tree["rollout"], weights) for version, weights in versions.items()}
        assert gaps[tree["version"]] < 1e-4, (tree["step"], tree["version"], gaps)
        assert all(gap > 1e-2 for version, gap in gaps.items() if version != tree["version"]), gaps
        assert tree["step"] - tree["version"] <= 1


# ------------------------------------------------------------------------------------------------- launched


def _launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """A CPU launch of one trainer process and one engine process training the tiny untrained model (stdout and
    stderr together)."""
    from conftest import TINY_RUN

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / "cpu-2proc.yaml"),
               "-m", "vlm_grpo_ma.train", "--output-dir", str(run_dir), *TINY_RUN, "train.num_threads=1", "rollout.engine_processes=1",
               *overrides]  # fmt: skip
    return _popen(command)


def _popen(command: list[str]) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from vlm_grpo_ma.run.checkpoint import latest_checkpoint

    return {name: tensor for path in sorted((latest_checkpoint(run_dir) / "model").glob("*.safetensors")) for name, tensor in load_file(path).items()}


@pytest.mark.slow
def test_one_engine_and_one_trainer_at_staleness_0_train_what_one_process_trains(untrained_tiny_dir, tmp_path):
    """The same rewards at every step and the same weights (float32, 1e-6) as the one-process run, with the engine
    holding the trainer's weights exactly (log-prob gap as one process's). Planted and seen to fail: the engine
    skipping one layer's weights when it loads a version (the rewards of step 3 differed)."""
    from conftest import TINY_RUN
    from test_multiprocess import _finish

    # a large rate: weights the engine missed would sample other tokens and show in the gap
    overrides = [f"model.name_or_path={untrained_tiny_dir}", "data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]",
                 "train.steps=3", "train.num_threads=1", "train.learning_rate=1e-2"]  # fmt: skip
    split = _finish(_launch(tmp_path / "split", *overrides), 300)
    one = _finish(_popen([sys.executable, "-m", "vlm_grpo_ma.train", "--output-dir", str(tmp_path / "one"), *TINY_RUN, *overrides]), 300)
    assert "Traceback" not in split + one, split + one
    split_records, one_records = _records(tmp_path / "split"), _records(tmp_path / "one")
    assert [r["reward/mean"] for r in split_records] == [r["reward/mean"] for r in one_records]
    assert [r["rollout/staleness_max"] for r in split_records] == [0, 0, 0]
    assert min(r["train/grad_norm"] for r in split_records) > 0  # every step trained
    assert max(r["rollout/logprob_gap_max"] for r in split_records) < 1e-4
    split_weights, one_weights = _weights(tmp_path / "split"), _weights(tmp_path / "one")
    assert split_weights.keys() == one_weights.keys()
    assert max(float((split_weights[k] - one_weights[k]).abs().max()) for k in one_weights) < 1e-6


@pytest.mark.slow
def test_a_mixture_at_staleness_1_then_an_engine_killed_mid_run_is_named_and_the_run_resumes(untrained_tiny_dir, tmp_path):
    """grounding + code, one step ahead: staleness 0 at the first step and 1 after, importance weights logged.
    Killing the engine process stops the launch with one line naming it; the trainer keeps the steps done; the
    resume discards the tree sampled ahead (counted), and continues without a traceback. Planted and seen to fail:
    no goodbye watch (the launch stopped with no line naming the engine)."""
    from test_multiprocess import _finish, _worker_pid

    run = tmp_path / "run"
    overrides = [f"model.name_or_path={untrained_tiny_dir}", "data.tasks={grounding: 1, code: 1}", "rollout.max_staleness=1",
                 "train.checkpoint_every=2"]  # fmt: skip
    process = _launch(run, *overrides, "train.steps=60")
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 4):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no four steps within 240 s"
        time.sleep(0.2)
    os.kill(_worker_pid(process.pid, rank=1), 9)
    output = _finish(process, 120)
    assert process.returncode != 0
    named = [line for line in output.splitlines() if re.match(r"error: engine process 0 \(launch rank 1\) stopped mid-run", line)]
    assert len(named) == 1, output
    assert output.count(f"Continue with: the same launch (accelerate launch <its options> -m vlm_grpo_ma.train --output-dir {run} --resume)") == 1, output
    records = _records(run)
    from vlm_grpo_ma.run.checkpoint import latest_checkpoint

    assert latest_checkpoint(run).name == f"step-{records[-1]['step']:06d}", output  # nothing done was lost
    assert [r["rollout/staleness_max"] for r in records] == [0] + [1] * (len(records) - 1)
    assert all(0 < r["rollout/importance_ess_answer"] <= 1 for r in records)
    last = records[-1]["step"]
    resumed = _launch(run, *overrides, f"train.steps={last + 2}", "--resume")
    output = _finish(resumed, 240)
    assert resumed.returncode == 0 and "Traceback" not in output, output
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, last + 3))
    assert [r["rollout/staleness_max"] for r in records[last:]] == [0, 1]  # the resumed engine starts from the checkpoint
    assert records[-1]["count/in_flight_trees_discarded"] == 2  # one step of 2 prompts had been sampled ahead


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_engine_process_samples_one_step_ahead(untrained_tiny_dir, tmp_path):
    """The split launch with vLLM as the engine: it gets each update's weights (the gap at staleness 0 is float32's)."""
    from vlm_grpo_ma.engines.vllm import REQUIRE_ENV, vllm_installed

    if not vllm_installed():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but vLLM is not installed (scripts/setup.sh --vllm)")
        pytest.skip("vLLM is not installed (scripts/setup.sh --vllm)")
    from test_multiprocess import _finish

    run = tmp_path / "run"
    process = _launch(run, f"model.name_or_path={untrained_tiny_dir}", "data.tasks={grounding: 1, code: 1}", "rollout.engine=vllm",
                      "rollout.max_staleness=1", "train.steps=3")  # fmt: skip
    output = _finish(process, 400)
    assert process.returncode == 0 and "Traceback" not in output, output[-4000:]
    records = _records(run)
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 1]
    assert records[0]["rollout/logprob_gap_max"] < 1e-4  # fresh weights: the engine's log-probs are the trainer's
    assert all("rollout/prefix_cache_hit_rate" in r for r in records)


def test_an_engine_process_sees_only_its_own_gpu(monkeypatch):
    """The local rank's GPU of those visible, shared where there are fewer GPUs than processes; nothing without
    GPUs. Planted and seen to fail: the first GPU for every engine."""
    from vlm_grpo_ma.run.split_launch import pin_gpu

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pin_gpu(6)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    pin_gpu(1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pin_gpu(1)  # one GPU, two processes: shared
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    pin_gpu(1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
