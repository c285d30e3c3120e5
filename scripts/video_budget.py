"""Frames and video tokens per sample against the video budget, and decode time per clip.

    python scripts/video_budget.py [--clips 50] [--long]

For the embedded test clips (``data/video``: 8 frames at 2 fps, 84x84) and, with ``--long``, a generated 20 s
clip at 30 fps, 640x360, it prints per budget (model.video_fps, video_max_frames, video_max_pixels) the frames
the model sees, the video tokens each prompt holds (on the embedded Qwen2.5-VL: temporal patches x merged
patches) and the median decode time per clip with PyAV (``task_api/videos.py``); decord as well where it is
importable (it is not a dependency: ``pip install decord`` into the venv to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import av
import numpy as np

from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.task_api.registry import Sample
from vlm_grpo_ma.task_api.videos import VideoBudget, decode_video

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = [VideoBudget(2.0, 16, 128 * 28 * 28), VideoBudget(1.0, 16, 128 * 28 * 28), VideoBudget(2.0, 4, 56 * 56), VideoBudget(4.0, 32, 448 * 448)]


def long_clip(folder: Path) -> str:
    """20 s at 30 fps, 640x360: a moving bar, H.264."""
    path = folder / "long.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 640, 360, "yuv420p"
        for i in range(600):
            frame = np.full((360, 640, 3), 20, np.uint8)
            frame[:, (i * 3) % 600 : (i * 3) % 600 + 40] = (200, 80, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def decord_time(path: str, count: int) -> float | None:
    try:
        import decord
    except ImportError:
        return None
    started = time.perf_counter()
    reader = decord.VideoReader(path)
    indices = np.linspace(0, len(reader) - 1, count).round().astype(int).tolist()
    reader.get_batch(indices).asnumpy()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=50)
    parser.add_argument("--long", action="store_true", help="also a 20 s 640x360 clip at 30 fps")
    args = parser.parse_args()
    policy = load_policy("tiny", attn_implementation="sdpa")
    rows = [json.loads(line) for line in (ROOT / "data" / "video" / "test.jsonl").read_text().splitlines()][: args.clips]
    sets = {"embedded": [str(ROOT / "data" / "video" / row["video"]) for row in rows]}
    if args.long:
        sets["long"] = [long_clip(Path(tempfile.mkdtemp()))] * 5
    merge = policy.model.config.vision_config.spatial_merge_size
    for name, paths in sets.items():
        for budget in BUDGETS:
            policy.video_budget = budget
            frames, tokens, times, decord_times = [], [], [], []
            for path in paths:
                started = time.perf_counter()
                video = decode_video(path, budget, factor=policy.patch_factor)
                times.append(time.perf_counter() - started)
                decord_seconds = decord_time(path, len(video.frame_indices))
                if decord_seconds is not None:
                    decord_times.append(decord_seconds)
                prompt = encode_prompt(policy, Sample("video", "v", "Which way?", (), "A", videos=(path,)), "")
                frames.append(prompt.video_frames[0])
                tokens.append(int(prompt.video_grid_thw.prod(-1).sum()) // merge**2)
            line = (
                f"{name:8s} fps {budget.fps:g} max_frames {budget.max_frames:3d} max_pixels {budget.max_pixels:7d}:"
                f" frames {min(frames)}-{max(frames)}, video tokens {min(tokens)}-{max(tokens)} per sample,"
                f" PyAV decode {1000 * statistics.median(times):.1f} ms/clip"
            )
            if decord_times:
                line += f", decord {1000 * statistics.median(decord_times):.1f} ms/clip"
            print(line, flush=True)


if __name__ == "__main__":
    main()
