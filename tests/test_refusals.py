"""Values no run can use, refused at start naming the key, and mistakes that gave raw tracebacks, now one line
(issue 34). Each test names the bug planted to see it fail."""

from __future__ import annotations

import logging

import pytest
from conftest import TINY_RUN

from vlm_grpo_ma.run import cli
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.trackers import check_trackers


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys without a word. Planted: yaml.safe_load; the file loaded."""
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 5\n  learning_rate: 0.1\n  steps: 6\n")
    with pytest.raises(ConfigError, match=rf"^{config}: line 4: key 'steps' is given twice \(first on line 2\); give it once$"):
        load_config(config)


def test_a_malformed_section_is_not_replaced_by_an_override(tmp_path):
    """``train: 5`` in a file and ``train.steps=9`` on the command line: the override replaced the section.
    Planted: the old merge (a mapping over anything); the config loaded with steps 9."""
    config = tmp_path / "c.yaml"
    config.write_text("train: 5\n")
    with pytest.raises(ConfigError, match=r"config section 'train' must be a mapping, got 5"):
        load_config(config, ["train.steps=9"])
    with pytest.raises(ConfigError, match=r"config section 'data.tasks' must be a mapping, got 'vqa'"):
        load_config(None, ["data.tasks=vqa", "data.tasks.grounding=1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.temperature=1e-40", "rollout.temperature=1e-40 is below 0.0001: the sampler divides float32 logits"),
        ("algorithm.overlong_penalty=1e300", "algorithm.overlong_penalty=1e+300 is infinite in float32"),
        ("train.learning_rate=1e39", "train.learning_rate=1e+39 is infinite in float32"),
    ],
)
def test_values_no_run_can_use_are_refused_naming_the_key(override, message):
    """A temperature of 1e-40 sampled NaN; an overlong penalty of 1e300 became inf in float32 and the stop
    message named other keys. Planted: each check removed; the config loaded."""
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace("+", r"\+")):
        load_config(None, [override])
    load_config(None, ["rollout.temperature=1e-4", "algorithm.overlong_penalty=1e30"])  # the edges pass


def test_a_tracker_listed_twice_is_refused():
    """``report_to=[tensorboard, tensorboard]`` logged every scalar twice. Planted: no check; it passed."""
    with pytest.raises(ConfigError, match=r"logging.report_to=\['tensorboard', 'tensorboard'\]: tensorboard listed more than once"):
        check_trackers(load_config(None, ["logging.report_to=[tensorboard,tensorboard]"]))


def test_memory_with_a_missing_config_is_one_line(tmp_path, capsys):
    """Planted: no try around the load; a raw ConfigError traceback."""
    from vlm_grpo_ma.tools import memory

    assert memory.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"error: config file not found: {tmp_path / 'nope.yaml'}\n"


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, untrained_tiny_dir, capsys):
    """Planted: the check removed; mkdir raised FileExistsError with a traceback."""
    file = tmp_path / "a-file"
    file.write_text("x")
    assert cli.main(["--output-dir", str(file), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
    assert capsys.readouterr().err == f"error: train.output_dir={file} is a file, not a folder; choose another --output-dir\n"


def test_a_corrupt_trackers_json_does_not_stop_a_resume(tmp_path, untrained_tiny_dir, caplog):
    """A trackers.json cut short by a crash kept the run from resuming until it was deleted. Planted: the old
    json.loads; the resume raised JSONDecodeError."""
    run = tmp_path / "run"
    base = ["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "logging.report_to=[tensorboard]"]
    assert cli.main([*base, "train.steps=1"]) == 0
    (run / "trackers.json").write_text('{"tensorboard": {"id": ')
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.trackers"):
        assert cli.main(["--output-dir", str(run), "--resume", "train.steps=2"]) == 0
    assert "trackers.json does not read" in caplog.text and "start new runs" in caplog.text


def test_the_step_0_evaluation_is_inside_the_runs_way_out(tmp_path, untrained_tiny_dir, monkeypatch):
    """The step-0 evaluation ran before the signal handler and outside the block that closes the trackers and
    the folder's lock. Planted: the evaluation moved back before the try; the resume below was refused as 'in
    use by another run' (the lock and trackers stayed open)."""
    from vlm_grpo_ma.run import loop

    run = tmp_path / "run"
    base = ["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "train.eval_every=1",
            "train.eval_samples=2", "train.steps=1"]  # fmt: skip

    def interrupted(run_state, step):
        raise RuntimeError("stopped during the step-0 evaluation")

    monkeypatch.setattr(loop, "evaluate", interrupted)
    with pytest.raises(RuntimeError, match="step-0 evaluation") as stopped:
        cli.main(base)
    monkeypatch.undo()
    assert stopped.traceback
    assert cli.main(["--output-dir", str(run), "--resume"]) == 0


