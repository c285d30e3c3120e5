"""Host memory over a long image stream: peak RSS while the trainer's prompt drawing streams parquet images.

Writes a parquet file in the lmms-lab RefCOCO format (``question_id, image {bytes, path}, question, answer, bbox,
file_name``) holding ``--images`` JPEGs of ``--size`` pixels (a noisy gradient, so each JPEG is a realistic size),
loads it with the grounding task's parquet loader (images opened lazily: header only) and draws the stream
through ``loop.draw_prompts`` with ``loop.encode_sample`` on the untrained tiny model's processor, step after
step (``--prompts-per-step``), as one of ``--processes`` processes (process 0; the others are taken to skip no
image). Every ``--every`` images it prints the process's resident memory now and at its peak (VmRSS / VmHWM).
With decoded pixels kept on the samples, RSS grows by about width x height x 3 bytes per image visited; without,
it stays flat once the file is loaded.

``--train STEPS``: the whole loop instead, reward pool included. ``python -m vlm_grpo_ma.train --task grounding``
trains the untrained tiny model on the file for STEPS steps (``--prompts-per-step`` prompts, K = M = 2, short
thoughts and answers, no evaluation or checkpoint on the way) while this script reads the resident memory of
the trainer and of its reward workers (its child processes) from /proc twice a second; every ``--every`` steps
it prints both, and at the end the growth from the first printed step to the last. Pixels kept anywhere on the
way (the sample, the pickled job a reward worker receives) make one of them grow by about the images' decoded
size; without, both stay flat.

    .venv/bin/python scripts/bench_image_stream.py --images 2000 [--size 640x480] [--processes 1]
    .venv/bin/python scripts/bench_image_stream.py --images 2000 --train 250 --prompts-per-step 8 --every 25
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def memory_mib() -> tuple[float, float]:
    """(resident now, resident peak) of this process in MiB, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def process_tree_rss_mib(root_pid: int) -> tuple[float, float, int]:
    """(resident MiB of ``root_pid``, summed resident MiB of its descendants, how many descendants)."""
    parents, rss = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except OSError:  # gone meanwhile
            continue
        parents[int(entry.name)] = int(status["PPid"])
        rss[int(entry.name)] = int(status.get("VmRSS", "0 kB").split()[0]) / 1024
    descendants, frontier = set(), {root_pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    return rss.get(root_pid, 0.0), sum(rss[pid] for pid in descendants), len(descendants)


def train_and_watch(parquet: Path, work: Path, steps: int, prompts_per_step: int, every: int) -> int:
    """Train on ``parquet`` for ``steps`` steps in a subprocess, printing the trainer's and its reward
    workers' resident memory every ``every`` steps (see the module docstring); returns the run's exit code."""
    import json
    import os
    import subprocess

    from vlm_grpo_ma.model.tiny import build_untrained

    run_dir = work / "run"
    command = [
        sys.executable, "-m", "vlm_grpo_ma.train", "--task", "grounding", "--output-dir", str(run_dir),
        f"model.name_or_path={build_untrained(work / 'tiny', seed=0)}", f"data.source={parquet}",
        f"train.steps={steps}", f"train.prompts_per_step={prompts_per_step}", "train.micro_batch_rows=8",
        "rollout.num_thoughts=2", "rollout.num_answers=2", "rollout.max_thought_tokens=8", "rollout.max_answer_tokens=6",
        "train.eval_every=0", f"train.checkpoint_every={steps}", "logging.progress_bar=false", "logging.report_to=[]",
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    trainer = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    print("step | images drawn | trainer RSS MiB | reward workers RSS MiB (count) | seconds")
    metrics, printed, first = run_dir / "metrics.jsonl", 0, None
    while trainer.poll() is None:
        time.sleep(0.5)
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= printed + every and done < steps:  # the last step's reading would see the workers stopping
            printed = done - done % every
            trainer_mib, workers_mib, workers = process_tree_rss_mib(trainer.pid)
            first = first or (printed, trainer_mib, workers_mib)
            print(f"{printed:4d} | {printed * prompts_per_step:12d} | {trainer_mib:15.0f} | {workers_mib:22.0f} ({workers}) | {time.perf_counter() - started:7.1f}")
            last = (printed, trainer_mib, workers_mib)
    if trainer.returncode != 0:
        print(trainer.stderr.read()[-3000:], file=sys.stderr)
        return trainer.returncode
    if first is not None and last[0] > first[0]:
        images = (last[0] - first[0]) * prompts_per_step
        print(f"from step {first[0]} to {last[0]} ({images} more images drawn): trainer {last[1] - first[1]:+.0f} MiB, "
              f"reward workers {last[2] - first[2]:+.0f} MiB")  # fmt: skip
    print(f"last step logged: {json.loads(metrics.read_text().splitlines()[-1])['step']}")
    return 0


def write_parquet(path: Path, count: int, width: int, height: int) -> int:
    """``count`` JPEG rows in the lmms-lab RefCOCO layout; returns the file's bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    gradient = np.linspace(0, 200, width, dtype=np.float32)[None, :, None] + np.linspace(0, 55, height, dtype=np.float32)[:, None, None]
    rows = []
    for i in range(count):
        pixels = np.clip(gradient + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=85)
        rows.append(
            {
                "question_id": str(i),
                "image": {"bytes": out.getvalue(), "path": None},
                "question": "Please carefully observe the area circled in the image.",
                "answer": [f"the object number {i}"],
                "bbox": [10.0, 20.0, 100.0, 80.0],
                "file_name": f"{i:06d}.jpg",
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="images streamed (default 2000)")
    parser.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of each image (default 640x480)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1, help="stream as process 0 of this many")
    parser.add_argument("--every", type=int, default=250, help="print memory every this many images (--train: steps)")
    parser.add_argument("--train", type=int, metavar="STEPS", help="train this many steps on the images and watch the trainer and reward workers")
    args = parser.parse_args(argv)
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size {args.size!r} is not WIDTHxHEIGHT, e.g. 640x480")
    if args.prompts_per_step % args.processes:
        parser.error(f"--prompts-per-step {args.prompts_per_step} is not a multiple of --processes {args.processes}")

    import tasks.grounding  # noqa: F401  (registers the task)
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.tiny import build_untrained
    from vlm_grpo_ma.run.loop import draw_prompts, encode_sample
    from vlm_grpo_ma.task_api.registry import get_task
    from vlm_grpo_ma.task_api.streams import PromptStream

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        started = time.perf_counter()
        size = write_parquet(work / "images.parquet", args.images, width, height)
        print(f"wrote {args.images} JPEGs of {width}x{height} ({size / args.images / 1024:.0f} KiB each) in {time.perf_counter() - started:.0f} s")
        if args.train:
            return train_and_watch(work / "images.parquet", work, args.train, args.prompts_per_step, args.every)
        policy = load_policy(str(build_untrained(work / "tiny", seed=0)), attn_implementation="sdpa")
        samples = get_task("grounding").load("train", str(work / "images.parquet"))
        stream = PromptStream(samples, seed=0)
        others = [{}] * (args.processes - 1)
        exchange = lambda work: [work(), *others]  # noqa: E731  (process 0; the others skip nothing)
        rss, peak = memory_mib()
        print(f"loaded: {len(samples)} samples; RSS {rss:.0f} MiB, peak {peak:.0f} MiB")
        print("images drawn | encoded here | RSS MiB | peak RSS MiB | seconds")
        counters, started, encoded = Counter(), time.perf_counter(), 0
        while stream.position < args.images:
            _, prompts = draw_prompts(
                stream, args.prompts_per_step, lambda sample: encode_sample(policy, sample), counters,
                num_processes=args.processes, exchange=exchange,
            )  # fmt: skip
            encoded += sum(prompt is not None for prompt in prompts)
            del prompts  # the step is over
            if stream.position % args.every < args.prompts_per_step:
                rss, peak = memory_mib()
                print(f"{stream.position:12d} | {encoded:12d} | {rss:7.0f} | {peak:12.0f} | {time.perf_counter() - started:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
