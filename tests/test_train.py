"""End-to-end: a few steps on the untrained tiny model, outputs, crash safety and exact resume."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_config
from safetensors.torch import load_file

from vlm_grpo_ma.run import cli, distributed
from vlm_grpo_ma.run import loop as train_module
from vlm_grpo_ma.run import setup as run_setup
from vlm_grpo_ma.run.checkpoint import latest_checkpoint, list_checkpoints
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import load_config

LENGTH_TASK = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")


def _cfg(model_dir, out_dir, *extra):
    return tiny_run_config(model_dir, out_dir, *extra)


def _weights(checkpoint):
    return load_file(checkpoint / "model" / "model.safetensors")


def _crash_the_update_of_step_3(monkeypatch):
    """Makes train()'s third update raise before it runs; returns the real update_policy to put back."""
    real_update = train_module.update_policy
    calls = {"n": 0}

    def failing_update(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash in step 3")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(train_module, "update_policy", failing_update)
    return real_update


def test_run_writes_its_outputs(untrained_tiny_dir, tmp_path):
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.checkpoint_every=2", "logging.report_to=[tensorboard]")
    summary = train_module.train(cfg)
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/iou", "reward/format", "train/loss", "train/grad_norm", "train/clip_fraction",
                "advantage/thought_reward_spread", "rollout/thought_tokens", "rollout/answer_tokens", "time/step_seconds",
                "grpo_ma/answer_reward_var", "grpo_ma/thought_value_noise_var", "grpo_ma/thought_value_spread_var",
                "signal/zero_prompt_groups", "signal/zero_thought_groups", "signal/zero_answer_groups",
                "train/grad_norm_spike_ratio", "train/thought_weight_share", "train/thought_gradient_share"):
        assert key in records[0], key
    assert records[0]["rollout/logprob_gap_max"] < 1e-4  # training re-scores exactly what was sampled
    dumps = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(dumps[0]["thoughts"]) == 2 and len(dumps[0]["thoughts"][0]["answers"]) == 2
    assert [p.name for p in list_checkpoints(run)] == ["step-000002", "step-000004"]
    assert any((run / "tensorboard").iterdir())
    assert summary["steps"] == 4 and "reward/mean" in summary


def test_zero_advantages_leave_the_weights_unchanged(untrained_tiny_dir, tmp_path):
    # every reward part weighted 0 -> all rewards 0 -> all advantages 0 -> a policy gradient of exactly zero
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "data.reward_weights.format=0", "data.reward_weights.iou=0")
    train_module.train(cfg)
    start, after = load_file(untrained_tiny_dir / "model.safetensors"), _weights(latest_checkpoint(tmp_path / "run"))
    assert all(torch.equal(start[k], after[k]) for k in start)


def test_out_of_tree_task_trains_and_moves_the_weights(untrained_tiny_dir, tmp_path):
    module = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "data.task=answer_length", f"data.task_modules=[{module}]")
    summary = train_module.train(cfg)
    start, after = load_file(untrained_tiny_dir / "model.safetensors"), _weights(latest_checkpoint(tmp_path / "run"))
    assert summary["reward/mean"]["first_fifth"] > 0
    changed = [k for k in start if not torch.equal(start[k], after[k])]
    assert len(changed) > len(start) // 2


