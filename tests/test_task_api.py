"""The public task API and task discovery: the `vlm_grpo_ma.tasks` entry point group (built-in and third-party
tasks), its error messages, and the rule that the core imports no task by name."""

import ast
import re
import sys
from pathlib import Path

import pytest

from vlm_grpo_ma import task_api
from vlm_grpo_ma.task_api import registry
from vlm_grpo_ma.task_api.registry import Completion, get_task, import_task_modules, list_tasks

REPO = Path(__file__).resolve().parents[1]
BUILTIN = ("affordance", "code", "grounding", "math", "vqa")


def install_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str], monkeypatch) -> None:
    """An installed third-party distribution without pip: ``{dist}-0.dist-info`` (METADATA, entry_points.txt)
    and its modules in ``root``, which goes on sys.path (where importlib.metadata looks)."""
    info = root / f"{dist}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    for name, code in modules.items():
        (root / f"{name}.py").write_text(code)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(root))
    for name in modules:  # forgotten after the test (their import registers tasks)
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)


ECHO_TASK = """
from vlm_grpo_ma.task_api import Sample, Task, register_task

def load(split="train", source=None):
    return [Sample("{name}", "0", "Say yes.", (), "yes")]

def reward(completion, sample):
    return {{"reward": float(completion.answer == sample.answer)}}

TASK = {register}(Task(name="{name}", load=load, reward=reward, instruction="Answer."))
"""


def echo_task(name: str, register: bool = True) -> str:
    return ECHO_TASK.format(name=name, register="register_task" if register else "")


def test_builtin_tasks_come_from_this_projects_entry_points():
    table = (REPO / "pyproject.toml").read_text().split('[project.entry-points."vlm_grpo_ma.tasks"]\n')[1].split("\n\n")[0]
    declared = dict(re.fullmatch(r'(\w+) = "([\w.:]+)"', line).groups() for line in table.splitlines())
    modules = sorted(p.stem for p in (REPO / "tasks").glob("*.py") if not p.stem.startswith("_"))
    assert declared == {name: f"tasks.{name}" for name in modules}  # every task file, under its task's name
    assert set(BUILTIN) <= set(list_tasks())


def test_a_third_party_task_is_found_through_its_entry_point(tmp_path, monkeypatch, fresh_registry):
    install_dist(tmp_path, "thirdparty", {"echo_tp": "thirdparty_echo"}, {"thirdparty_echo": echo_task("echo_tp")}, monkeypatch)
    assert "echo_tp" in list_tasks() and set(BUILTIN) <= set(list_tasks())
    task = get_task("echo_tp")
    sample = task.load("test")[0]
    assert task.reward(Completion("", "yes"), sample) == {"reward": 1.0}
    assert "entry point echo_tp = 'thirdparty_echo'" in registry._SOURCES["echo_tp"]
    assert "thirdparty" in registry._SOURCES["echo_tp"]


def test_an_entry_point_may_name_a_task_object(tmp_path, monkeypatch, fresh_registry):
    module = echo_task("object_tp", register=False)  # TASK = (Task(...)): the core registers it
    install_dist(tmp_path, "objecttp", {"object_tp": "objecttp_mod:TASK"}, {"objecttp_mod": module}, monkeypatch)
    assert get_task("object_tp").instruction == "Answer."


def test_an_empty_group_says_to_install_the_package(monkeypatch, fresh_registry):
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match=r"entry point group 'vlm_grpo_ma.tasks' is empty.*`pip install -e \.`"):
        list_tasks()


@pytest.mark.parametrize(
    ("value", "code", "cause"),
    [
        ("brokentp_mod", "import a_module_that_is_not_installed\n",
         "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"),
        ("brokentp_mod:NOT_THERE", "", "AttributeError"),
        ("brokentp_mod", "raise SystemExit('no')\n", None),  # not an Exception: propagates as it is
    ],
)
def test_an_entry_point_that_fails_to_load_is_named_with_its_cause(tmp_path, monkeypatch, fresh_registry, value, code, cause):
    install_dist(tmp_path, "brokentp", {"broken_tp": value}, {"brokentp_mod": code}, monkeypatch)
    if cause is None:
        with pytest.raises(SystemExit):
            get_task("grounding")
        return
    with pytest.raises(RuntimeError) as error:
        get_task("grounding")
    assert str(error.value).startswith(f"entry point broken_tp = {value!r} (group vlm_grpo_ma.tasks, brokentp) failed to load: {cause}")


