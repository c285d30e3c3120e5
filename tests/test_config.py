from pathlib import Path

import pytest

from vlm_grpo_ma.run.config import Config, ConfigError
from vlm_grpo_ma.run.config_files import load_config, parse_override

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_are_the_paper_comparison_t4a4():
    cfg = load_config()
    assert (cfg.rollout.num_thoughts, cfg.rollout.num_answers) == (4, 4)
    assert cfg.model.name_or_path == "tiny" and cfg.data.task == "grounding"
    assert cfg.answers_per_prompt == 16


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["rollout.num_answers=1", "rollout.num_thoughts=16", "algorithm.answer_baseline=prompt", "train.learning_rate=1e-5", "model.max_pixels=null"])
    assert cfg.rollout.num_answers == 1 and cfg.rollout.num_thoughts == 16
    assert cfg.train.learning_rate == pytest.approx(1e-5) and isinstance(cfg.train.learning_rate, float)
    assert cfg.model.max_pixels is None


def test_nested_dict_override():
    cfg = load_config(None, ["data.reward_weights.iou=2", "data.reward_weights.format=0.25"])
    assert cfg.data.reward_weights == {"iou": 2.0, "format": 0.25}


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.num_answer=4", "unknown config key rollout.num_answer; valid keys: num_thoughts, num_answers"),
        ("rollouts.num_answers=4", "unknown config section 'rollouts'; valid sections: model, rollout"),
        ("algorithm.answer_baseline=group", "algorithm.answer_baseline='group' is not valid; choose one of: prompt, thought"),
        ("algorithm.advantage_estimator=ppo", "algorithm.advantage_estimator='ppo' is not valid; choose one of: grpo_ma, grpo"),
        ("model.dtype=fp8", "model.dtype='fp8' is not valid; choose one of: float32, bfloat16"),
        ("rollout.num_answers=0", "rollout.num_answers=0 must be > 0"),
        ("rollout.num_answers=two", "rollout.num_answers='two' must be an integer"),
        ("rollout.num_thoughts=1", "rollout.num_thoughts=1 must be >= 2"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in"),
        ("train.learning_rate=-1", "train.learning_rate=-1.0 must be > 0"),
        ("logging.progress_bar=maybe", "logging.progress_bar='maybe' must be true or false"),
        ("numanswers", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_key_and_the_choices(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_thought_baseline_needs_several_answers():
    with pytest.raises(ConfigError, match="answer_baseline='thought' needs rollout.num_answers >= 2"):
        load_config(None, ["algorithm.answer_baseline=thought", "rollout.num_answers=1", "rollout.num_thoughts=16"])
    # the default baseline is "thought": asking for plain GRPO by overrides alone names the settings to add
    with pytest.raises(ConfigError, match="set algorithm.advantage_estimator=grpo and algorithm.answer_baseline=prompt"):
        load_config(None, ["rollout.num_answers=1", "rollout.num_thoughts=16"])


def test_flat_grpo_needs_the_prompt_baseline():
    with pytest.raises(ConfigError, match="advantage_estimator=grpo normalises .* set algorithm.answer_baseline=prompt .it is 'thought'"):
        load_config(None, ["algorithm.advantage_estimator=grpo"])
    cfg = load_config(None, ["algorithm.advantage_estimator=grpo", "algorithm.answer_baseline=prompt"])
    assert cfg.algorithm.advantage_estimator == "grpo"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_answers: 2\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.rollout.num_answers == 2 and cfg.train.steps == 9


def test_parse_override_builds_nested_mapping():
    assert parse_override("rollout.num_answers=8") == {"rollout": {"num_answers": 8}}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_preset_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_presets_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny-grounding-t4a4.yaml", "tiny-grounding-t16a1.yaml"} <= names


def test_task_mixture_and_its_sources():
    cfg = load_config(None, ["data.tasks={grounding: 3, vqa: 1}", "data.sources.vqa=/data/sqa.parquet"])
    assert cfg.task_weights == {"grounding": 3.0, "vqa": 1.0}
    assert cfg.task_source("vqa") == "/data/sqa.parquet" and cfg.task_source("grounding") is None
    single = load_config(None, ["data.task=vqa", "data.source=/x.jsonl"])
    assert single.task_weights == {"vqa": 1.0} and single.task_source("vqa") == "/x.jsonl"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.tasks={grounding: 0}"], "data.tasks weights must be > 0, got {'grounding': 0.0}"),
        (["data.tasks={grounding: 1}", "data.source=/a.jsonl"], "with data.tasks name files in data.sources"),
        (["data.sources.vqa=/a.jsonl"], "data.sources names ['vqa'], which are not in data.tasks []"),
        (["data.tasks={grounding: x}"], "data.tasks.grounding='x' must be a number"),
    ],
)
def test_bad_task_mixtures_are_refused(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


# --- issue 12: non-finite, out-of-range and silently wrong settings are refused, naming the key ----------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.learning_rate=.nan", "train.learning_rate=nan must be a finite number"),
        ("train.learning_rate=.inf", "train.learning_rate=inf must be a finite number"),
        ("train.learning_rate=1e999", "train.learning_rate=inf must be a finite number"),
        ("data.reward_weights.iou=.nan", "data.reward_weights.iou=nan must be a finite number"),
        ("data.tasks={grounding: .inf, vqa: 1}", "data.tasks.grounding=inf must be a finite number"),
        ("algorithm.kl_coef=.inf", "algorithm.kl_coef=inf must be a finite number"),
        ("train.max_grad_norm=0", "train.max_grad_norm=0.0 must be > 0"),
        ("train.seed=-1", "train.seed=-1 must be >= 0"),
        ("train.seed=4294967296", "train.seed=4294967296 is out of range: valid seeds are 0 .. 18446633"),
        ("train.seed=18446634", "train.seed=18446634 is out of range: valid seeds are 0 .. 18446633"),
        ("train.mixed_precision=fp16", "train.mixed_precision=fp16 is not supported: the trainer has no loss scaling"),
        # AdamW's eps is 0 in float16: the run stopped at step 1 blaming the learning rate. Planted: no check; it loaded
        ("model.dtype=float16", "model.dtype=float16 is not supported: AdamW's eps (1e-8) is 0 in float16"),
        # no frame fits: the first video failed mid-run. Planted: no check; it loaded
        ("model.video_max_pixels=783", "model.video_max_pixels=783 must be >= 784, one vision token (28x28 pixels)"),
        ("model.video_max_pixels=1", "model.video_max_pixels=1 must be >= 784"),
        ("train.num_threads=99999999999999999999", "train.num_threads=99999999999999999999 is out of range"),
        ("model.min_pixels=-5", "model.min_pixels=-5 must be > 0"),
        ("train.steps=[1", "override 'train.steps=[1': the value '[1' is not valid YAML"),
        ("train.eval_samples=0", "train.eval_samples=0 must be > 0"),
        ("algorithm.clip_low=1.5", "algorithm.clip_low=1.5 must be in [0, 1]"),
    ],
)
def test_non_finite_and_out_of_range_values_are_refused(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


@pytest.mark.parametrize("steps", [400, 1, 10**6])
def test_the_largest_valid_seed_samples_every_step_and_the_next_one_overflows(steps):
    from vlm_grpo_ma.engines.decode import SEED_STRIDE, prompt_generators
    from vlm_grpo_ma.run.config import max_seed

    highest = max_seed(steps)
    cfg = load_config(None, [f"train.seed={highest}", f"train.steps={steps}"])
    last_step_seed = cfg.train.seed * SEED_STRIDE + steps - 1  # as loop.sampling_settings seeds the last step
    assert len(prompt_generators(last_step_seed, SEED_STRIDE - 1, 1)) == 1  # its last possible prompt
    with pytest.raises(ValueError, match="Overflow"):
        prompt_generators(last_step_seed + SEED_STRIDE, SEED_STRIDE - 1, 1)  # train.seed = highest + 1
    with pytest.raises(ConfigError, match=rf"train.seed={highest + 1} is out of range: valid seeds are 0 .. {highest} "):
        load_config(None, [f"train.seed={highest + 1}", f"train.steps={steps}"])


def test_dynamic_sampling_draws_beyond_the_seed_numbering_are_refused():
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling_max_draws=100000 with train.prompts_per_step=16 draws more than"):
        load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_draws=100000"])
    load_config(None, ["algorithm.dynamic_sampling=false", "algorithm.dynamic_sampling_max_draws=100000"])  # unused: fine


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n  learning_rate: [1e-4\n")
    with pytest.raises(ConfigError, match=rf"{bad}:4:1: not valid YAML"):
        load_config(bad)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"train:\n  steps: 3\n  output_dir: \xff\n")
    with pytest.raises(ConfigError, match=rf"{binary}:3: not UTF-8 text"):
        load_config(binary)


def test_the_cli_reports_invalid_yaml_without_a_traceback(tmp_path, capsys):
    from vlm_grpo_ma.run import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\n")
    assert cli.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:2:1: not valid YAML") and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- --print-config


def test_every_setting_is_described_by_its_comment_in_the_config():
    """The comments of run/config.py are the one place a setting is described (--print-config shows them). Planted:
    only a field's own-line comments read (not those above it); 12 settings came back empty."""
    from dataclasses import fields

    from vlm_grpo_ma.run.config_files import setting_descriptions

    descriptions = setting_descriptions()
    keys = [f"{section.name}.{item.name}" for section in fields(Config) for item in fields(section.default_factory)]
    assert sorted(descriptions) == sorted(keys)
    assert [key for key in keys if not descriptions[key].strip()] == []
    assert descriptions["rollout.num_answers"] == "M: answers sampled per thought; 1 = plain GRPO"  # on its own line
    assert descriptions["algorithm.answer_baseline"].startswith("The group an answer's reward is normalised over.")  # above


def test_print_config_prints_every_setting_its_value_and_what_it_is_as_yaml(capsys):
    """--print-config prints the tree as a YAML file --config reads: the defaults (train.output_dir derived, as
    a run derives it), each with its description as the line's comment; the overrides show. Planted: the defaults
    printed whatever the command line said (train.steps stayed 300)."""
    import yaml

    from vlm_grpo_ma.run import cli
    from vlm_grpo_ma.run.config import default_output_dir
    from vlm_grpo_ma.run.config_files import setting_descriptions

    assert cli.main(["--print-config"]) == 0
    printed = capsys.readouterr().out
    expected = Config().to_dict()
    expected["train"]["output_dir"] = default_output_dir(Config())
    assert yaml.safe_load(printed) == expected
    descriptions = setting_descriptions()
    for section, values in expected.items():
        for key in values:
            (line,) = [line for line in printed.splitlines() if line.startswith(f"  {key}: ") and line.endswith(descriptions[f"{section}.{key}"])]
            assert "  # " in line
    assert cli.main(["--print-config", "train.steps=7", "--task", "video"]) == 0
    changed = yaml.safe_load(capsys.readouterr().out)
    assert changed["train"]["steps"] == 7 and changed["data"]["task"] == "video"
    assert changed["train"]["output_dir"] == "runs/video-tiny"


# ---------------------------------------------------------------------------------------------- threads


@pytest.mark.parametrize(
    ("load", "cores", "threads", "processes", "warns"),
    [
        (3.5, 2, 2, 1, True),  # other runs on the 2 cores, torch's 2 threads: the 10-25x slowdown
        (1.0, 2, 2, 1, True),  # one other busy thread: 3 threads on 2 cores
        (0.9, 2, 2, 1, False),  # an idle machine's background
        (3.5, 2, 1, 1, False),  # one thread a process takes its share, however busy the machine
        (1.0, 4, 2, 2, True),  # a launch: 2 processes x 2 threads fill the 4 cores, and one more is busy
        (1.5, 16, 8, 1, False),  # 8 threads and the load fit in 16 cores
        (9.0, 16, 8, 1, True),
    ],
)
def test_a_busy_machine_is_said_at_start_naming_num_threads(load, cores, threads, processes, warns):
    """Planted: the one-thread case not exempted (3.5 load, 1 thread warned), and the run's processes not
    counted (load 1, 2 x 2 threads on 4 cores did not warn); each failed here."""
    from vlm_grpo_ma.run.setup import busy_machine_warning

    message = busy_machine_warning(load, cores, threads, processes)
    assert (message is not None) == warns
    if warns:
        assert "train.num_threads=1" in message and f"load average {load:.1f} on {cores} cores" in message
        assert "\n" not in message
