from pathlib import Path

import pytest

from vlm_grpo_ma.config import Config, ConfigError, load_config, parse_override

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
        ("model.dtype=fp8", "model.dtype='fp8' is not valid; choose one of: float32, bfloat16, float16"),
        ("rollout.num_answers=0", "rollout.num_answers=0 must be > 0"),
        ("rollout.num_answers=two", "rollout.num_answers='two' must be an integer"),
        ("rollout.num_thoughts=1", "rollout.num_thoughts=1 must be >= 2"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in"),
        ("train.learning_rate=-1", "train.learning_rate=-1.0 must be > 0"),
        ("logging.tensorboard=maybe", "logging.tensorboard='maybe' must be true or false"),
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
    # the default baseline is "thought": asking for plain GRPO by overrides alone names the setting to add
    with pytest.raises(ConfigError, match="set algorithm.answer_baseline=prompt"):
        load_config(None, ["rollout.num_answers=1", "rollout.num_thoughts=16"])


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
