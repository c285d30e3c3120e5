"""Bad clips mid-run (issue 45): every clip or frame list that cannot become the model's frames is a
VideoLoadError naming it (skipped and counted by the trainer, scored 0 by evaluation), never another error;
raw streams decode; decoding holds one full-size frame, not all of them; a long clip's cut is said; a frame
list's own rate is used; a broken file is warned about once."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import struct
from collections import Counter
from pathlib import Path

import av
import pytest
from PIL import Image
from video_clips import STEP, frame_array, square_column, write_clip

from vlm_grpo_ma.run import evaluation
from vlm_grpo_ma.run.loop import draw_prompts
from vlm_grpo_ma.task_api import FrameList, get_task
from vlm_grpo_ma.task_api import videos as video_module
from vlm_grpo_ma.task_api.registry import Sample, count_load_skips
from vlm_grpo_ma.task_api.streams import PromptStream
from vlm_grpo_ma.task_api.videos import VideoBudget, VideoLoadError, decode_video

BUDGET = VideoBudget()  # the trainer's default: 2 fps, 16 frames, 100352 pixels
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "video"


def _raw_h264(path, frames: int, width: int = 56, height: int = 56):
    """A raw H.264 elementary stream (no container: no frame count, cannot seek), frame i as ``frame_array(i)``."""
    return write_clip(path, frames=frames, fps=4, width=width, height=height, container_format="h264")


def _error(video, budget=BUDGET) -> str:
    with pytest.raises(VideoLoadError) as error:
        decode_video(video, budget)
    return str(error.value)


# ---------------------------------------------------------------------------------------------- sizes


def test_frames_the_resize_rule_refuses_are_a_video_load_error_naming_the_video_and_size(tmp_path):
    """qwen-vl-utils refuses an aspect ratio over 200 and sizes an 8000x40 frame to 0 rows under the default
    max_pixels. Planted: the target size computed without the except and the zero check -> qwen-vl-utils'
    ValueError and torchvision's/PIL's error escaped, not VideoLoadError; failed here."""
    wide = str(write_clip(tmp_path / "wide.mp4", frames=4, width=2000, height=8))
    flat = str(write_clip(tmp_path / "flat.mp4", frames=4, width=8000, height=40))
    cases = [
        (wide, "2000x8"),
        (flat, "8000x40"),
        (FrameList([Image.new("RGB", (1, 10000))] * 4), "1x10000"),
        (FrameList([Image.new("RGB", (8000, 40))] * 4), "8000x40"),
    ]
    for video, size in cases:
        message = _error(video)
        name = video if isinstance(video, str) else "[4 frames]"
        assert name in message and size in message, message


def test_a_budget_under_one_vision_token_is_a_video_load_error_not_an_assert(tmp_path):
    """qwen-vl-utils' smart_resize asserts max_pixels >= factor x factor; 1000 pixels hold no 32x32 token.
    Planted: AssertionError left out of _Fitter._target's except -> the AssertionError escaped; failed here."""
    clip = str(write_clip(tmp_path / "clip.mp4", frames=4, width=56, height=56))
    with pytest.raises(VideoLoadError, match="clip.mp4.*56x56"):
        decode_video(clip, VideoBudget(max_pixels=1000), factor=32)


def test_a_stream_that_changes_size_is_resized_to_its_first_frames_size(tmp_path):
    """4 frames of 56x56 then 4 of 112x84 in one raw stream: every frame comes out 56x56 (the first frame's
    size), the later ones scaled from their own. Planted: each frame resized to its own target size -> frames of
    two sizes, np.stack's ValueError; failed here."""
    first = _raw_h264(tmp_path / "a.h264", 4).read_bytes()
    second = _raw_h264(tmp_path / "b.h264", 4, width=112, height=84).read_bytes()
    (tmp_path / "switch.h264").write_bytes(first + second)
    # a raw stream has no timing: FFmpeg's 25 fps; the budget's 25 fps keeps every frame
    video = decode_video(str(tmp_path / "switch.h264"), VideoBudget(fps=25.0, max_frames=8, max_pixels=56 * 56))
    assert video.frame_indices == list(range(8)) and tuple(video.frames.shape) == (8, 3, 56, 56)
    # square_column scales to 56 wide: frame i of the 112-wide part has the square at (2 + STEP * i) / 2
    assert [square_column(f) for f in video.frames[:4]] == pytest.approx([2 + STEP * i for i in range(4)], abs=1)
    assert [square_column(f) for f in video.frames[4:]] == pytest.approx([(2 + STEP * i) / 2 for i in range(4)], abs=1)


