"""Score HumanEval's canonical solutions and its bare prompts through the code task's reward.

Every canonical solution must get all_passed = 1 (164/164) and no bare prompt (an answer that repeats the
prompt's stub, a function that returns None) may get all_passed = 1. A bare prompt's pass_rate is not
always 0: asserts such as ``candidate([]) == None`` or ``assert not candidate(...)`` pass with a stub
(the per-assert split of check(), see tasks/code.py). Run from the repository root:

    python scripts/check_humaneval.py [--workers 2] [--limit N]

It prints the counts, the slowest runs, the sandbox layers applied, and the wall time; the exit status is 0
only when both figures are as expected.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks._sandbox import default_isolation  # noqa: E402
from tasks.code import FAILURE_PARTS  # noqa: E402
from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task  # noqa: E402


def completion_for(answer: str) -> Completion:
    return Completion(thought="<think>the reference</think>", answer=f"<answer>\n{answer}\n</answer>")


def score(sample: Sample, answer: str) -> tuple[str, dict[str, float], float]:
    start = time.monotonic()
    parts = get_task("code").reward(completion_for(answer), sample)
    return sample.id, parts, time.monotonic() - start


def check(workers: int = 2, limit: int | None = None) -> dict:
    """Score canonical solutions and bare prompts; returns the figures (see the module docstring)."""
    samples = get_task("code").load("test")[:limit]
    start = time.monotonic()
    isolation = default_isolation()
    jobs = [(sample, sample.meta["reference_answer"]) for sample in samples]
    # The bare prompt: the answer is the prompt itself (a complete function whose body is its docstring).
    jobs += [(sample, sample.answer.prompt) for sample in samples]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: score(*job), jobs))
    canonical, bare = results[: len(samples)], results[len(samples) :]
    return {
        "problems": len(samples),
        "canonical_all_passed": sum(parts["all_passed"] == 1.0 for _, parts, _ in canonical),
        "canonical_failures": [(sid, parts) for sid, parts, _ in canonical if parts["all_passed"] != 1.0],
        "bare_all_passed": sum(parts["all_passed"] == 1.0 for _, parts, _ in bare),
        "bare_mean_pass_rate": sum(parts["pass_rate"] for _, parts, _ in bare) / max(1, len(bare)),
        "bare_with_passing_asserts": [sid for sid, parts, _ in bare if parts["pass_rate"] > 0],
        "failure_parts_seen": sorted(
            {name for _, parts, _ in results for name in FAILURE_PARTS + ("sandbox_error",) if parts[name]}
        ),
        "slowest": sorted(((seconds, sid) for sid, _, seconds in canonical), reverse=True)[:3],
        "isolation": isolation,
        "wall_s": time.monotonic() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    args = parser.parse_args()
    figures = check(args.workers, args.limit)
    n = figures["problems"]
    print(f"canonical solutions: {figures['canonical_all_passed']}/{n} all tests passed")
    for sid, parts in figures["canonical_failures"]:
        print(f"  FAILED {sid}: {parts}")
    print(
        f"bare prompts: {figures['bare_all_passed']}/{n} all tests passed, mean pass_rate "
        f"{figures['bare_mean_pass_rate']:.4f} (asserts a stub passes in {len(figures['bare_with_passing_asserts'])} "
        f"problems: {', '.join(figures['bare_with_passing_asserts'])})"
    )
    print(f"failure parts seen: {figures['failure_parts_seen'] or 'none'}")
    print(f"slowest canonical runs: {', '.join(f'{sid} {s:.2f}s' for s, sid in figures['slowest'])}")
    print(f"isolation: {figures['isolation']}")
    print(f"{2 * n} runs with {args.workers} workers in {figures['wall_s']:.1f} s")
    ok = (
        figures["canonical_all_passed"] == n
        and figures["bare_all_passed"] == 0
        and not figures["failure_parts_seen"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
