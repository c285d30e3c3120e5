"""Per-step reward overhead: 256 grounding rewards through the reward worker processes (``score_answers``)
against calling the rewards in a thread pool (how ``score_rollout`` ran them before). Run from the repository
root:

    python scripts/bench_reward_pool.py [--workers 8] [--answers 256] [--repeats 7]

Both are warmed up first (the pool's workers started, the modules imported); it prints the median and the
minimum of the repeats, and the cold start of a fresh pool.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from vlm_grpo_ma.run.rewards import reward_weights_for, score_answers
from vlm_grpo_ma.task_api.registry import Completion, get_task
from vlm_grpo_ma.task_api.reward_pool import RewardPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--answers", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    task = get_task("grounding")
    samples = task.load("test")
    weights = reward_weights_for(task, {})
    jobs = []
    for i in range(args.answers):
        answer = f"<think>x</think><answer>[{i % 50}, 10, {60 + i % 40}, 90]</answer>"
        completion = Completion(thought="", answer=answer, input_sizes=((112, 112),), original_sizes=((112, 112),))
        jobs.append((task, weights, completion, samples[i % len(samples)]))

    def threads():
        with ThreadPoolExecutor(args.workers) as pool:
            return list(pool.map(lambda job: job[0].reward(job[2], job[3]), jobs))

    def processes():
        return score_answers(jobs, workers=args.workers)

    for name, run in (("threads", threads), ("processes", processes)):
        run()
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        print(f"{name:9s} workers={args.workers} {args.answers} grounding rewards: "
              f"median {statistics.median(seconds) * 1000:.1f} ms, min {min(seconds) * 1000:.1f} ms")
    started = time.perf_counter()
    pool = RewardPool()
    pool.run([(task.reward, jobs[0][2], jobs[0][3])], workers=args.workers, timeout_s=30.0)
    print(f"cold start of a pool + 1 job: {(time.perf_counter() - started) * 1000:.0f} ms")
    pool.close()


if __name__ == "__main__":
    main()