# ---------------------------------------------------------------------------------------------- cut files


def _faststart_mp4(path):
    """An 8-frame mp4 with its header (moov) before the frames (mdat)."""
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for i in range(8):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_array(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


def test_a_cut_mp4_and_an_avi_promising_more_frames_are_video_load_errors(tmp_path):
    """An mp4 cut inside its header (its stream has no decoder: PyAV's codec_context is None), one cut after its
    header (8 frames said, none there), an AVI whose header says 10 frames when 1 is there. Planted: no check of
    the missing decoder -> AttributeError ('NoneType' object has no attribute 'width'); no check of fewer than 2
    decoded frames -> qwen-vl-utils' 'nframes should in interval [2, 0]', not the counts; both failed here."""
    data = _faststart_mp4(tmp_path / "whole.mp4")
    assert data.find(b"moov") < data.find(b"stsd") < data.find(b"mdat")
    (tmp_path / "in-header.mp4").write_bytes(data[: data.find(b"stsd") - 4])  # before the sample description
    (tmp_path / "after-header.mp4").write_bytes(data[: data.find(b"mdat") + 4])
    with av.open(str(tmp_path / "ten.avi"), "w") as container:  # intra-only frames, one chunk each
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuvj420p"
        for i in range(10):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_array(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    avi = (tmp_path / "ten.avi").read_bytes()
    frames_start = avi.find(b"movi")
    first_chunk = avi.find(b"00dc", frames_start)
    (tmp_path / "one.avi").write_bytes(avi[: avi.find(b"00dc", first_chunk + 8)])  # header + the first frame
    assert struct.unpack("<I", avi[avi.find(b"avih") + 24 : avi.find(b"avih") + 28])[0] == 10  # dwTotalFrames
    messages = {name: _error(str(tmp_path / name)) for name in ("in-header.mp4", "after-header.mp4", "one.avi")}
    assert "no decoder" in messages["in-header.mp4"]
    assert "says 8 frames but 0 decode" in messages["after-header.mp4"]
    assert "says 10 frames but 1 decode" in messages["one.avi"]
    assert all(name in message for name, message in messages.items())


def test_a_raw_h264_stream_decodes(tmp_path):
    """No container: no frame count (the packets are counted) and no seeking back. Planted: the file seeked
    back to the start after counting instead of opened again -> 'Operation not permitted'; failed here."""
    path = _raw_h264(tmp_path / "clip.h264", 8)
    video = decode_video(str(path), VideoBudget(fps=25.0, max_frames=8, max_pixels=56 * 56))
    assert video.total_frames == 8 and video.source_fps == 25.0  # FFmpeg's rate for a stream without timing
    assert video.frame_indices == list(range(8))
    assert [square_column(f) for f in video.frames] == pytest.approx([2 + STEP * i for i in range(8)], abs=1)


# ---------------------------------------------------------------------------------------------- memory


def test_a_frame_list_reads_only_the_frames_it_keeps(tmp_path, monkeypatch):
    """600 frame paths at the default budget: 16 kept, 16 images decoded (the frames one file each, so a cached
    or skipped decode would show). Planted: every frame decoded before the choice -> 600; failed here."""
    paths = []
    for i in range(600):
        paths.append(str(tmp_path / f"{i:03d}.png"))
        Image.new("RGB", (28, 28), (i % 256, 0, 0)).save(paths[-1])
    decoded = []
    real = video_module.decode_image
    monkeypatch.setattr(video_module, "decode_image", lambda image: decoded.append(image) or real(image))
    video = decode_video(paths, BUDGET)
    assert len(video.frame_indices) == 16 and decoded == [paths[i] for i in video.frame_indices]
    assert [int(f[0, 0, 0]) for f in video.frames] == [i % 256 for i in video.frame_indices]


_PEAK_SCRIPT = """
import json, resource, sys
import torch
from vlm_grpo_ma.task_api.videos import VideoBudget, decode_video
path, budget, warm_ups = json.loads(sys.argv[1])
torch.set_num_threads(1)
for video, warm_up in warm_ups:
    decode_video(video, VideoBudget(**warm_up))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
decode_video(path, VideoBudget(**budget))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def _decode_peak_bytes(path: str, budget: VideoBudget, warm_ups: list[tuple[str, VideoBudget]]) -> int:
    """The peak resident memory that decoding ``path`` under ``budget`` adds to the ``warm_ups`` decodes before
    it, in a fresh Python process (a fork of the test session, which holds threads of torch and vLLM, can
    deadlock; and what the session held does not count)."""
    import dataclasses
    import json
    import subprocess
    import sys

    argument = json.dumps([path, dataclasses.asdict(budget), [(video, dataclasses.asdict(b)) for video, b in warm_ups]])
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, argument], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def test_decoding_holds_one_full_size_frame_not_all_the_kept_ones(tmp_path):
    """A 32-frame 1280x720 clip, its frames resized to 112x56: keeping all 32 takes no more memory than keeping 2
    of the same decode (the decoder's reference frames and one full-size RGB frame are the peak either way),
    within 5 full-size frames (0.4-2 measured: allocator noise). The warm-ups before it reach the decoder's
    peak (2 of the clip's frames kept) and the cost of 32 small frames (a 56x56 clip), so neither counts.
    Planted: the kept frames converted at full size, stacked, then resized (as before issue 45) -> ~198 frames'
    worth more (the stack, its copy, float copies); failed here."""
    path = str(write_clip(tmp_path / "hd.mp4", frames=32, fps=2, width=1280, height=720))
    small = str(write_clip(tmp_path / "small.mp4", frames=32, fps=2))
    two, all_32 = (VideoBudget(fps=2.0, max_frames=kept, max_pixels=112 * 112) for kept in (2, 32))
    peak = _decode_peak_bytes(path, all_32, [(small, all_32), (path, two)])
    frame = 1280 * 720 * 3
    assert peak < 5 * frame, (peak / frame, "full-size frames")  # the 30 more kept at full size: 30 frames


# ---------------------------------------------------------------------------------------------- long clips


def test_a_clip_over_the_frame_limit_says_its_cut(tmp_path, monkeypatch):
    """With MAX_SOURCE_FRAMES 10, a 40-frame clip (its header counts it) and a 40-frame raw stream (its packets
    counted, stopping past the limit) sample their first 10 frames and say so. Planted: the cut left unsaid
    (the old silent min()) -> cut == ''; failed here."""
    monkeypatch.setattr(video_module, "MAX_SOURCE_FRAMES", 10)
    budget = VideoBudget(fps=4.0, max_frames=16, max_pixels=56 * 56)
    for path in (write_clip(tmp_path / "long.mp4", frames=40, fps=4), _raw_h264(tmp_path / "long.h264", 40)):
        video = decode_video(str(path), budget)
        assert video.total_frames == 10 and video.frame_indices[-1] <= 9, path
        assert "over 10 frames" in video.cut and "first 10 sampled" in video.cut, video.cut


# ---------------------------------------------------------------------------------------------- frame rate


def test_a_frame_lists_own_rate_times_it(tmp_path):
    """60 frames shot at 30 fps are 2 seconds: 4 frames at 2 fps, evenly; the metadata says 30 fps. A plain list
    is still the budget's rate apart (30 seconds: 16 frames, the budget's most). Planted: the FrameList's fps
    ignored -> 16 frames at 2 fps; failed here."""
    frames = [Image.fromarray(frame_array(0))] * 60
    timed = decode_video(FrameList(frames, fps=30), BUDGET)
    assert timed.frame_indices == [0, 20, 39, 59] and timed.source_fps == 30.0 and timed.total_frames == 60
    assert timed.metadata["fps"] == 30.0 and timed.sampled_fps == pytest.approx(2.0)
    plain = decode_video(frames, BUDGET)
    assert len(plain.frame_indices) == 16 and plain.source_fps == BUDGET.fps
    restored = pickle.loads(pickle.dumps(FrameList(["a.png", "b.png"], fps=30)))  # samples cross processes
    assert restored == FrameList(["a.png", "b.png"], fps=30) and restored.fps == 30.0
    assert restored != FrameList(["a.png", "b.png"], fps=25) and FrameList(["a.png"]) == ("a.png",)
    for bad in (0, -1, float("nan"), "30", True):
        with pytest.raises(ValueError, match="positive number"):
            FrameList(["a.png"], fps=bad)


def test_a_frame_list_rows_fps_reaches_the_decoder(tmp_path, caplog):
    """A project row {"video": [frame paths], "fps": 30}: the sample's video is a FrameList at 30 fps (decoded as
    2 seconds); a row with fps 0 is skipped and counted as a malformed row, naming it. Planted: the loader's
    plain list (the row's fps in meta only) -> the fps-0 row loaded too (and no .fps); failed here."""
    for i in range(60):
        Image.fromarray(frame_array(0)).save(tmp_path / f"{i:02d}.png")
    row = {"id": "r", "video": [f"{i:02d}.png" for i in range(60)], "question": "Q?", "answer": "1", "fps": 30}
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps(row) + "\n" + json.dumps({**row, "id": "zero", "fps": 0}) + "\n")
    with count_load_skips() as skipped, caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.data"):
        (sample,) = get_task("video").load(source=str(source))
    assert sample.id == "r" and sample.videos[0].fps == 30.0 and len(sample.videos[0]) == 60
    assert decode_video(sample.videos[0], BUDGET).frame_indices == [0, 20, 39, 59]
    assert skipped == {"malformed_rows": 1}
    assert "fps must be a positive number (the frames' rate), got 0" in caplog.text and "rows.jsonl" in caplog.text


# ---------------------------------------------------------------------------------------------- mid-run


def test_a_broken_video_is_warned_about_once_however_often_it_is_drawn(tmp_path, caplog):
    """Three draws over a stream whose one sample (of two) has a corrupt clip: counted each time it is drawn,
    warned once. Planted: a warning at each failure -> one per time drawn; failed here."""
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    samples = [Sample("video", "bad", "Q?", (), "A", videos=(str(corrupt),)), Sample("video", "good", "Q?", (), "A")]
    stream = PromptStream(samples, seed=0)

    def encode(sample):  # the trainer's encode, short of the model: the sample's videos decoded
        return [decode_video(video, BUDGET) for video in sample.videos]

    order = [sample.id for sample in PromptStream(samples, seed=0).take(8)]
    skips = order[: [i for i, name in enumerate(order) if name == "good"][2]].count("bad")  # before the 3rd good
    assert skips >= 2  # the bad clip is drawn more than once
    counters = Counter()
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        for _ in range(3):
            draw_prompts(stream, 1, encode, counters)
    assert counters["skipped_broken_videos"] == skips
    said = [r.getMessage() for r in caplog.records if "skipping sample bad" in r.getMessage()]
    assert len(said) == 1 and str(corrupt) in said[0]


def test_evaluation_scores_a_bad_clip_zero(tiny_policy, tmp_path):
    """A clip and a frame list qwen-vl-utils' resize refuses (2000x8, 1x10000) beside a good clip: each bad one
    gets reward 0 and error "image", the good one is generated. Planted: the resize rule's ValueError not caught
    (as before) -> evaluate_task raised ValueError; failed here."""
    task = get_task("video")
    (fixture,) = [s for s in task.load(source=str(FIXTURES / "project.jsonl")) if s.id == "fixture_crossings"]
    wide = write_clip(tmp_path / "wide.mp4", frames=4, width=2000, height=8)
    tall = [Image.new("RGB", (1, 10000))] * 2
    samples = [
        dataclasses.replace(fixture, id="wide", videos=(str(wide),)),
        dataclasses.replace(fixture, id="tall", videos=(tall,)),
        fixture,
    ]
    settings = evaluation.EvalSettings(max_thought_tokens=2, max_answer_tokens=2)
    metrics, records = evaluation.evaluate_task(tiny_policy, task, samples, settings, progress=False)
    by_id = {record["id"]: record for record in records}
    assert all(by_id[bad]["error"] == "image" and by_id[bad]["parts"]["reward"] == 0.0 for bad in ("wide", "tall"))
    assert by_id["fixture_crossings"]["error"] is None
    assert metrics["errors"] == pytest.approx(2 / 3) and metrics["prompts"] == 3