def test_an_entry_point_must_register_a_task_of_its_name(tmp_path, monkeypatch, fresh_registry):
    install_dist(tmp_path, "misnamed", {"wanted_tp": "misnamed_mod"}, {"misnamed_mod": echo_task("other_tp")}, monkeypatch)
    with pytest.raises(RuntimeError, match="wanted_tp = 'misnamed_mod'.*loaded, but no task named 'wanted_tp'"):
        list_tasks()


def test_a_duplicate_name_names_both_sources(tmp_path, monkeypatch, fresh_registry):
    install_dist(tmp_path, "shadow", {"grounding": "shadow_grounding"}, {"shadow_grounding": echo_task("grounding")}, monkeypatch)
    with pytest.raises(ValueError) as error:
        list_tasks()
    message = str(error.value)
    assert message.startswith("task 'grounding' from entry point grounding = 'shadow_grounding'")
    assert "shadow" in message and "is already registered by" in message and "tasks.grounding" in message


def test_two_third_party_packages_with_one_task_name(tmp_path, monkeypatch, fresh_registry):
    install_dist(tmp_path / "a", "first_pkg", {"same_tp": "first_mod"}, {"first_mod": echo_task("same_tp")}, monkeypatch)
    install_dist(tmp_path / "b", "second_pkg", {"same_tp": "second_mod"}, {"second_mod": echo_task("same_tp")}, monkeypatch)
    with pytest.raises(ValueError, match="task 'same_tp' from entry point same_tp = '(first|second)_mod'") as error:
        list_tasks()
    assert "first_pkg" in str(error.value) and "second_pkg" in str(error.value)


def test_a_duplicate_registered_directly_is_refused_naming_the_module(fresh_registry):
    with pytest.raises(ValueError, match=r"task 'math' from module test_task_api \(.*test_task_api\.py\) is already registered by .*tasks\.math"):
        task_api.register_task(task_api.Task(name="math", load=list, reward=test_a_duplicate_registered_directly_is_refused_naming_the_module, instruction=""))


def test_a_task_from_a_file_and_from_a_package_collides_naming_the_file(tmp_path, monkeypatch, fresh_registry):
    """A file named in data.task_modules is imported under a made-up module name; the duplicate-name error names
    the file. Planted: the source as the module name alone; the file's path was missing from the message."""
    install_dist(tmp_path / "pkg", "colour_pkg", {"colour_tp": "colour_mod"}, {"colour_mod": echo_task("colour_tp")}, monkeypatch)
    task_file = tmp_path / "mine" / "colour_task.py"
    task_file.parent.mkdir()
    task_file.write_text(echo_task("colour_tp"))
    registry.import_task_modules([str(task_file)])
    monkeypatch.delitem(sys.modules, "user_task_colour_task")
    with pytest.raises(ValueError) as error:
        list_tasks()
    message = str(error.value)
    assert message.startswith("task 'colour_tp' from entry point colour_tp = 'colour_mod'")
    assert f"is already registered by module user_task_colour_task ({task_file})" in message


def test_a_sample_of_another_task_name_is_refused_naming_the_task_and_sample(fresh_registry):
    """The core looks each sample's task up by ``Sample.task``; a loader that writes another name (a typo)
    failed mid-run with a KeyError. Planted: no check in load_samples; the test failed."""
    def load(split="train", source=None):
        return [task_api.Sample("colour", "s0", "q", (), "red"), task_api.Sample("color", "s1", "q", (), "red")]

    task = task_api.register_task(task_api.Task(name="colour", load=load, reward=test_the_core_imports_no_task_by_name, instruction=""))
    with pytest.raises(ValueError, match=r"^task 'colour' \(module test_task_api \(.*\)\): load\('test'\) returned sample 's1' with "
                                         r"task='color'; Sample.task must be the task's name, 'colour'$"):
        registry.load_samples(task, "test")
    twice = task_api.register_task(task_api.Task(
        name="twice", load=lambda split, source=None: [task_api.Sample("twice", i, "q", (), 1) for i in ("a", "b", "a")],
        reward=test_the_core_imports_no_task_by_name, instruction=""))  # fmt: skip
    # evaluate --source merged rows of one id into one prompt (planted: no check; it loaded)
    with pytest.raises(ValueError, match=r"load\('test'\) from bench.jsonl returned two samples of id 'a'; sample ids must be unique"):
        registry.load_samples(twice, "test", "bench.jsonl")
    with pytest.raises(ValueError, match="returned a tuple; it must return a list of Sample"):
        registry.load_samples(task_api.Task(name="x", load=lambda split, source=None: (), reward=len, instruction=""), "train")


def test_the_core_imports_no_task_by_name():
    offenders = []
    for path in sorted((REPO / "vlm_grpo_ma").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n == "tasks" or n.startswith("tasks.")]
    assert offenders == []


