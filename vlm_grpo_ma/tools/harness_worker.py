"""The lmms-eval side of the harness bridge (``python -m vlm_grpo_ma.evaluate --harness lmms-eval``,
tools/harness.py): run in the harness's own environment (``.venv-harness``, ``scripts/setup.sh --harness``), as
``python -m vlm_grpo_ma.tools.harness_worker --model FOLDER --tasks NAME ... --include-path DIR --output FILE``.

It scores one model through ``lmms_eval.evaluator.simple_evaluate`` with ``PolicyModel``, an lmms-eval model
that is this project's ``Policy``: the prompt is encoded by ``encode_prompt`` (the one encoding every family
shares) and answered greedily by the evaluator's own decoding (``generate_rollout``: a thought up to its budget,
then the answer), so a benchmark item is asked exactly as training's evaluator asks it.
- With the training prompt (a task file of ours, its generation settings naming ``vgm_sample``): the row is read
  as the project task's loader reads it (``SAMPLE_BUILDERS``), the task's instruction follows the question, and the model's reply goes to the harness as the task's parsed prediction
  (``Task.parse``: the ``<answer>`` read as the reward reads it; a box converted from the model's coordinate
  frame to the image's pixels by ``Completion.to_original_pixels``, the project's one conversion), as JSON.
- With the stock prompt (a task file of lmms-eval's): the question as the task file writes it, no instruction,
  and the whole reply (thought and answer) goes to the harness, which extracts and scores as it always does.

The task functions our task files name (``refcoco_docs`` ...) are here too; the task folder's ``utils.py``
imports them. ``mathvista_sample`` reads rows through the math and vqa tasks' MathVista readers (private to those
modules: one reading of the format, theirs).
"""

from __future__ import annotations

import argparse
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
# Each benchmark with a training-prompt task file has ``<name>_sample(doc) -> (project task, Sample)``: the row as
# the project task's own loader reads it (the model is asked the sample's question under the task's instruction),
# and the lmms-eval functions its task file names.


def refcoco_sample(doc):
    """An lmms-lab RefCOCO row as the grounding task reads it: one item per box, asked with its first referring
    expression (lmms-eval's stock ``refcoco_bbox_rec_*`` asks every expression of a box as an item of its own)."""
    from tasks.grounding import question_for
    from vlm_grpo_ma.task_api.registry import Sample, get_task

    images = (_image(doc["image"]).convert("RGB"),) if doc.get("image") is not None else ()  # lmms-eval's
    # doc_to_text gets the row without its images
    answers = doc["answer"]
    x, y, w, h = (float(v) for v in doc["bbox"])
    meta = {"width": images[0].width, "height": images[0].height} if images else {}
    sample = Sample("grounding", str(doc["question_id"]), question_for(answers if isinstance(answers, str) else answers[0]),
                    images, [x, y, x + w, y + h], meta)  # fmt: skip
    return get_task("grounding"), sample


def refcoco_docs(dataset):
    return dataset


def refcoco_doc_to_visual(doc):
    return list(refcoco_sample(doc)[1].images)


def refcoco_doc_to_text(doc):
    return refcoco_sample(doc)[1].question


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


def mathvista_sample(doc):
    """A MathVista row as this project reads it: a ``free_form`` row by the math task's loader, a
    ``multi_choice`` row by the vqa task's."""
    from tasks import math as math_task
    from tasks import vqa as vqa_task
    from vlm_grpo_ma.task_api.registry import get_task

    # lmms-eval's doc_to_text gets the row without its images: then the sample has none (its question is the same)
    row = {**doc, "decoded_image": _cell(doc.get("decoded_image")), "image": None}
    where = f"MathVista pid {doc['pid']}"
    if doc["question_type"] == "multi_choice":
        sample = vqa_task._mathvista_sample(row, str(doc["pid"]), Path("."), where, True)
    else:
        sample = math_task._mathvista_sample(row, str(doc["pid"]), Path("."), where)
    return get_task(sample.task), sample


def mathvista_docs(dataset):
    return dataset


def mathvista_doc_to_visual(doc):
    return [_image(image).convert("RGB") for image in mathvista_sample(doc)[1].images]


def mathvista_doc_to_text(doc):
    return mathvista_sample(doc)[1].question


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


SAMPLE_BUILDERS = {"refcoco": refcoco_sample, "mathvista": mathvista_sample}


def _prediction(results):
    try:
        return json.loads(results[0]) if results else None
    except ValueError:
        return None


def _cell(image):
    """A PIL image as the ``{"bytes", "path"}`` cell the project's loaders read (PNG bytes); a cell as it is."""
    if image is None or isinstance(image, (dict, str)):
        return image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


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

        samples, prompts, tasks = [], [], []
        for context, gen_kwargs, doc_to_visual, doc_id, task_name, split in batch:
            doc = self.task_dict[task_name][split][doc_id]
            if "vgm_sample" in gen_kwargs:  # the training prompt: the row as the project task reads it
                task, sample = SAMPLE_BUILDERS[gen_kwargs["vgm_sample"]](doc)
            else:  # the stock prompt: lmms-eval's question and images, no instruction
                task, sample = None, Sample(task="harness", id=str(doc_id), question=context, images=tuple(doc_to_visual(doc)), answer=None)
            samples.append(sample)
            prompts.append(encode_prompt(self.policy, sample, task.instruction if task else ""))
            tasks.append(task)
        settings = SamplingSettings(
            temperature=0.0, max_thought_tokens=self.max_thought_tokens, max_answer_tokens=self.max_answer_tokens,
            generators=[prompt_generators(self.seed, index, 1)[0] for index in range(len(samples))],  # greedy: unused
        )  # fmt: skip
        with torch.no_grad():
            rollout = generate_rollout(self.policy, samples, prompts, num_thoughts=1, num_answers=1, settings=settings)
        return [harness_reply(task, completion, sample) for completion, sample, task in zip(rollout.completions, samples, tasks, strict=True)]

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
        print(f"error: lmms-eval knows no task {', '.join(unknown)} (lmms-eval --tasks list names them)", file=sys.stderr)
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