def test_a_source_whose_every_image_is_unreadable_is_one_line(tmp_path, untrained_tiny_dir, capsys):
    """Images whose headers read but whose pixels are cut short pass the load and fail at encoding; the run
    stopped with the right message under a RuntimeError traceback. Planted: RuntimeError again; it propagated."""
    from PIL import Image

    Image.new("RGB", (168, 168), (200, 10, 10)).save(tmp_path / "full.png")
    head = (tmp_path / "full.png").read_bytes()[:60]
    rows = []
    for name in ("a", "b"):
        (tmp_path / f"{name}.png").write_bytes(head)
        rows.append(f'{{"id": "{name}", "image": "{name}.png", "expression": "the red square", "box": [1, 2, 30, 40]}}')
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    code = cli.main(["--output-dir", str(tmp_path / "run"), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN,
                     f"data.source={tmp_path / 'train.jsonl'}", "train.steps=1"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: too many unreadable images or videos in a row; check data.source (")
    assert "Traceback" not in err


def test_a_json_whose_rows_are_not_objects_is_one_line(tmp_path):
    """A VLM-R1 JSON of numbers raised TypeError inside require_keys. Planted: the type check removed."""
    from vlm_grpo_ma.task_api.registry import get_task

    (tmp_path / "rows.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"rows.json: row 0: a row must be an object with the keys image, problem, solution; this one is a int"):
        get_task("grounding").load("train", str(tmp_path / "rows.json"))


def test_a_model_folder_without_its_tokenizer_is_one_line(tmp_path, untrained_tiny_dir, capsys):
    """transformers asked for sentencepiece in a many-line message. Planted: the check removed; the error named
    no file."""
    import shutil

    from vlm_grpo_ma.tools import evaluate

    folder = tmp_path / "model"
    shutil.copytree(untrained_tiny_dir, folder)
    (folder / "tokenizer.json").unlink()
    assert evaluate.main(["--models", str(folder), "--limit", "1", "--output-dir", str(tmp_path / "e"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"error: {folder} has no tokenizer (tokenizer.json or tokenizer.model or vocab.json): copy the model's tokenizer files into it")


def test_a_tree_too_large_for_memory_is_refused_before_anything_loads(tmp_path, capsys):
    """K x M = 64 x 512 on the embedded model: 179 GB of KV cache by the memory model, which the run
    found only when the rollout ran out of memory. Refused at start naming both keys, exit 2, no run folder.
    Planted: the check not called in setup_run; the run started loading the model."""
    run_dir = tmp_path / "run"
    code = cli.main(["--task", "grounding", "--output-dir", str(run_dir), "rollout.num_thoughts=64", "rollout.num_answers=512"])
    message = capsys.readouterr().err
    assert code == 2 and "rollout.num_thoughts x rollout.num_answers = 64 x 512 does not fit" in message, message
    assert not run_dir.exists()


def test_the_largest_tree_named_is_the_largest_that_fits():
    """The refusal names the largest M (for the run's K) whose estimated peak fits; a tree that fits and a model
    that does not fit even at K = 2, M = 1 (the smallest tree) are not the tree's to refuse. Planted: ``<`` for ``<=`` in the search (the
    named M was one short) and the K = 2, M = 1 guard removed (a model too large was blamed on K x M)."""
    from vlm_grpo_ma.model.architectures import architecture_of
    from vlm_grpo_ma.run.memory_model import estimate, tree_too_large

    cfg = load_config(None, ["rollout.num_thoughts=8", "rollout.num_answers=64"])
    arch = architecture_of(cfg.model.name_or_path)
    peak = {m: estimate(arch, load_config(None, ["rollout.num_thoughts=8", f"rollout.num_answers={m}"])).peak for m in (20, 21, 64)}
    memory = peak[20]  # M = 20 fits exactly, M = 21 does not
    assert peak[20] < peak[21] < peak[64]
    assert "With rollout.num_thoughts=8, at most rollout.num_answers=20 fits" in tree_too_large(arch, cfg, 1, "ddp", memory)
    assert tree_too_large(arch, cfg, 1, "ddp", peak[64]) is None
    smallest = estimate(arch, load_config(None, ["rollout.num_thoughts=2", "rollout.num_answers=1", "algorithm.advantage_estimator=grpo", "algorithm.answer_baseline=prompt"])).peak
    assert tree_too_large(arch, cfg, 1, "ddp", smallest // 2) is None


# ----------------------------------------------------------------------------------------------------------
# Issue 45: model folders, LoRA targets and runs without a checkpoint, in one line from train and evaluate


def _broken_model_folders(tmp_path, untrained_tiny_dir):
    """(what is given as the model, the message after ``<key> '<given>': ``) for each way a folder fails."""
    not_json, no_weights, no_family = tmp_path / "not-json", tmp_path / "no-weights", tmp_path / "no-family"
    for folder in (not_json, no_weights, no_family):
        folder.mkdir()
    (not_json / "config.json").write_text("{model_type: qwen2_5_vl")
    (no_weights / "config.json").write_text((untrained_tiny_dir / "config.json").read_text())
    (no_family / "config.json").write_text('{"model_type": "llama"}')
    hint = "give a folder, a hub id like Qwen/Qwen2.5-VL-3B-Instruct, or 'tiny' for the embedded model"
    return [
        (str(not_json), f"{not_json / 'config.json'} is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (str(no_weights), f"{no_weights} holds no weights (no *.safetensors or *model*.bin file)"),
        (str(no_family), f"{no_family / 'config.json'}: unsupported model_type 'llama'; supported: qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl"),
        ("tiny/", f"no such local folder ({hint})"),
    ]


def test_a_broken_model_folder_is_one_line_from_train_and_from_evaluate(tmp_path, untrained_tiny_dir, monkeypatch, capsys):
    """A config.json that is not JSON, a folder without weights, a model family not supported, and ``tiny/``
    (no such folder): transformers' OSError traceback (train) or a many-line message, and for ``tiny/`` the hub's
    HFValidationError. Now each is one line naming the folder and what is wrong, before anything loads, and
    evaluate names --models. Planted: _check_model_folder not called (train raised OSError; evaluate printed
    transformers' message) and the hub-id check removed (HFValidationError's message); each case failed."""
    from vlm_grpo_ma.tools import evaluate

    monkeypatch.chdir(tmp_path)  # `tiny/` is no folder here
    for given, problem in _broken_model_folders(tmp_path, untrained_tiny_dir):
        assert cli.main(["--output-dir", str(tmp_path / "run"), f"model.name_or_path={given}", *TINY_RUN]) == 2
        assert capsys.readouterr().err == f"error: model.name_or_path {given!r}: {problem}\n"
        assert evaluate.main(["--models", given, "--limit", "1", "--output-dir", str(tmp_path / "e"), "--no-progress"]) == 2
        assert capsys.readouterr().err == f"error: --models {given!r}: {problem}\n"
    assert not (tmp_path / "run").exists() and not (tmp_path / "e").exists()


def test_evaluating_a_run_before_its_first_checkpoint_is_one_line(tmp_path, capsys):
    """A run folder holds config.yaml and metrics before its first checkpoint; evaluate took it for a model
    folder and printed transformers' 'Should have a `model_type` key'. Planted: a run recognised by its
    checkpoints/ only; the error was about config.json, not the missing checkpoint."""
    from vlm_grpo_ma.run.config_files import save_config
    from vlm_grpo_ma.tools import evaluate

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, []), run / "config.yaml")
    (run / "metrics.jsonl").write_text("")
    assert evaluate.main(["--models", str(run), "--output-dir", str(tmp_path / "e"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"error: run {run} has no checkpoint yet (a run writes one every train.checkpoint_every steps and at its end);"
        " evaluate it once one is written\n")  # fmt: skip


def test_lora_targets_the_decoder_lacks_are_one_line_before_anything_loads(tmp_path, untrained_tiny_dir, capsys):
    """``model.lora_target_modules=[q_proj, qkv]`` (qkv: the vision tower's) raised the memory model's ValueError
    as a traceback (or apply_lora's after the model loaded). Now one line naming the key, the bad name and the
    decoder's projections (read from config.json), exit 2, no run folder. Planted: the check not called in
    setup_run; lora_counts' ValueError propagated out of cli.main."""
    run = tmp_path / "run"
    code = cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "model.lora_rank=2",
                     "model.lora_target_modules=[q_proj,qkv]"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: model.lora_target_modules=['q_proj', 'qkv']: ['qkv'] match no projection of the decoder of"
        f" {untrained_tiny_dir}; its projections are: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj\n"
    )
    assert not run.exists()


# ---------------------------------------------------------------------------------------------- a launch says it once


def test_a_launch_says_a_refusal_once_from_its_main_process(monkeypatch, capsys):
    """Every process of a launch reads the same command line and meets the same refusals: two processes printed
    the line twice, glued together. The main process (RANK 0) says a refusal and another process's failure; the
    others say only their own failures. Planted: every process printing (rank 1 printed the refusal)."""
    from vlm_grpo_ma.run.survive import NonFiniteError, StoppedByAnotherProcess

    monkeypatch.setattr(cli, "quiet_other_processes", lambda rank: None)  # this test process's logging stays as it is
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["rollout.num_answers=0"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
    assert cli.main(["rollout.num_answers=0"]) == 2
    assert capsys.readouterr().err == "error: rollout.num_answers=0 must be > 0\n"
    said = {}
    for rank in (0, 1):
        for error in (ConfigError("refused"), StoppedByAnotherProcess("process 1 stopped the run: x"), NonFiniteError("own")):
            cli.say_error(error, rank)
            said[rank, type(error).__name__] = capsys.readouterr().err
    assert said == {
        (0, "ConfigError"): "error: refused\n", (0, "StoppedByAnotherProcess"): "error: process 1 stopped the run: x\n",
        (0, "NonFiniteError"): "error: own\n",
        (1, "ConfigError"): "", (1, "StoppedByAnotherProcess"): "", (1, "NonFiniteError"): "error: own\n",
    }  # fmt: skip


def test_other_processes_log_errors_and_their_own_failures_only():
    """INFO and WARNING are said once, by the main process; on the others the project's loggers pass errors,
    and warnings of their own failures (a reward that raised on their answers). Planted: nothing quietened."""
    import transformers

    from vlm_grpo_ma.run.distributed import OWN_LOGGERS, quiet_other_processes

    names = ["vlm_grpo_ma", *OWN_LOGGERS]
    levels = {name: logging.getLogger(name).level for name in names}
    verbosity, bars = transformers.utils.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    try:
        quiet_other_processes(0)
        assert {name: logging.getLogger(name).level for name in names} == levels  # the main process: as it was
        quiet_other_processes(1)
        train, rewards = logging.getLogger("vlm_grpo_ma.train"), logging.getLogger("vlm_grpo_ma.run.rewards")
        assert not train.isEnabledFor(logging.WARNING) and train.isEnabledFor(logging.ERROR)
        assert rewards.isEnabledFor(logging.WARNING) and not rewards.isEnabledFor(logging.INFO)
        assert not transformers.utils.logging.is_progress_bar_enabled()  # "Loading weights" once, not per process
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        transformers.utils.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def test_an_empty_output_dir_is_refused_not_replaced_by_the_default(tmp_path, untrained_tiny_dir, monkeypatch, capsys):
    """``--output-dir ""`` ran in runs/<task>-<model>. Planted: cli's `if args.output_dir:` (and no empty check in
    validate) -> the run trained in the default folder and exited 0."""
    monkeypatch.chdir(tmp_path)  # where the default folder would be
    assert cli.main(["--output-dir", "", f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
    default = f"runs/grounding-{untrained_tiny_dir.name}"
    assert capsys.readouterr().err == f"error: train.output_dir='' is empty: name a folder, or leave it unset for {default}\n"
    assert not (tmp_path / "runs").exists()


def test_a_model_folder_whose_weights_are_cut_short_is_one_line(tmp_path, untrained_tiny_dir, capsys):
    """A *.safetensors cut to 1000 bytes gave safetensors' header traceback from the model's load. Planted:
    _check_model_folder without the header check; that traceback (after the data loaded)."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(untrained_tiny_dir, cut)
    (weights,) = cut.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    assert cli.main(["--output-dir", str(tmp_path / "run"), f"model.name_or_path={cut}", *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.name_or_path {str(cut)!r}: {weights} does not load (") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
