"""Two processes train what one process trains: the data-parallel and fully-sharded equivalence check
(CPU, gloo).

Runs the same short GRPO-MA run (same seed, same global batch of prompts, warmup then linear decay of the
learning rate) on a freshly initialised tiny model: once as one process, once as two processes under
``accelerate launch`` (``--strategy ddp``: DDP; ``--strategy fsdp``: FSDP2, parameters, gradients and
optimizer state sharded), with AdamW and with plain SGD. It prints, per step, the learning rate
and grad norm each run logged, and the largest difference between the runs' final weights, next to how far
training moved them; then the same for a two-process run stopped a step early and resumed; then the bytes
of parameters, gradients, optimizer state and the frozen KL reference model each process holds, next to the one-process (unsharded)
figure (FSDP: each rank must hold at most 55% of it); under FSDP also the reduce-scatters of each optimizer
step, counted per rank (tests/fixtures/count_reduce_scatters.py): one per FSDP unit with trainable
parameters, with 2 micro-batches per process and step.

    .venv/bin/python scripts/check_two_process.py [--strategy ddp|fsdp] [--steps 3] [--mixture] [--machines 2] [--model DIR]
        [--keep DIR] [--set KEY=VALUE ...] [--no-resume] [--reference-cache DIR]

The stopped-and-resumed run is the two-process run itself, which also saves at step ``steps - 1``: a copy of
its folder without the last checkpoint resumes from there (one launch, not two). ``--reference-cache DIR``
keeps the untrained model and the one-process runs in DIR and reuses a run trained with the same overrides
(the test suite shares one between its checks: the DDP and FSDP checks train the same one-process run).

``--mixture`` trains a task mixture of the grounding scenes (with images, rewarded by answer length), the video
task's clips (with a video, rewarded the same way) and the code task (text-only prompts): at some steps one
process holds a micro-batch with a video or an image while the other holds none (the script prints each step's
prompts per process, V = video, I = image, T = text-only), so every process must issue the same collectives
whatever its rows hold. ``--machines 2`` launches the two processes as two
machines of one process each (``--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1``), the
multi-node launch, on this host.

``--engine vllm`` (after ``scripts/setup.sh --vllm``) samples with the vLLM engine in both processes, on the
mixture, at each ``--tensor-parallel-sizes`` (1: two engines; 2: one engine of both processes): it prints per
step and process the prefix-cache hit rate and the engine's log-prob gap to the trainer, seconds per step
beside the same launch with the HF engine, and compares the weights with a run whose trees are the same (TP 2:
one process; TP 1 under FSDP: the DDP launch; TP 1 under DDP: none, and it says why), then the run stopped a
step early and resumed.

``--set`` adds config overrides to every run, e.g. another objective: ``--set algorithm.advantage_estimator=grpo
algorithm.loss_aggregation=sequence algorithm.dynamic_sampling=true``.

Why both optimisers and a schedule: AdamW divides the gradient by its running scale, so its weights cannot see a
constant factor on the gradient (a wrong token normaliser, a gradient summed instead of averaged); SGD's can.
A constant learning rate cannot show a schedule stepped too often; warmup + decay does, in the logged rate
and in the weights.

Exit status 0 when every difference is within --tolerance (1e-5; grad norms and rates relative), else 1.
The run uses a reward every untrained sample varies on (answer length), so the weights do move.
The launch uses ``configs/accelerate/cpu-2proc.yaml`` (DDP; its header says why it names MULTI_GPU: in
accelerate 1.16 a MULTI_CPU launch goes through mpirun; with no GPU the torchrun workers run on the CPU, gloo)
or ``configs/accelerate/cpu-2proc-fsdp.yaml`` (FSDP2 through torch's fully_shard, vlm_grpo_ma/run/sharding.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_MODULE = ROOT / "tests" / "fixtures" / "answer_length_task.py"
COUNTER = ROOT / "tests" / "fixtures" / "count_reduce_scatters.py"  # the trainer, counting FSDP's reduce-scatters
LEARNING_RATES = {"adamw": 1e-3, "sgd": 0.5}  # both move the untrained model's weights by ~1e-3 in 3 steps
LAUNCH_CONFIGS = {"ddp": "configs/accelerate/cpu-2proc.yaml", "fsdp": "configs/accelerate/cpu-2proc-fsdp.yaml"}
MEMORY_PARTS = ("parameter", "gradient", "optimizer", "reference")  # reference: the frozen KL model
SHARDED_SHARE = 0.55  # FSDP over 2 processes: each holds about half (shards are padded to equal sizes)
# grounding scenes (images) + the video clips (videos) + code (text-only)
MIXTURE = "data.tasks={answer_length: 1, video_length: 1, code: 1}"


def run_overrides(model_dir: Path, steps: int, optimizer: str) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        f"train.steps={steps}",
        f"train.optimizer={optimizer}",
        f"train.learning_rate={LEARNING_RATES[optimizer]}",
        "train.warmup_steps=1",
        "train.max_grad_norm=1e6",  # no clipping: a clipped gradient would hide a constant factor from SGD too
        "train.lr_schedule=linear",
        "algorithm.kl_coef=0.05",  # a frozen reference model (sharded under FSDP) and its KL term in the loss
        "train.prompts_per_step=4",
        "train.micro_batch_rows=4",
        "train.num_threads=1",
        "train.checkpoint_every=1000",
        "rollout.num_thoughts=2",
        "rollout.num_answers=2",
        "rollout.max_thought_tokens=8",
        "rollout.max_answer_tokens=6",
        "logging.progress_bar=false",
        "logging.report_to=[]",
        "train.eval_every=0",
        "data.task=answer_length",
        f"data.task_modules=[{TASK_MODULE}]",
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    out_dir: Path, overrides: list[str], processes: int, *, resume: bool = False, strategy: str = "ddp", count: bool = False,
    machines: int = 1,
) -> None:
    """Train into ``out_dir``; ``count``: through COUNTER, which logs the reduce-scatters of each step;
    ``machines``: the processes launched as that many machines (one ``accelerate launch`` each) on this host."""
    python = sys.executable
    trainer = [str(COUNTER)] if count else ["-m", "vlm_grpo_ma.train"]
    arguments = ["--output-dir", str(out_dir), *overrides] + (["--resume"] if resume else [])
    if processes == 1:
        commands = [[python, *trainer, *arguments]]
    else:
        launcher = [python, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / LAUNCH_CONFIGS[strategy]),
                    "--num_processes", str(processes)]  # fmt: skip
        if machines > 1:  # the same launch on each machine, its rank and the rank-0 machine's address named
            port = free_port()
            commands = [
                [*launcher, "--num_machines", str(machines), "--machine_rank", str(rank),
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *trainer, *arguments]
                for rank in range(machines)
            ]  # fmt: skip
        else:
            commands = [[*launcher, *trainer, *arguments]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    running = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    outputs = [process.communicate() for process in running]
    for process, (stdout, stderr) in zip(running, outputs, strict=True):
        if process.returncode != 0:
            sys.stderr.write(stdout[-4000:] + stderr[-4000:])
            raise SystemExit(f"training with {processes} process(es) on {machines} machine(s) failed (exit {process.returncode})")


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    from vlm_grpo_ma.run.checkpoint import latest_checkpoint

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def logged(run_dir: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_abs_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def memory_figures(run_dir: Path, processes: int) -> list[dict[str, float]]:
    """Per rank, the bytes of parameters, gradients and optimizer state it held after the last step."""
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return [{part: last[f"memory/rank{rank}_{part}_bytes"] for part in MEMORY_PARTS} for rank in range(processes)]


def predicted_bytes(model_dir: Path, overrides: list[str], strategy: str) -> dict[str, int]:
    """What the memory model (vlm_grpo_ma.run.memory_model) predicts each of 2 processes holds after a step."""
    from vlm_grpo_ma.model.architectures import architecture_of
    from vlm_grpo_ma.run.config_files import load_config
    from vlm_grpo_ma.run.memory_model import estimate

    e = estimate(architecture_of(str(model_dir)), load_config(None, overrides), 2, strategy)
    held = {"parameter": e.weights, "gradient": e.gradients_between_steps, "optimizer": e.optimizer, "reference": e.reference}
    return {**held, "total": sum(held.values())}


def check_memory(one: Path, two: Path, strategy: str, predicted: dict[str, int] | None = None) -> bool:
    """Prints each rank's bytes next to the one-process figure (and the memory model's prediction); FSDP: each
    rank holds about half."""
    (unsharded,), ranks = memory_figures(one, 1), memory_figures(two, 2)
    print(f"  bytes held per process ({strategy}, 2 processes) vs one process:")
    ok = True
    for part in (*MEMORY_PARTS, "total"):
        full = sum(unsharded.values()) if part == "total" else unsharded[part]
        held = [sum(r.values()) if part == "total" else r[part] for r in ranks]
        shares = [h / full if full else 0.0 for h in held]
        model = f" | memory model {predicted[part]:>12,} ({predicted[part] / max(held[0], 1) - 1:+.2%} of rank 0)" if predicted else ""
        print(f"    {part:<10} one process {full:>12,.0f} | rank 0 {held[0]:>12,.0f} ({shares[0]:.1%}) | rank 1 {held[1]:>12,.0f} ({shares[1]:.1%}){model}")
        if strategy == "fsdp" and full and max(shares) > SHARDED_SHARE:
            ok = False
    return ok


def check_reduce_scatters(run_dir: Path, processes: int) -> bool:
    """FSDP: gradients are reduce-scattered in the backward of each step's last micro-batch only (the earlier
    ones accumulate locally), at least once per FSDP unit with trainable parameters. Prints the counts."""
    ok = True
    print("  reduce-scatters per optimizer step, [after micro-batch 1, 2, ...] (FSDP units with trainable parameters):")
    for rank in range(processes):
        steps = [json.loads(line) for line in (run_dir / f"reduce_scatters.rank{rank}.jsonl").read_text().splitlines()]
        cells = ", ".join(f"{sum(s['per_micro_batch'])} {s['per_micro_batch']}" for s in steps)
        print(f"    rank {rank}: {cells} ({steps[0]['units_with_gradients'] if steps else '?'} units)")
        ok = ok and bool(steps) and all(
            len(s["per_micro_batch"]) >= 2 and not any(s["per_micro_batch"][:-1])
            and s["per_micro_batch"][-1] >= s["units_with_gradients"] > 0
            for s in steps
        )  # fmt: skip
    print(f"  gradients reduced once per step (in the last micro-batch's backward only): {'yes' if ok else 'NO'}")
    return ok


def step_shares(overrides: list[str], steps: int, processes: int = 2) -> list[list[str]]:
    """Per step, per process, its prompts as V (with a video), I (with an image) or T (text-only), in
    micro-batch order: the run's own prompt stream, replayed."""
    from vlm_grpo_ma.run.config_files import load_config
    from vlm_grpo_ma.run.setup import load_prompt_stream

    cfg = load_config(None, overrides)
    _, stream = load_prompt_stream(cfg)
    share = cfg.train.prompts_per_step // processes
    shares = []
    for _ in range(steps):
        kinds = "".join("V" if sample.videos else "I" if sample.images else "T" for sample in stream.take(cfg.train.prompts_per_step))
        shares.append([kinds[rank * share : (rank + 1) * share] for rank in range(processes)])
    return shares