def test_crash_keeps_progress_and_resume_is_exact(untrained_tiny_dir, tmp_path, monkeypatch):
    straight_dir, crashed_dir = tmp_path / "straight", tmp_path / "crashed"
    # a reward the untrained model's samples vary on, so every step moves the weights
    task = ("data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]")
    train_module.train(_cfg(untrained_tiny_dir, straight_dir, "train.checkpoint_every=100", *task))

    real_update = _crash_the_update_of_step_3(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_module.train(_cfg(untrained_tiny_dir, crashed_dir, "train.checkpoint_every=100", *task))
    assert [p.name for p in list_checkpoints(crashed_dir)] == ["step-000002"]  # saved on the way down

    monkeypatch.setattr(train_module, "update_policy", real_update)
    train_module.train(_cfg(untrained_tiny_dir, crashed_dir, "train.checkpoint_every=100", *task), resume=True)
    a, b = _weights(latest_checkpoint(straight_dir)), _weights(latest_checkpoint(crashed_dir))
    assert latest_checkpoint(crashed_dir).name == "step-000004"
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(untrained_tiny_dir / "model.safetensors")
    assert not all(torch.equal(a[k], start[k]) for k in a)  # the runs did train
    straight = [json.loads(x) for x in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (crashed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in straight] == [r["reward/mean"] for r in resumed]
    assert [r["rollout/thought_tokens"] for r in straight] == [r["rollout/thought_tokens"] for r in resumed]


def test_cli_rejects_a_bad_value_before_loading_anything(capsys):
    code = cli.main(["--task", "grounding", "rollout.num_answers=0"])
    assert code == 2
    assert "rollout.num_answers=0 must be > 0" in capsys.readouterr().err


def test_cli_rejects_an_unknown_task(capsys):
    code = cli.main(["--task", "groundin"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown task 'groundin'; known tasks:" in err and "grounding" in err


def test_reused_rollouts_and_kl_to_the_reference(untrained_tiny_dir, tmp_path):
    module = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")
    cfg = _cfg(
        untrained_tiny_dir, tmp_path / "run", "train.steps=2", "data.task=answer_length", f"data.task_modules=[{module}]",
        "algorithm.num_iterations=2", "algorithm.kl_coef=0.05", "train.learning_rate=1e-2",
    )
    train_module.train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the second update of step 1 already sees a policy that moved away from both the rollout and the reference
    assert records[0]["train/kl"] > 0
    assert records[1]["train/kl"] > records[0]["train/kl"]
    assert 0 < records[1]["train/clip_fraction"] <= 1


def test_cli_names_a_missing_data_file_and_a_missing_model(tmp_path, capsys):
    code = cli.main(["--task", "grounding", f"data.source={tmp_path}/nope.parquet", f"train.output_dir={tmp_path}/r"])
    assert code == 2
    assert "data.source=" in capsys.readouterr().err
    code = cli.main(["--task", "grounding", f"model.name_or_path={tmp_path}/no-model", f"train.output_dir={tmp_path}/r"])
    assert code == 2
    assert "no such local folder" in capsys.readouterr().err


def test_task_mixture_scores_each_prompt_by_its_own_task_and_logs_per_task(untrained_tiny_dir, tmp_path):
    module = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")
    cfg = _cfg(
        untrained_tiny_dir, tmp_path / "run", "train.steps=3", "train.prompts_per_step=4",
        "data.tasks={grounding: 1, answer_length: 1}", f"data.task_modules=[{module}]",
    )
    train_module.train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    both = [r for r in records if "reward/grounding/mean" in r and "reward/answer_length/mean" in r]
    assert both, "a 3-step run drawing 4 prompts a step from two tasks has a step with both"
    assert "reward/grounding/iou" in both[0] and "reward/answer_length/length" in both[0]
    dumps = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    for dump in dumps:  # each prompt's answers carry its own task's reward parts
        parts = set(dump["thoughts"][0]["answers"][0])
        assert ("iou" in parts) != ("length" in parts)


def test_task_flag_and_mixture_together_are_refused(capsys):
    assert cli.main(["--task", "grounding", "data.tasks={grounding: 1}"]) == 2
    assert "both name the tasks" in capsys.readouterr().err


def test_held_out_evaluation_every_n_steps_uses_the_evaluate_code(untrained_tiny_dir, tmp_path, capsys):
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=3", "train.eval_every=2", "train.eval_samples=2")
    summary = train_module.train(cfg)
    run = tmp_path / "run"
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    # before the first step, every 2 steps and at the end
    assert [s for s, r in records.items() if "eval/grounding/iou" in r] == [0, 2, 3]
    assert "reward/mean" not in records[0] and records[2]["eval/grounding/prompts"] == 2
    lines = (run / "eval" / "step-000002" / "grounding.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["test_00000", "test_00001"]
    assert summary["eval"]["eval/grounding/accuracy"]["step"] == 3
    assert summary["eval"]["eval/grounding/accuracy"]["first_step"] == 0
    assert summary["steps"] == 3  # the step-0 evaluation is not a training step of the fifths
    out = capsys.readouterr().out
    assert "eval/grounding/iou" in out and "step 0:" in out


def test_evaluation_data_errors_name_the_task(untrained_tiny_dir, tmp_path):
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.eval_every=2", "data.eval_split=validation")
    with pytest.raises(Exception, match="evaluation data of task grounding .*unknown grounding split 'validation'"):
        train_module.train(cfg)


def test_full_fine_tuning_with_a_frozen_vision_tower(untrained_tiny_dir, tmp_path):
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "data.task=answer_length",
               f"data.task_modules=[{LENGTH_TASK}]", "model.freeze_vision=true")
    train_module.train(cfg)
    start, after = load_file(untrained_tiny_dir / "model.safetensors"), _weights(latest_checkpoint(tmp_path / "run"))
    vision = [k for k in start if ".visual." in k or k.startswith("visual.")]
    language = [k for k in start if k not in vision]
    assert vision and all(torch.equal(start[k], after[k]) for k in vision)
    assert sum(not torch.equal(start[k], after[k]) for k in language) > len(language) // 2


def test_lora_trains_adapters_only_resumes_exactly_and_uses_the_adapter_free_model_as_reference(untrained_tiny_dir, tmp_path, monkeypatch):
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.lora import merge_adapter
    from vlm_grpo_ma.tools import evaluate as ev

    lora_args = ("data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]", "model.lora_rank=4",
                 "algorithm.kl_coef=0.05", "train.learning_rate=1e-2", "train.checkpoint_every=100")
    straight_dir, crashed_dir = tmp_path / "straight", tmp_path / "crashed"
    train_module.train(_cfg(untrained_tiny_dir, straight_dir, *lora_args))
    folder = latest_checkpoint(straight_dir) / "model"
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    records = [json.loads(line) for line in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/kl"] > 0  # the adapters moved the policy away from the base model

    # the merged model is a plain model whose base weights are untouched where LoRA adds nothing (the vision tower)
    merged = load_policy(str(merge_adapter(folder, tmp_path / "merged")))
    start = load_file(untrained_tiny_dir / "model.safetensors")
    visual = [n for n, _ in merged.model.named_parameters() if ".visual." in n]
    state = dict(merged.model.named_parameters())
    assert visual and all(torch.equal(state[n].detach(), start[n]) for n in visual if n in start)

    # crash in step 3, resume: the same adapter weights as the straight run
    real_update = _crash_the_update_of_step_3(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_module.train(_cfg(untrained_tiny_dir, crashed_dir, *lora_args))
    monkeypatch.setattr(train_module, "update_policy", real_update)
    train_module.train(_cfg(untrained_tiny_dir, crashed_dir, *lora_args), resume=True)
    a = load_file(latest_checkpoint(straight_dir) / "model" / "adapter_model.safetensors")
    b = load_file(latest_checkpoint(crashed_dir) / "model" / "adapter_model.safetensors")
    assert a and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # B starts at 0: it was trained

    # a LoRA checkpoint is a model for evaluation
    assert ev.main(["--models", str(straight_dir), "--limit", "2", "--max-thought-tokens", "4", "--max-answer-tokens", "4",
                    "--draw", "0", "--output-dir", str(tmp_path / "eval"), "--no-progress"]) == 0


def test_resuming_a_lora_checkpoint_without_lora_is_refused(untrained_tiny_dir, tmp_path):
    run = tmp_path / "run"
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=1", "model.lora_rank=2"))
    with pytest.raises(Exception, match="holds a LoRA adapter but model.lora_rank=0"):
        train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=2"), resume=True)


def test_a_crash_after_the_weights_moved_does_not_checkpoint_a_half_step(untrained_tiny_dir, tmp_path, monkeypatch):
    real_update = train_module.update_policy
    calls = {"n": 0}

    def update_then_fail(*args, **kwargs):
        calls["n"] += 1
        metrics = real_update(*args, **kwargs)
        if calls["n"] == 3:
            raise RuntimeError("simulated crash after the optimiser step of step 3")
        return metrics

    monkeypatch.setattr(train_module, "update_policy", update_then_fail)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_module.train(_cfg(untrained_tiny_dir, run, "train.checkpoint_every=2", "data.task=answer_length",
                                f"data.task_modules=[{LENGTH_TASK}]"))
    assert [p.name for p in list_checkpoints(run)] == ["step-000002"]  # not a "step 2" holding step 3's weights


def test_overrides_may_sit_between_options(tmp_path, capsys):
    code = cli.main(["--task", "grounding", "train.steps=0", "--output-dir", str(tmp_path / "r"), "logging.log_every=1"])
    assert code == 2 and "train.steps=0 must be > 0" in capsys.readouterr().err  # parsed, then validated


def test_deepspeed_is_refused_at_start_naming_what_runs(monkeypatch):
    import accelerate

    class DeepSpeedAccelerator:  # stands in for accelerate's launcher state only; the trainer's check is real
        def __init__(self, **kwargs):
            self.distributed_type = accelerate.utils.DistributedType("DEEPSPEED")
            self.num_processes = 2

    monkeypatch.setattr(accelerate, "Accelerator", DeepSpeedAccelerator)
    with pytest.raises(ConfigError, match="DEEPSPEED is not supported; use FSDP2 .*fsdp.yaml.* or data parallelism"):
        distributed.make_accelerator(load_config(None, []))


def test_an_fsdp_launch_gets_a_plain_accelerator_the_trainer_shards_for(monkeypatch):
    """accelerate's FSDP plugin stays off (the trainer shards with fully_shard, vlm_grpo_ma/run/sharding.py); an
    FSDP setting the trainer does not run is refused at start by name. Planted and seen to fail: the
    Accelerator created with ACCELERATE_USE_FSDP left in the environment (on the CPU accelerate ignores it,
    on a GPU it would turn its plugin on: the test records what accelerate would read)."""
    for name in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    import accelerate

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    seen = []
    real = accelerate.Accelerator

    def recording_accelerator(**kwargs):  # what accelerate reads when it decides on its FSDP plugin (on a GPU)
        seen.append(os.environ.get("ACCELERATE_USE_FSDP"))
        return real(**kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", recording_accelerator)
    accelerator = distributed.make_accelerator(load_config(None, []))
    assert seen == [None] and accelerator.distributed_type.value != "FSDP"
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"  # restored for whoever reads it next
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 1 .* fsdp_version: 2"):
        distributed.make_accelerator(load_config(None, []))


def test_a_fresh_run_refuses_a_directory_holding_a_run_unless_told(untrained_tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--task", "grounding", f"model.name_or_path={untrained_tiny_dir}", "--output-dir", str(run), "train.steps=1",
            "train.prompts_per_step=1", "rollout.num_thoughts=2", "rollout.num_answers=2", "rollout.max_thought_tokens=4",
            "rollout.max_answer_tokens=4", "train.eval_every=0", "logging.progress_bar=false", "logging.report_to=[]"]
    assert cli.main(args) == 0
    first = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert cli.main(args) == 2  # would have appended to the first run's metrics
    err = capsys.readouterr().err
    assert f"train.output_dir={run} already holds a run (checkpoints, metrics.jsonl" in err and "--resume" in err
    assert (run / "metrics.jsonl").read_text() == first
    assert cli.main([*args, "--overwrite"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # the new run's step only
    assert cli.main([*args, "--overwrite", "--resume"]) == 2
    assert "give one" in capsys.readouterr().err


def test_the_shared_prefix_forward_and_the_reencoding_one_train_alike(untrained_tiny_dir, tmp_path):
    """The default training forward (each prompt and thought through the KV cache once) and the re-encoding
    one that gradient checkpointing uses see the same rollout and compute the same gradient: same grad norm
    and loss at step 1 (micro-batches of 3 rows split the prompts' trees)."""
    records = {}
    for name, checkpointing in (("shared", "false"), ("reencode", "true")):
        cfg = _cfg(untrained_tiny_dir, tmp_path / name, "train.steps=1", "data.task=answer_length",
                   f"data.task_modules=[{LENGTH_TASK}]", f"model.gradient_checkpointing={checkpointing}")
        assert run_setup.shares_prefixes(cfg) == (name == "shared")
        train_module.train(cfg)
        records[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    shared, reencode = records["shared"], records["reencode"]
    assert shared["rollout/thought_tokens"] == reencode["rollout/thought_tokens"] and shared["reward/mean"] == reencode["reward/mean"]
    assert shared["train/grad_norm"] > 0
    assert shared["train/grad_norm"] == pytest.approx(reencode["train/grad_norm"], rel=1e-5)
    # figures that depend on the log-probs (train/loss at ratio 1 is -sum(w * A) whatever the model computes)
    assert shared["train/nll"] > 0
    assert shared["train/nll"] == pytest.approx(reencode["train/nll"], rel=1e-5)
    assert shared["train/pg_loss"] == pytest.approx(reencode["train/pg_loss"], rel=1e-5, abs=1e-7)
    assert shared["rollout/logprob_gap_max"] < 1e-4 and reencode["rollout/logprob_gap_max"] < 1e-4


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_first_update_sees_ratio_one_and_zero_kl_in_every_precision(untrained_tiny_dir, tmp_path, precision, lora_rank):
    """At the first update of step 1 the trained, old and reference log-probs are one computation of one model
    (the reference is the unchanged start, or the adapters switched off): the log-ratio and the KL are exactly
    0, in fp32 and under bf16 autocast. One update (kl) and two (the old log-probs of the reused rollout)."""
    for iterations in (1, 2):
        run = tmp_path / f"run-{iterations}"
        cfg = _cfg(
            untrained_tiny_dir, run, "train.steps=1", "data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]",
            "algorithm.kl_coef=0.1", f"algorithm.num_iterations={iterations}", f"train.mixed_precision={precision}",
            f"model.lora_rank={lora_rank}", "train.learning_rate=1e-12",
        )
        train_module.train(cfg)
        record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        assert record["train/first_update_log_ratio_max"] == 0.0, (iterations, record)
        if iterations == 1:
            assert record["train/kl"] == 0.0, record
            assert record["train/nll"] > 0


def _learning_rates(run):
    return [json.loads(line)["train/learning_rate"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_logged_learning_rate_is_the_one_each_step_used(untrained_tiny_dir, tmp_path):
    """warmup 2 then linear decay to 0 at step 6: factor (s + 1) / 3 for s < 2, then 1 - (s - 2) / 4; and SGD
    moves the weights by exactly lr * grad, so the rate the optimiser used is checked, not just the log."""
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=6", "train.warmup_steps=2", "train.lr_schedule=linear",
               "train.learning_rate=1e-3")
    train_module.train(cfg)
    expected = [1e-3 / 3, 2e-3 / 3, 1e-3, 7.5e-4, 5e-4, 2.5e-4]
    assert _learning_rates(tmp_path / "run") == pytest.approx(expected, rel=1e-12)


def test_sgd_steps_by_learning_rate_times_gradient(untrained_tiny_dir, tmp_path, monkeypatch):
    """train.optimizer=sgd: the weights move by exactly -lr * grad (clipped), the plain update the
    equivalence checks need (AdamW would hide a constant factor on the gradient)."""
    seen = {}
    real_step = torch.optim.SGD.step

    def recording_step(self, *args, **kwargs):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen["before"] = [p.detach().clone() for p in params]
        seen["grad"] = [p.grad.detach().clone() for p in params]
        seen["lr"] = self.param_groups[0]["lr"]
        out = real_step(self, *args, **kwargs)
        seen["after"] = [p.detach().clone() for p in params]
        return out

    monkeypatch.setattr(torch.optim.SGD, "step", recording_step)
    cfg = _cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "train.optimizer=sgd", "train.learning_rate=0.5",
               "data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]")
    train_module.train(cfg)
    assert seen["lr"] == 0.5
    moved = 0
    for before, grad, after in zip(seen["before"], seen["grad"], seen["after"], strict=True):
        torch.testing.assert_close(after, before - 0.5 * grad, rtol=0, atol=1e-7)
        moved += int((after != before).any())
    assert moved > 0


def test_every_log_prob_goes_through_score_rows_and_the_estimator_comes_from_the_config(untrained_tiny_dir, tmp_path, monkeypatch):
    """One step with every kind of log-prob: old ones (num_iterations=2), trained ones, and the KL reference's
    (LoRA: adapters off). Each forward of a scorer (policy.CompletionScorer.forward) is a call of update.score_rows:
    3 micro-batches x (1 old + 2 trained + 1 reference: the reference is scored once per step). The advantages come from the configured estimator.
    Planted and seen to fail: the reference scored by calling the scorer directly, and train() calling
    compute_advantages with "grpo_ma" whatever the config says."""
    from vlm_grpo_ma.model import logprobs as logprobs_module
    from vlm_grpo_ma.run import update

    calls = {"score_rows": 0, "forward": 0, "estimators": []}
    real_score_rows, real_forward, real_advantages = update.score_rows, logprobs_module.CompletionScorer.forward, train_module.compute_advantages

    def counted_score_rows(*args, **kwargs):
        calls["score_rows"] += 1
        return real_score_rows(*args, **kwargs)

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return real_forward(*args, **kwargs)

    def recorded_advantages(name, *args, **kwargs):
        calls["estimators"].append(name)
        return real_advantages(name, *args, **kwargs)

    for module in (update, run_setup):  # update_policy's name for it, and make_reference's
        monkeypatch.setattr(module, "score_rows", counted_score_rows)
    monkeypatch.setattr(logprobs_module.CompletionScorer, "forward", counted_forward)
    monkeypatch.setattr(train_module, "compute_advantages", recorded_advantages)
    train_module.train(_cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "model.lora_rank=2", "algorithm.kl_coef=0.05",
                            "algorithm.num_iterations=2", "algorithm.advantage_estimator=grpo", "algorithm.answer_baseline=prompt"))
    assert calls["forward"] == calls["score_rows"] == 3 * (1 + 2 + 1)
    assert calls["estimators"] == ["grpo"]


def test_the_kl_reference_is_scored_once_per_step_and_is_what_every_iteration_would_score(untrained_tiny_dir, tmp_path, monkeypatch):
    """algorithm.num_iterations=3 with KL (LoRA: the reference is the base, adapters off): the reference is
    called once per micro-batch, not once per iteration, and scoring it again after the three optimiser steps
    gives exactly the log-probs the update used (so recomputing it per iteration, as before, gave the same loss
    and gradients), while the trained policy did move. Planted and seen to fail: the reference called inside
    the iteration loop (9 calls, not 3), and the LoRA reference scored with the adapters on (it moves)."""
    from vlm_grpo_ma.run import update

    seen = {"calls": []}
    real_make_reference = run_setup.make_reference

    def spied_make_reference(policy, scorer, *args, **kwargs):
        reference = real_make_reference(policy, scorer, *args, **kwargs)
        seen["reference"], seen["scorer"] = reference, scorer

        def counted(micro, prompts, accelerator, temperature):
            logprobs = reference(micro, prompts, accelerator, temperature)
            seen["calls"].append(((micro, prompts, accelerator, temperature), logprobs.clone()))
            return logprobs

        return counted

    monkeypatch.setattr(run_setup, "make_reference", spied_make_reference)
    train_module.train(_cfg(untrained_tiny_dir, tmp_path / "run", "train.steps=1", "model.lora_rank=2", "algorithm.kl_coef=0.05",
                            "algorithm.num_iterations=3", "train.checkpoint_every=100",
                            "data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]", "train.learning_rate=1e-2"))
    assert len(seen["calls"]) == 3  # 3 micro-batches, once each
    moved = 0
    with torch.no_grad():
        for args, used in seen["calls"]:
            torch.testing.assert_close(seen["reference"](*args), used, rtol=0, atol=0)
            trained = update.score_rows(seen["scorer"], *args)
            moved += int((trained - used).abs().max() > 1e-6)
    assert moved > 0  # the policy the iterations trained is not the reference
