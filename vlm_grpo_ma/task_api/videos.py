"""Reading videos so that an unreadable one is a ``VideoLoadError`` (skipped and counted by the trainer, as a
broken image is), never a crash, and a long or large one is cut down to the run's budget.

A sample's video is a file path (any container FFmpeg reads: mp4, webm, avi, mkv, ...) or a list of frames
(image paths or PIL images, in time order, ``VideoBudget.fps`` apart). Samples keep the path, never decoded
frames: each process decodes its own share when it encodes the prompt, so host memory stays flat with the
data set's size.

Decoding is PyAV's (``av``, FFmpeg's libraries in the wheel). qwen-vl-utils 0.0.14 (the processor helper this
project pins) requires ``av`` itself, and its own readers are unusable here: ``torchvision.io.read_video`` is
gone from torchvision 0.29 (the version this project pins), decord's only wheel is x86-64 Linux and unmaintained
since 2022, and torchcodec needs FFmpeg's shared libraries from the system (not on a pip-only machine). The
frame choice and the frame size are qwen-vl-utils' rules (``smart_nframes``: frames at ``fps``, an even count
within ``[FRAME_FACTOR, max_frames]``; ``smart_resize``: sides a multiple of the model's patch factor, area
within ``max_pixels``), so a clip gives the frames Qwen's own pipeline would give it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from vlm_grpo_ma.task_api.images import ImageLoadError, decode_image

# torch, torchvision, PyAV and qwen-vl-utils are imported where a video is decoded: the task API (imported by
# every reward worker, which never decodes) stays light; importing torch there cost each worker ~1.5 s.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class VideoLoadError(ImageLoadError):
    """A video is missing, empty, corrupt, has no frames, or is too large to decode; the message names it."""


@dataclass(frozen=True)
class VideoBudget:
    """How much of a video the model sees (``model.video_fps``, ``model.video_max_frames``,
    ``model.video_max_pixels``): frames sampled ``fps`` a second, at most ``max_frames`` of them (evenly over
    the clip when more would be sampled), each resized to at most ``max_pixels`` pixels."""

    fps: float = 2.0
    max_frames: int = 16
    max_pixels: int = 128 * 28 * 28


@dataclass(frozen=True)
class DecodedVideo:
    """The frames the model sees and where they came from. ``frames`` is uint8 [T, 3, H, W] (T even, H and W
    multiples of the patch factor); ``frame_indices`` index the source's frames; ``source_fps`` is the file's
    frame rate (for a list of frames: the budget's); ``cut`` says what the budget removed, or is empty."""

    frames: torch.Tensor
    frame_indices: list[int]
    total_frames: int
    source_fps: float
    cut: str = ""

    @property
    def metadata(self) -> dict:
        """What a processor needs to time the frames (transformers' ``VideoMetadata`` fields): the source's frame
        count and rate, the chosen frames' indices, the frame size."""
        return {
            "total_num_frames": self.total_frames, "fps": self.source_fps, "frames_indices": list(self.frame_indices),
            "width": int(self.frames.shape[-1]), "height": int(self.frames.shape[-2]),
        }  # fmt: skip

    @property
    def sampled_fps(self) -> float:
        """Frames a second of the sampled clip: ``len(frame_indices) / total_frames * source_fps``."""
        return len(self.frame_indices) / max(self.total_frames, 1) * self.source_fps


# The most frames read from one file (a guard against a stream that claims a few frames and has millions).
MAX_SOURCE_FRAMES = 100_000

_said_cut: set[tuple[str, str]] = set()  # (video, cut) pairs already logged


def _frame_count(budget: VideoBudget, total_frames: int, source_fps: float) -> tuple[int, str]:
    """How many frames to sample (qwen-vl-utils' ``smart_nframes``) and what the budget cut, if anything."""
    from qwen_vl_utils.vision_process import FRAME_FACTOR, smart_nframes

    max_frames = max(FRAME_FACTOR, budget.max_frames - budget.max_frames % FRAME_FACTOR)
    wanted = total_frames / source_fps * budget.fps
    count = smart_nframes(  # at most the source's rate: a higher one asks for frames that are not there (and warns)
        {"fps": min(budget.fps, source_fps), "min_frames": FRAME_FACTOR, "max_frames": min(max_frames, total_frames)},
        total_frames=total_frames,
        video_fps=source_fps,
    )
    cut = ""
    if wanted > max_frames:
        cut = f"{wanted:.0f} frames at {budget.fps:g} fps exceed model.video_max_frames={budget.max_frames}: {count} sampled evenly"
    return count, cut


def _resize(frames: torch.Tensor, budget: VideoBudget, factor: int) -> tuple[torch.Tensor, str]:
    """Frames [T, 3, H, W] resized to qwen-vl-utils' ``smart_resize`` of their size under ``max_pixels``."""
    from qwen_vl_utils.vision_process import smart_resize
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import resize

    height, width = frames.shape[-2:]
    new_height, new_width = smart_resize(height, width, factor=factor, min_pixels=factor * factor, max_pixels=budget.max_pixels)
    cut = ""
    if height * width > budget.max_pixels:
        cut = f"frames of {width}x{height} exceed model.video_max_pixels={budget.max_pixels}: resized to {new_width}x{new_height}"
    if (new_height, new_width) != (height, width):
        frames = resize(frames, [new_height, new_width], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return frames, cut


def _even_indices(total: int, count: int) -> list[int]:
    """``count`` indices evenly over ``0 .. total - 1``, both ends included (rounded half to even)."""
    return [int(i) for i in np.linspace(0, total - 1, count).round()]


def _read_file(path: str, budget: VideoBudget) -> tuple[list[np.ndarray], list[int], int, float, str]:
    """PyAV: (the chosen frames as RGB arrays, their indices, the stream's frame count, its fps, the cut)."""
    import av

    if not Path(path).is_file():
        raise VideoLoadError(f"video {path!r}: no such file")
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise VideoLoadError(f"video {path!r}: the file has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > Image.MAX_IMAGE_PIXELS:  # the image reader's decompression-bomb limit, per frame
                raise VideoLoadError(f"video {path!r}: frames of {width}x{height} are over {Image.MAX_IMAGE_PIXELS} pixels")
            fps = float(stream.average_rate or stream.guessed_rate or 0) or budget.fps
            total = stream.frames
            if total <= 0:  # the container does not say: count the packets (no decoding)
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            if total <= 0:
                raise VideoLoadError(f"video {path!r}: no frames")
            if total < 2:
                raise VideoLoadError(f"video {path!r}: {total} frame; a video needs 2 or more (the tower takes frames in pairs)")
            total = min(total, MAX_SOURCE_FRAMES)
            count, cut = _frame_count(budget, total, fps)
            wanted = _even_indices(total, count)
            chosen: dict[int, np.ndarray] = {}
            targets = set(wanted)
            for index, frame in enumerate(container.decode(stream)):
                if index in targets:
                    chosen[index] = frame.to_ndarray(format="rgb24")
                if index >= wanted[-1] or index + 1 >= MAX_SOURCE_FRAMES:
                    break
            decoded = index + 1 if chosen else 0
    except VideoLoadError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as error:
        raise VideoLoadError(f"video {path!r} cannot be decoded: {type(error).__name__}: {error}") from error
    if not chosen:
        raise VideoLoadError(f"video {path!r}: no frame decodes")
    if decoded < total:  # the header over-counted: sample from the frames that exist
        count, cut = _frame_count(budget, decoded, fps)
        wanted = _even_indices(decoded, count)
        missing = [i for i in wanted if i not in chosen]
        if missing:
            raise VideoLoadError(f"video {path!r}: the stream says {total} frames but {decoded} decode")
        total = decoded
    return [chosen[i] for i in wanted], wanted, total, fps, cut


def _read_frames(frames: Sequence, budget: VideoBudget, where: str) -> tuple[list[np.ndarray], list[int], int, float, str]:
    """A list of frames (paths or PIL images), ``budget.fps`` apart: the budget's even choice of them."""
    if len(frames) == 0:
        raise VideoLoadError(f"video {where}: an empty list of frames")
    try:
        images = [decode_image(frame) for frame in frames]
    except ImageLoadError as error:
        raise VideoLoadError(f"video {where}: a frame does not load: {error}") from error
    if len({image.size for image in images}) > 1:
        raise VideoLoadError(f"video {where}: frames of different sizes {sorted({image.size for image in images})}")
    total = len(images)
    if total == 1:  # one picture: shown twice, as the processor pads a clip to whole temporal patches
        images, total = images * 2, 2
    count, cut = _frame_count(budget, total, budget.fps)
    wanted = _even_indices(total, count)
    return [np.asarray(images[i]) for i in wanted], wanted, total, budget.fps, cut


def describe(video) -> str:
    """A video reference as messages name it: the path, or the frame list's length and first frame."""
    if isinstance(video, (str, Path)):
        return repr(str(video))
    if isinstance(video, (list, tuple)):
        first = video[0] if video else None
        return f"[{len(video)} frames{', first ' + repr(str(first)) if isinstance(first, (str, Path)) else ''}]"
    return repr(video)


def decode_video(video, budget: VideoBudget, *, factor: int = 28) -> DecodedVideo:
    """A path or list of frames -> the frames the model sees (``DecodedVideo``), or VideoLoadError. ``factor``
    is the model's patch size times its merge size: frame sides become multiples of it. A video cut down to
    the budget is said once per video and cut (logged), and carries the cut in ``DecodedVideo.cut``."""
    where = describe(video)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qwen-vl-utils warns on its own choices; the cut is said below
        if isinstance(video, (str, Path)):
            arrays, indices, total, fps, cut = _read_file(str(video), budget)
        elif isinstance(video, (list, tuple)):
            arrays, indices, total, fps, cut = _read_frames(video, budget, where)
        else:
            raise VideoLoadError(f"video {where}: expected a file path or a list of frames, got {type(video).__name__}")
    import torch

    frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    frames, size_cut = _resize(frames, budget, factor)
    cut = "; ".join(part for part in (cut, size_cut) if part)
    if cut and (where, cut) not in _said_cut:
        _said_cut.add((where, cut))
        log.info("video %s cut down to the budget: %s", where, cut)
    if not math.isfinite(fps) or fps <= 0:
        raise VideoLoadError(f"video {where}: frame rate {fps} is not a positive number")
    return DecodedVideo(frames=frames, frame_indices=indices, total_frames=total, source_fps=fps, cut=cut)


def frame_strip(video: DecodedVideo, count: int = 8) -> Image.Image:
    """Up to ``count`` of the video's frames side by side, evenly chosen (for evaluation drawings)."""
    frames = video.frames
    chosen = _even_indices(frames.shape[0], min(count, frames.shape[0]))
    tiles = [Image.fromarray(frames[i].permute(1, 2, 0).numpy()) for i in chosen]
    width, height = tiles[0].size
    strip = Image.new("RGB", (width * len(tiles) + 2 * (len(tiles) - 1), height), (255, 255, 255))
    for i, tile in enumerate(tiles):
        strip.paste(tile, (i * (width + 2), 0))
    return strip