def one_process_run(work: Path, overrides: list[str], cache: Path | None) -> Path:
    """The one-process run of ``overrides``: trained into ``work``, or taken from ``cache`` where a finished run
    of the same overrides is kept there (its folder is named by their hash)."""
    if cache is None:
        one = work / "one-process"
    else:
        one = cache / ("one-process-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:16])
        if (one / "finished").is_file():
            print(f"  one process: the run kept in {one}")
            return one
        shutil.rmtree(one, ignore_errors=True)  # an unfinished run from an interrupted check
    launch(one, overrides, 1)
    (one / "finished").write_text("")
    return one


def check_optimizer(
    work: Path, model_dir: Path, steps: int, optimizer: str, tolerance: float, strategy: str = "ddp", extra: tuple[str, ...] = (),
    machines: int = 1, resume: bool = True, cache: Path | None = None,
) -> bool:
    """One optimiser: one process vs two, and (``resume``) two straight vs two stopped and resumed. Prints the
    figures."""
    from safetensors.torch import load_file

    overrides = [*run_overrides(model_dir, steps, optimizer), *extra]
    two, resumed = work / f"{optimizer}-two-{strategy}", work / f"{optimizer}-two-{strategy}-resumed"
    one = one_process_run(work / optimizer, overrides, cache)
    # the resume's starting point: the two-process run also saves at step steps - 1 (train.steps, which fixes
    # the schedule, is the same); a copy of its folder without the last checkpoint continues from there
    saves = [f"train.checkpoint_every={steps - 1}", "train.keep_checkpoints=5"] if resume else []
    launch(two, [*overrides, *saves], 2, strategy=strategy, count=strategy == "fsdp", machines=machines)
    if resume:
        shutil.copytree(two, resumed)
        shutil.rmtree(resumed / "checkpoints" / f"step-{steps:06d}")
        launch(resumed, overrides, 2, resume=True, strategy=strategy, machines=machines)
    start = load_file(Path(model_dir) / "model.safetensors")
    w_one, w_two = final_weights(one), final_weights(two)
    moved, difference = max_abs_difference(w_one, start), max_abs_difference(w_one, w_two)
    resume_difference = max_abs_difference(w_two, final_weights(resumed)) if resume else 0.0
    rates = {run: logged(run, "train/learning_rate") for run in (one, two)}
    norms = {run: logged(run, "train/grad_norm") for run in (one, two)}
    rate_difference = max_relative_difference(rates[one], rates[two])
    norm_difference = max_relative_difference(norms[one], norms[two])
    print(f"{optimizer}: step | learning rate 1 proc, 2 procs | grad norm 1 proc, 2 procs")
    for step in range(max(len(rates[one]), len(rates[two]))):
        cells = [values[step] if step < len(values) else math.nan for values in (rates[one], rates[two], norms[one], norms[two])]
        print(f"  {step + 1} | {cells[0]:.6e} {cells[1]:.6e} | {cells[2]:.6e} {cells[3]:.6e}")
    print(f"  largest weight change from the start (one process): {moved:.3e}")
    print(f"  largest weight difference, one vs two processes:    {difference:.3e}")
    print(f"  learning rate / grad norm, largest relative difference: {rate_difference:.3e} / {norm_difference:.3e}")
    if resume:
        print(f"  two processes, straight vs stopped and resumed:     {resume_difference:.3e}")
    parts_ok = True
    if MIXTURE in extra:  # the run's prompts: a process without an image or video where the other has one
        shares = step_shares(overrides, steps)
        print("  prompts per process and step (V video, I image, T text-only), rank 0 | rank 1: " + ", ".join(" | ".join(s) for s in shares))
        differing = sum(a != b for ranks in shares for a, b in zip(*ranks, strict=True))
        with_video = sum("V" in share for ranks in shares for share in ranks)
        print(f"  micro-batches where the processes differ in what they hold (video, image, text): {differing}")
        print(f"  micro-batches with a video: {with_video}")
        parts_ok = differing > 0 and with_video > 0
    if "algorithm.dynamic_sampling=true" in extra:  # the draws each step made, which both runs must share
        drawn = {run: logged(run, "signal/resampled_prompts") for run in (one, two)}
        print(f"  prompts drawn again (dynamic sampling), 1 proc / 2 procs: {drawn[one]} / {drawn[two]}")
        parts_ok = drawn[one] == drawn[two]
    parts_ok = check_memory(one, two, strategy, predicted_bytes(model_dir, overrides, strategy)) and parts_ok
    if strategy == "fsdp":
        parts_ok = check_reduce_scatters(two, 2) and parts_ok
    return (
        max(difference, resume_difference, rate_difference, norm_difference) <= tolerance and moved > 10 * tolerance
        and parts_ok
    )


def per_process(run_dir: Path, key: str, processes: int = 2) -> list[list[float]]:
    """Per step, each process's ``rollout/process{i}/{key}`` (the vLLM engine in a launch logs them)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r[f"rollout/process{i}/{key}"] for i in range(processes)] for r in records if r["step"] > 0]


def seconds_per_step(run_dir: Path) -> float:
    """The mean wall time of the steps after the first (the first holds the engines' and caches' warm-up)."""
    seconds = [json.loads(line)["time/step_seconds"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["step"] > 1]  # fmt: skip
    return sum(seconds) / len(seconds)


def check_vllm_engines(
    work: Path, model_dir: Path, steps: int, optimizer: str, tolerance: float, strategy: str, tensor_parallel_size: int,
    resume: bool, cache: Path | None, extra: tuple[str, ...] = (),
) -> bool:
    """rollout.engine=vllm in both processes (``tensor_parallel_size`` 1: two engines; 2: one engine of both):
    per step and process the prefix-cache hit rate and the engine's log-prob gap to the trainer, seconds per
    step beside the HF engine on the same launch, and the weights against a run whose trees are equal: TP 2
    samples the one-process tree (the same requests under the same seed), so against one process; TP 1's two
    engines sample with two seeds, which no one-process run repeats, so FSDP is compared with the DDP launch of
    the same engines, and DDP with nothing (its gap and hit rate are the check). ``resume``: the run stopped a
    step early and resumed repeats the straight run (a fresh engine from the checkpoint's weights, the step's
    seeds)."""
    overrides = [*run_overrides(model_dir, steps, optimizer), MIXTURE, "rollout.engine=vllm", "rollout.max_thought_tokens=40",
                 *(o for o in extra if o != MIXTURE), f"rollout.vllm_tensor_parallel_size={tensor_parallel_size}"]  # fmt: skip
    name = f"{optimizer}-vllm-tp{tensor_parallel_size}"
    two, resumed, hf = work / f"{name}-{strategy}", work / f"{name}-{strategy}-resumed", work / f"{name}-{strategy}-hf"
    saves = [f"train.checkpoint_every={steps - 1}", "train.keep_checkpoints=5"] if resume else []
    launch(two, [*overrides, *saves], 2, strategy=strategy)
    launch(hf, [*overrides, "rollout.engine=hf"], 2, strategy=strategy)
    hit_rates, gaps = per_process(two, "prefix_cache_hit_rate"), per_process(two, "logprob_gap_max")
    print(f"vllm, {strategy}, tensor-parallel size {tensor_parallel_size} ({2 // tensor_parallel_size} engine(s)), {optimizer}:"
          " step | hit rate process 0, 1 | log-prob gap process 0, 1")  # fmt: skip
    for step, (rates, step_gaps) in enumerate(zip(hit_rates, gaps, strict=True), start=1):
        print(f"  {step} | {rates[0]:.3f} {rates[1]:.3f} | {step_gaps[0]:.2e} {step_gaps[1]:.2e}")
    vllm_seconds, hf_seconds = seconds_per_step(two), seconds_per_step(hf)
    print(f"  seconds per step (steps 2-{steps}): vllm {vllm_seconds:.2f}, hf {hf_seconds:.2f} (vllm / hf {vllm_seconds / hf_seconds:.2f})")
    ok = len(hit_rates) == steps and min(min(r) for r in hit_rates) > 0.5 and max(max(g) for g in gaps) < 1e-4
    from safetensors.torch import load_file

    start, w_two = load_file(Path(model_dir) / "model.safetensors"), final_weights(two)
    moved = max_abs_difference(start, w_two)  # the untrained folder has no tied lm_head key; an FSDP checkpoint does
    print(f"  largest weight change from the start: {moved:.3e}")
    ok = ok and moved > 10 * tolerance
    reference = None
    if tensor_parallel_size == 2:
        reference = one_process_run(work / name, [o for o in overrides if "tensor_parallel" not in o], cache)
        print("  trees equal to one process's (one engine of both processes, the same requests and seed): weights vs one process")
    elif strategy == "fsdp":
        reference = work / f"{name}-ddp"
        launch(reference, overrides, 2, strategy="ddp")
        print("  two engines sample with two seeds, which no one-process run repeats: weights vs the DDP launch of the same engines")
    else:
        print("  two engines sample with two seeds, which no one-process run repeats: no weight comparison (FSDP compares with this launch)")
    if reference is not None:
        difference = max_abs_difference(final_weights(reference), w_two)
        print(f"  largest weight difference: {difference:.3e}")
        ok = ok and difference <= tolerance
    if resume:
        shutil.copytree(two, resumed)
        shutil.rmtree(resumed / "checkpoints" / f"step-{steps:06d}")
        launch(resumed, overrides, 2, resume=True, strategy=strategy)
        resume_difference = max_abs_difference(w_two, final_weights(resumed))
        print(f"  straight vs stopped and resumed (a fresh engine from the checkpoint): {resume_difference:.3e}")
        ok = ok and resume_difference <= tolerance
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=sorted(LAUNCH_CONFIGS), default="ddp", help="how two processes split the work")
    parser.add_argument("--steps", type=int, default=3, help="training steps (>= 2)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=sorted(LEARNING_RATES))
    parser.add_argument("--keep", help="keep the runs in this folder (default: a temporary folder)")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="train this model folder (e.g. a Qwen3.5 check_real_size.py kept) instead of an untrained embedded one")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides added to every run")
    parser.add_argument("--mixture", action="store_true", help="train grounding scenes (images) + code (text-only) mixed")
    parser.add_argument("--machines", type=int, choices=(1, 2), default=1, help="launch the two processes as two machines")
    parser.add_argument("--no-resume", action="store_true", help="skip the stopped-and-resumed run (a launch fewer)")
    parser.add_argument("--reference-cache", type=Path, metavar="DIR",
                        help="keep the untrained model and the one-process runs in DIR; reuse a run with the same overrides")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="vllm: the vLLM engine in both processes (hit rate, gap, seconds beside hf; scripts/setup.sh --vllm)")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1, 2], choices=(1, 2),
                        help="--engine vllm: rollout.vllm_tensor_parallel_size values to check")
    args = parser.parse_args(argv)
    if args.model and not (args.model / "model.safetensors").is_file():
        parser.error(f"--model {args.model}: no model.safetensors there (give a saved model folder)")
    from vlm_grpo_ma.model.tiny import build_untrained

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        cache = args.reference_cache
        model_dir = args.model or (cache or work) / "untrained"
        if not (model_dir / "model.safetensors").is_file():
            build_untrained(model_dir, seed=0)
        extra = (*([MIXTURE] if args.mixture else []), *args.set)
        print(f"strategy: {args.strategy}; machines: {args.machines}; steps: {args.steps} (warmup 1, then linear decay), global "
              f"batch: 4 prompts x 2 thoughts x 2 answers, seed 0, tolerance {args.tolerance:g}" + (f"; overrides: {' '.join(extra)}" if extra else ""))
        if args.engine == "vllm":
            results = [
                check_vllm_engines(work, model_dir, args.steps, name, args.tolerance, args.strategy, size, not args.no_resume, cache, extra)
                for name in args.optimizers for size in args.tensor_parallel_sizes
            ]
        else:
            results = [
                check_optimizer(work, model_dir, args.steps, name, args.tolerance, args.strategy, extra, args.machines, not args.no_resume, cache)
                for name in args.optimizers
            ]
    ok = all(results)
    print("equivalent" if ok else "NOT equivalent")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
