"""A vqa_open run scored by a judge served with `vllm serve` on this machine (the vLLM setup:
`scripts/setup.sh --vllm`), and its judge figures per step: requests, cache hit rate, seconds, failures and
unreadable verdicts (docs/JUDGE.md, "Measured").

    .venv/bin/python scripts/judge_vllm_run.py                      # 4 steps, ~4 min on 2 CPU cores
    .venv/bin/python scripts/judge_vllm_run.py --steps 2 --port 8012

The policy is the embedded model warm-started on vqa_open (vlm_grpo_ma/assets/tiny-qwen2.5-vl-vqa_open, the
start of configs/tiny-vqa_open.yaml), so that its answers carry answer tags for the judge to read. The judge
is the embedded tiny model: no judge of any skill fits here, so its verdicts are constrained to yes/no
(`judge.constrain_verdict=true`) and are noise; the figures are the plumbing's (HTTP, concurrency, the cache),
which is what this script measures. vLLM's own CLI (`vllm serve`) reads the package version of a `vllm`
distribution the CPU build does not install under that name, so the server starts as
`python -m vllm.entrypoints.openai.api_server`, the module `vllm serve` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR  # noqa: E402


def wait_for_server(url: str, server: subprocess.Popen, limit_s: float) -> None:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if server.poll() is not None:
            raise SystemExit(f"the vLLM server exited with code {server.returncode}; see its log")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the vLLM server did not answer at {url} within {limit_s:g} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--judge-model-dir", default=str(TINY_MODEL_DIR), help="the served judge's model folder")
    parser.add_argument("--config", default="configs/tiny-vqa_open.yaml", help="the run's preset")
    parser.add_argument("--output-dir", default="runs/judge-vllm")
    args = parser.parse_args(argv)
    python, out = sys.executable, Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(out / "vllm_serve.log", "w") as log:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.judge_model_dir, "--served-model-name",
             "judge", "--dtype", "float32", "--enforce-eager", "--port", str(args.port), "--max-model-len", "2048",
             "--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_for_server(url, server, limit_s=300)
        run_dir = out / "run"
        subprocess.run(
            [python, "-m", "vlm_grpo_ma.train", "--config", args.config,
             f"judge.base_url={url}", "judge.model=judge", "judge.constrain_verdict=true", f"train.steps={args.steps}",
             "train.num_threads=1", "train.eval_every=0", "logging.report_to=[]", "logging.progress_bar=false",
             "--output-dir", str(run_dir), "--overwrite"],
            check=True, cwd=ROOT,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "judge/requests" in row]
    print("step  queries  requests  cache_hit_rate  judge_s  failures  unreadable  reward/accuracy")
    for row in rows:
        print(f"{row['step']:>4}  {row['judge/queries']:>7g}  {row['judge/requests']:>8g}"
              f"  {row['judge/cache_hit_rate']:>14.3f}  {row['judge/seconds']:>7.2f}  {row['judge/failures']:>8g}"
              f"  {row['judge/unreadable']:>10g}  {row['reward/accuracy']:>15.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
