"""The lmms-eval side of the harness bridge (``python -m vlm_grpo_ma.evaluate --harness lmms-eval``,
tools/harness.py): run in the harness's own environment (``.venv-harness``, ``scripts/setup.sh --harness``), as
``python -m vlm_grpo_ma.tools.harness_worker --model FOLDER --tasks NAME ... --include-path DIR --output FILE``.

It scores one model through ``lmms_eval.evaluator.simple_evaluate`` with ``PolicyModel``, an lmms-eval model
that is this project's ``Policy``: the prompt is encoded by ``encode_prompt`` (the one encoding every family
shares) and answered greedily by the evaluator's own decoding (``generate_rollout``: a thought up to its budget,
then the answer), so a benchmark item is asked exactly as training's evaluator asks it.
- With the training prompt (a task file of ours, its generation settings naming ``vgm_tasks``): the row is the
  Sample the project task's own loader makes of it (``project_samples``), the task's instruction follows the question, and the model's reply goes to the harness as the task's parsed prediction
  (``Task.parse``: the ``<answer>`` read as the reward reads it; a box converted from the model's coordinate
  frame to the image's pixels by ``Completion.to_original_pixels``, the project's one conversion), as JSON.
- With the stock prompt (a task file of lmms-eval's): the question as the task file writes it, no instruction,
  and the whole reply (thought and answer) goes to the harness, which extracts and scores as it always does.

The task functions our task files name (``project_doc_to_text`` ...) are here too; the task folder's ``utils.py``
imports them.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import sys
from pathlib import Path

from lmms_eval.api.model import lmms


def _image(cell):
    """A dataset cell as a PIL image: decoded already (a parquet with Hugging Face's Image feature) or the
    ``{"bytes", "path"}`` struct of a plain parquet."""
    from PIL import Image

    if isinstance(cell, dict):
        return Image.open(io.BytesIO(cell["bytes"])) if cell.get("bytes") else Image.open(cell["path"])
    return cell


# ---------------------------------------------------------------------------------------------- task functions
# A training-prompt task file names, in its generation settings and its ``lmms_eval_specific_kwargs``, the project
# tasks that read the benchmark (``vgm_tasks``), the local file (``vgm_source``) and the column holding a row's id
# (``vgm_id``). Each row is then the Sample those tasks' own loaders make of it (``project_samples``: one reading of
# each format, the tasks'), asked with its task's instruction: the evaluator's exact question and images.


@functools.cache
def project_samples(tasks: tuple[str, ...], source: str) -> dict:
    """{sample id: (task, Sample)} of ``source`` as each of ``tasks`` loads it (MathVista: the math task reads the
    free-form rows, the vqa task the multiple-choice ones). A row a loader skipped (a broken image) is absent."""
    from vlm_grpo_ma.task_api.registry import get_task, load_samples

    found = {}
    for name in tasks:
        task = get_task(name)
        try:
            samples = load_samples(task, "test", source)
        except ValueError as error:  # a file with no row this task reads (MathVista without choice rows)
            print(f"{name} reads no row of {source}: {error}", file=sys.stderr)
            continue
        found.update({sample.id: (task, sample) for sample in samples})
    return found


def project_sample(doc, settings: dict):
    """(task, Sample) of the row ``doc``, or (None, None) when the task's loader skipped it."""
    found = project_samples(tuple(settings["vgm_tasks"]), settings["vgm_source"])
    return found.get(str(doc[settings["vgm_id"]]), (None, None))


def project_doc_to_text(doc, lmms_eval_specific_kwargs=None):
    _, sample = project_sample(doc, lmms_eval_specific_kwargs or {})
    return sample.question if sample is not None else ""


def refcoco_doc_to_visual(doc):
    return [_image(doc["image"]).convert("RGB")]


def mathvista_doc_to_visual(doc):
    return [_image(doc["decoded_image"]).convert("RGB")]


def refcoco_process_results(doc, results):
    """IoU and Acc@0.5 of the predicted box (original pixels, from ``Task.parse``) against the file's box, by
    lmms-eval's own RefCOCO geometry (``utils_rec.compute_iou``); no box scores 0."""
    from lmms_eval.tasks.refcoco.utils_rec import compute_iou

    x, y, w, h = (float(v) for v in doc["bbox"])
    truth = [x, y, x + w, y + h]
    prediction = _prediction(results)
    box = prediction.get("box") if isinstance(prediction, dict) else None
    iou = compute_iou(box, truth) if box is not None else 0.0
    return {"iou": float(iou), "acc_iou50": float(iou >= 0.5)}


def mathvista_process_results(doc, results):
    """Accuracy by lmms-eval's MathVista scorer (``normalize_extracted_answer``, then ``safe_equal`` with the row's
    answer) of the answer the task parsed: a free-form answer's text, or the one option letter a multiple-choice
    answer was read as. No answer, or a choice answer read as no option or several, is wrong (the stock scorer
    would take the choice nearest to an empty string)."""
    from lmms_eval.tasks.mathvista.mathvista_evals import MathVistaEvaluator

    prediction = _prediction(results)
    if doc["question_type"] == "multi_choice":
        options = prediction.get("options") if isinstance(prediction, dict) else None
        extraction = options[0] if options and len(options) == 1 else None
    else:
        extraction = prediction if isinstance(prediction, str) else None
    if extraction is None:
        return {"accuracy": 0.0}
    precision = int(doc["precision"]) if doc.get("precision") is not None else 0
    normalized = MathVistaEvaluator.normalize_extracted_answer(
        None, extraction, doc.get("choices") or [], doc["question_type"], doc["answer_type"], precision
    )
    return {"accuracy": float(MathVistaEvaluator.safe_equal(None, normalized, doc["answer"]))}


def _prediction(results):
    try:
        return json.loads(results[0]) if results else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------- the model


def harness_reply(task, completion, sample) -> str:
    """What the harness is handed for one answer: with the training prompt (a project ``task``), the task's parsed
    prediction as JSON (``Task.parse``: the ``<answer>`` as the reward reads it, boxes in the image's pixels);
    with the stock prompt (``task`` None), the whole reply."""
    if task is None:
        return completion.text
    return json.dumps(task.parse(completion, sample) if task.parse is not None else completion.answer)


class PolicyModel(lmms):
    """This project's policy as an lmms-eval model (see the module docstring)."""

    def __init__(self, model: str, batch_size: int = 16, max_thought_tokens: int = 40, max_answer_tokens: int = 24, seed: int = 0):
        super().__init__()
        import torch

        from vlm_grpo_ma.model.loading import load_policy

        self.policy = load_policy(model, device="cuda" if torch.cuda.is_available() else "cpu")
        self.policy.model.eval()
        self.batch_size_per_gpu = batch_size
        self.max_thought_tokens, self.max_answer_tokens, self.seed = max_thought_tokens, max_answer_tokens, seed

    def generate_until(self, requests) -> list[str]:
        replies: list[str] = []
        for start in range(0, len(requests), self.batch_size_per_gpu):
            replies += self._answer([request.args for request in requests[start : start + self.batch_size_per_gpu]])
        return replies

    def _answer(self, batch) -> list[str]:
        import torch

        from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
        from vlm_grpo_ma.engines.rollout import generate_rollout
        from vlm_grpo_ma.model.prompts import encode_prompt
        from vlm_grpo_ma.task_api.registry import Sample

        asked: list[tuple] = []  # (index in the batch, task, sample); a row its task's loader skipped is not asked
        for index, (context, gen_kwargs, doc_to_visual, doc_id, task_name, split) in enumerate(batch):
            doc = self.task_dict[task_name][split][doc_id]
            if "vgm_tasks" in gen_kwargs:  # the training prompt: the row as the project task reads it
                task, sample = project_sample(doc, gen_kwargs)
            else:  # the stock prompt: lmms-eval's question and images, no instruction
                task, sample = None, Sample(task="harness", id=str(doc_id), question=context, images=tuple(doc_to_visual(doc)), answer=None)
            if sample is not None:
                asked.append((index, task, sample))
        replies = ["null"] * len(batch)  # a skipped row: no answer, scored 0
        if not asked:
            return replies
        samples = [sample for _, _, sample in asked]
        prompts = [encode_prompt(self.policy, sample, task.instruction if task else "") for _, task, sample in asked]
        settings = SamplingSettings(
            temperature=0.0, max_thought_tokens=self.max_thought_tokens, max_answer_tokens=self.max_answer_tokens,
            generators=[prompt_generators(self.seed, index, 1)[0] for index in range(len(samples))],  # greedy: unused
        )  # fmt: skip
        with torch.no_grad():
            rollout = generate_rollout(self.policy, samples, prompts, num_thoughts=1, num_answers=1, settings=settings)
        for (index, task, sample), completion in zip(asked, rollout.completions, strict=True):
            replies[index] = harness_reply(task, completion, sample)
        return replies

    def loglikelihood(self, requests):
        raise NotImplementedError("PolicyModel answers generate_until tasks only")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("PolicyModel answers generate_until tasks only")


# ---------------------------------------------------------------------------------------------- the program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Score one model through lmms-eval (tools/harness.py runs this).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--include-path", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-thought-tokens", type=int, default=40)
    parser.add_argument("--max-answer-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local", action="append", default=[], metavar="NAME=FILE",
                        help="a stock task's data read from a local file instead of the hub")
    args = parser.parse_args(argv)
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    manager = TaskManager(include_path=args.include_path)
    unknown = [name for name in args.tasks if name not in manager.all_tasks]
    if unknown:
        print(f"lmms-eval knows no task {', '.join(unknown)} (.venv-harness/bin/python -m lmms_eval --tasks list lists them)",
              file=sys.stderr)  # fmt: skip
        return 2
    ran = {name: name for name in args.tasks}
    for pair in args.local:
        name, data = pair.split("=", 1)
        ran[name] = local_stock_task(manager, name, data, Path(args.include_path))
    if args.local:
        manager = TaskManager(include_path=args.include_path)
    model = PolicyModel(args.model, args.batch_size, args.max_thought_tokens, args.max_answer_tokens, args.seed)
    results = simple_evaluate(model=model, tasks=list(ran.values()), task_manager=manager, limit=args.limit,
                              batch_size=args.batch_size, log_samples=True, bootstrap_iters=0, random_seed=args.seed)  # fmt: skip
    samples = {
        task: [{"doc_id": s["doc_id"], "target": s.get("target"), "response": s["resps"][0][0] if s.get("resps") else None,
                **{k: v for k, v in s.items() if k in ("iou", "acc_iou50", "accuracy")}} for s in task_samples]
        for task, task_samples in (results.get("samples") or {}).items()
    }  # fmt: skip
    payload = {"ran": ran, "results": results["results"], "versions": results.get("versions", {}), "samples": samples,
               "lmms_eval_version": _version()}  # fmt: skip
    Path(args.output).write_text(json.dumps(payload, indent=2, default=str))
    return 0


def local_stock_task(manager, name: str, data: str, folder: Path) -> str:
    """A task file ``vgm_stock_<name>`` that is lmms-eval's ``name`` as shipped (it includes that file), reading its
    test split from the parquet ``data`` instead of the hub; its name."""
    from lmms_eval.utils import load_yaml_config

    shipped = manager.task_index[name]["yaml_path"]
    split = load_yaml_config(shipped)["test_split"]
    variant = f"vgm_stock_{name}"
    (folder / f"{variant}.yaml").write_text(
        f"include: {json.dumps(shipped)}\ntask: {variant}\ndataset_path: parquet\ndataset_kwargs:\n"
        f"  data_files:\n    {split}: {json.dumps(str(Path(data).resolve()))}\n"
    )
    return variant


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lmms_eval")


if __name__ == "__main__":
    raise SystemExit(main())