def test_built_in_tasks_use_only_the_public_api():
    """A built-in task imports from the core only `vlm_grpo_ma.task_api`, and only names it exports."""
    for path in sorted((REPO / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlm_grpo_ma"):
                assert node.module == "vlm_grpo_ma.task_api", f"{path.name}:{node.lineno} imports {node.module}"
                assert {a.name for a in node.names} <= set(task_api.__all__), path.name
    assert not (REPO / "tasks" / "_common.py").exists()


def test_the_public_api_exports_what_it_says_and_nothing_private():
    assert all(not name.startswith("_") and hasattr(task_api, name) for name in task_api.__all__)
    assert len(set(task_api.__all__)) == len(task_api.__all__)
    for name in re.findall(r"``(\w+)``", task_api.__doc__.split("What is here:")[1].split("\n\n")[0]):
        assert name in task_api.__all__, name


def doc_example() -> str:
    return re.search(r"## A one-file task\n```python\n(.*?)```", (REPO / "docs" / "TASKS.md").read_text(), re.S).group(1)


def test_the_guide_example_loads_from_a_file_and_scores(tmp_path, monkeypatch, fresh_registry):
    monkeypatch.setitem(sys.modules, "user_task_colour_task", None)
    monkeypatch.delitem(sys.modules, "user_task_colour_task")
    path = tmp_path / "colour_task.py"
    path.write_text(doc_example())
    import_task_modules([str(path)])
    task = get_task("colour")
    samples = task.load("test")
    assert len(samples) == 20 and {s.answer for s in samples} <= {"red", "green", "blue"}
    sample = samples[0]
    assert sample.images[0].getpixel((0, 0)) == {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}[sample.answer]
    right = Completion("<think>look</think>", f"<answer>{sample.answer.title()}.</answer>")
    assert task.reward(right, sample) == {"accuracy": 1.0, "format": 1.0, "reward": 1.5}
    assert task.reward(Completion("", "<answer>purple</answer>"), sample) == {"accuracy": 0.0, "format": 0.0, "reward": 0.0}
    assert task.reward(Completion("", "<answer>red"), sample)["reward"] == 0.0


def test_the_guide_example_registers_through_an_entry_point(tmp_path, monkeypatch, fresh_registry):
    install_dist(tmp_path, "colour_pkg", {"colour": "colour_task_ep"}, {"colour_task_ep": doc_example()}, monkeypatch)
    assert "colour" in list_tasks()
    assert registry._SOURCES["colour"].startswith("entry point colour = 'colour_task_ep'")


def test_an_overlong_question_is_skipped_and_counted_at_load(fresh_registry, caplog):
    """A 1 MB caption made the step that drew it allocate 44 GB. Planted: no length check; both samples loaded."""
    def load(split="train", source=None):
        return [task_api.Sample("long_q", "huge", "x" * 1_000_000, (), 1), task_api.Sample("long_q", "fine", "how many?", (), 1)]

    task = task_api.register_task(task_api.Task(name="long_q", load=load, reward=test_the_core_imports_no_task_by_name, instruction=""))
    with registry.count_load_skips() as skipped, caplog.at_level("WARNING"):
        samples = registry.load_samples(task, "train")
    assert [s.id for s in samples] == ["fine"] and skipped["overlong_prompts"] == 1
    assert "skipping sample 'huge' of task 'long_q': its question has 1,000,000 characters, more than 100,000" in caplog.text


def test_the_docs_example_task_draws_what_it_asks_and_its_target_scores_full_marks(monkeypatch, fresh_registry):
    """docs/examples/largest_colour.py (the warm start walkthrough): its splits, the same scenes at every call, the
    answer the colour with the most pixels in the picture (the large shape's), and Task.target a completion its
    own reward pays in full. Planted: target naming the shape in the answer; this failed."""
    from collections import Counter

    monkeypatch.setitem(sys.modules, "user_task_largest_colour", None)
    monkeypatch.delitem(sys.modules, "user_task_largest_colour")
    import_task_modules([str(REPO / "docs" / "examples" / "largest_colour.py")])
    task = get_task("largest_colour")
    train, test = task.load("train"), task.load("test")
    assert (len(train), len(test)) == (400, 100) and [s.answer for s in task.load("test")] == [s.answer for s in test]
    colours = sys.modules["user_task_largest_colour"].COLOURS
    for sample in train[:40]:
        pixels = Counter(sample.images[0].get_flattened_data())
        assert max(colours, key=lambda name: pixels[colours[name]]) == sample.answer
        text = task.target(sample)
        cut = text.index("</think>") + len("</think>")
        assert task.reward(Completion(text[:cut], text[cut:]), sample) == {"accuracy": 1.0, "format": 1.0, "reward": 1.5}
