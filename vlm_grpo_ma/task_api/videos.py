"""Reading videos so that an unreadable one is a ``VideoLoadError`` (skipped and counted by the trainer, as a
broken image is), never a crash, and a long or large one is cut down to the run's budget.

A sample's video is a file path (any container FFmpeg reads: mp4, webm, avi, mkv, ...; or a raw stream such
as .h264) or a list of frames (image paths or PIL images, in time order): a ``FrameList`` carries the frames'
rate, a plain list or tuple is taken as ``VideoBudget.fps`` apart. Samples keep the path, never decoded
frames: each process decodes its own share when it encodes the prompt, so host memory stays flat with the
data set's size. Decoding keeps at most one full-size frame: each chosen frame is resized as it is decoded
(a frame list reads only its chosen frames), to the size the first frame gives; a later frame of another
size (a stream that changes size) is resized to that size too.

Decoding is PyAV's (``av``, FFmpeg's libraries in the wheel). qwen-vl-utils 0.0.14 (the processor helper this
project pins) requires ``av`` itself, and its own readers are unusable here: ``torchvision.io.read_video`` is
gone from torchvision 0.29 (the version this project pins), decord's only wheel is x86-64 Linux and unmaintained
since 2022, and torchcodec needs FFmpeg's shared libraries from the system (not on a pip-only machine). The
frame choice and the frame size are qwen-vl-utils' rules (``smart_nframes``: frames at ``fps``, an even count
within ``[FRAME_FACTOR, max_frames]``; ``smart_resize``: sides a multiple of the model's patch factor, area
within ``max_pixels``), so a clip gives the frames Qwen's own pipeline would give it.
"""

from __future__ import annotations

import itertools
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


class FrameList(tuple):
    """A video given as its frames (image paths or PIL images, in time order) shot ``fps`` a second; ``fps``
    None (as for a plain list or tuple of frames) takes them as ``VideoBudget.fps`` apart. A tuple, so it is a
    frame list wherever one is read (``describe``, loaders' file checks, run records) and pickles with its
    rate. ValueError for an ``fps`` that is not a positive number."""

    def __new__(cls, frames=(), fps: float | None = None):
        number = isinstance(fps, (int, float)) and not isinstance(fps, bool)
        if fps is not None and not (number and math.isfinite(fps) and fps > 0):
            raise ValueError(f"a frame list's fps must be a positive number (the frames' rate), got {fps!r}")
        self = super().__new__(cls, frames)
        self.fps = None if fps is None else float(fps)
        return self

    def __eq__(self, other):
        if not isinstance(other, tuple):
            return NotImplemented
        return tuple.__eq__(self, other) and getattr(other, "fps", None) == self.fps

    def __ne__(self, other):  # tuple's own __ne__ would ignore fps
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self):
        return tuple.__hash__(self)  # equal to a plain tuple of the same frames when fps is None, as __eq__ is

    def __repr__(self):
        return f"FrameList({list(self)!r}, fps={self.fps!r})"


@dataclass(frozen=True)
class DecodedVideo:
    """The frames the model sees and where they came from. ``frames`` is uint8 [T, 3, H, W] (T even, H and W
    multiples of the patch factor); ``frame_indices`` index the source's frames; ``source_fps`` is the file's
    frame rate (for a list of frames: its ``FrameList.fps``, else the budget's); ``cut`` says what the budget
    removed, or is empty."""

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


# The most frames read from one file (a guard against a stream that claims a few frames and has millions):
# a longer clip is sampled over its first MAX_SOURCE_FRAMES frames, and its cut says so.
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


class _Fitter:
    """Resizes each chosen frame as it is decoded to the size the first one gives (qwen-vl-utils'
    ``smart_resize`` under ``max_pixels``), so a video's decoding holds one full-size frame, not all of them.
    A later frame of another size (a stream that changes size mid-way) is resized to the same size."""

    def __init__(self, budget: VideoBudget, factor: int, where: str):
        self.budget, self.factor, self.where = budget, factor, where
        self.size: tuple[int, int] | None = None  # (width, height) every frame is resized to
        self.cut = ""

    def _target(self, width: int, height: int) -> tuple[int, int]:
        from qwen_vl_utils.vision_process import smart_resize

        budget, factor = self.budget, self.factor
        try:
            new_height, new_width = smart_resize(height, width, factor=factor, min_pixels=factor * factor, max_pixels=budget.max_pixels)
        # qwen-vl-utils' limits: an aspect ratio of at most 200 (ValueError), and max_pixels of at least one token
        # (an assert: a budget under factor x factor, which config.check_video_max_pixels refuses at start)
        except (ValueError, ZeroDivisionError, AssertionError) as error:
            raise VideoLoadError(f"video {self.where}: frames of {width}x{height} cannot be resized: {error}") from error
        if new_width <= 0 or new_height <= 0:  # a short side that rounds to nothing under max_pixels (8000x40)
            raise VideoLoadError(
                f"video {self.where}: frames of {width}x{height} resize to {new_width}x{new_height} under "
                f"model.video_max_pixels={budget.max_pixels} (the short side is too short for the long one)"
            )
        if height * width > budget.max_pixels:
            self.cut = f"frames of {width}x{height} exceed model.video_max_pixels={budget.max_pixels}: resized to {new_width}x{new_height}"
        return new_width, new_height

    def __call__(self, image: Image.Image) -> np.ndarray:
        """One decoded RGB frame -> [H, W, 3] uint8 at the video's size. PIL's bicubic resize is antialiased (it
        filters over the whole source support): within 1 level of qwen-vl-utils' torchvision resize."""
        if self.size is None:
            self.size = self._target(*image.size)
        if image.size != self.size:
            image = image.resize(self.size, Image.Resampling.BICUBIC)
        return np.asarray(image)


def _even_indices(total: int, count: int) -> list[int]:
    """``count`` indices evenly over ``0 .. total - 1``, both ends included (rounded half to even)."""
    return [int(i) for i in np.linspace(0, total - 1, count).round()]


def _video_stream(container, path: str):
    """The container's first video stream, or VideoLoadError when there is none, it has no decoder (an mp4 cut
    inside its header), or its frames are over PIL's decompression-bomb limit."""
    if not container.streams.video:
        raise VideoLoadError(f"video {path!r}: the file has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise VideoLoadError(f"video {path!r}: the video stream has no decoder (a file cut short, or an unknown codec)")
    _check_frame_pixels(stream.codec_context.width, stream.codec_context.height, path)
    return stream


def _check_frame_pixels(width: int, height: int, path: str) -> None:
    if width * height > Image.MAX_IMAGE_PIXELS:  # the image reader's decompression-bomb limit, per frame
        raise VideoLoadError(f"video {path!r}: frames of {width}x{height} are over {Image.MAX_IMAGE_PIXELS} pixels")


def _decode_chosen(path: str, wanted: list[int], fit: _Fitter) -> tuple[dict[int, np.ndarray], int]:
    """({index: the frame, resized by ``fit``} for the ``wanted`` indices, how many frames decoded), decoding
    no further than the last wanted frame. The file is opened afresh: a raw stream (.h264) cannot seek back."""
    import av

    chosen: dict[int, np.ndarray] = {}
    decoded = 0
    targets = set(wanted)
    with av.open(path) as container:
        for index, frame in enumerate(container.decode(_video_stream(container, path))):
            decoded = index + 1
            if index in targets:
                _check_frame_pixels(frame.width, frame.height, path)  # the header's size may not be every frame's
                chosen[index] = fit(frame.to_image())
            if index >= wanted[-1]:
                break
    return chosen, decoded


def _read_file(path: str, budget: VideoBudget, fit: _Fitter) -> tuple[list[np.ndarray], list[int], int, float, str]:
    """PyAV: (the chosen frames resized by ``fit``, their indices, the frames sampled over, the fps, the cut).
    Over ``MAX_SOURCE_FRAMES`` frames, the first ``MAX_SOURCE_FRAMES`` are sampled and the cut says so."""
    import av

    if not Path(path).is_file():
        raise VideoLoadError(f"video {path!r}: no such file")
    try:
        with av.open(path) as container:
            stream = _video_stream(container, path)
            fps = float(stream.average_rate or stream.guessed_rate or 0) or budget.fps
            if not math.isfinite(fps) or fps <= 0:
                raise VideoLoadError(f"video {path!r}: frame rate {fps} is not a positive number")
            total = stream.frames
            if total <= 0:  # the container does not say (a raw stream, some webm): count packets, no decoding
                packets = (packet for packet in container.demux(stream) if packet.size)
                total = sum(1 for _ in itertools.islice(packets, MAX_SOURCE_FRAMES + 1))
        if total <= 0:
            raise VideoLoadError(f"video {path!r}: no frames")
        if total < 2:
            raise VideoLoadError(f"video {path!r}: {total} frame; a video needs 2 or more (the tower takes frames in pairs)")
        span = ""
        if total > MAX_SOURCE_FRAMES:  # decoding stays bounded; the cut says the rest was not seen
            span = f"over {MAX_SOURCE_FRAMES} frames (the most read from one file): its first {MAX_SOURCE_FRAMES} sampled"
            total = MAX_SOURCE_FRAMES
        count, cut = _frame_count(budget, total, fps)
        wanted = _even_indices(total, count)
        chosen, decoded = _decode_chosen(path, wanted, fit)
        if decoded < total:  # the header over-counted: sample again from the frames that exist
            if decoded < 2:
                raise VideoLoadError(f"video {path!r}: the stream says {total} frames but {decoded} decode")
            count, cut = _frame_count(budget, decoded, fps)
            wanted = _even_indices(decoded, count)
            chosen, _ = _decode_chosen(path, wanted, fit)
            total = decoded
    except VideoLoadError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as error:
        raise VideoLoadError(f"video {path!r} cannot be decoded: {type(error).__name__}: {error}") from error
    if any(index not in chosen for index in wanted):  # a second pass that decoded less than the first
        raise VideoLoadError(f"video {path!r}: the stream says {total} frames but fewer decode")
    return [chosen[i] for i in wanted], wanted, total, fps, "; ".join(part for part in (span, cut) if part)


def _read_frames(
    frames: Sequence, fps: float, budget: VideoBudget, fit: _Fitter, where: str
) -> tuple[list[np.ndarray], list[int], int, float, str]:
    """A list of frames (paths or PIL images) ``fps`` apart: the budget's even choice of them, resized by ``fit``.
    Only the chosen frames are read (600 paths, 16 chosen: 16 images decoded)."""
    if len(frames) == 0:
        raise VideoLoadError(f"video {where}: an empty list of frames")
    # One picture is shown twice, as the processor pads a clip to whole temporal patches.
    sources = list(frames) * 2 if len(frames) == 1 else frames
    total = len(sources)
    count, cut = _frame_count(budget, total, fps)
    wanted = _even_indices(total, count)
    arrays = []
    for index in wanted:
        try:
            image = decode_image(sources[index])
        except ImageLoadError as error:
            raise VideoLoadError(f"video {where}: a frame does not load: {error}") from error
        arrays.append(fit(image))
    return arrays, wanted, total, fps, cut


def describe(video) -> str:
    """A video reference as messages name it: the path, or the frame list's length and first frame."""
    if isinstance(video, (str, Path)):
        return repr(str(video))
    if isinstance(video, (list, tuple)):
        first = video[0] if video else None
        rate = f" at {video.fps:g} fps" if getattr(video, "fps", None) else ""
        return f"[{len(video)} frames{rate}{', first ' + repr(str(first)) if isinstance(first, (str, Path)) else ''}]"
    return repr(video)


def decode_video(video, budget: VideoBudget, *, factor: int = 28) -> DecodedVideo:
    """A path or list of frames (a ``FrameList`` with its rate, or a plain list) -> the frames the model sees
    (``DecodedVideo``), or VideoLoadError. ``factor`` is the model's patch size times its merge size: frame
    sides become multiples of it. A video cut down to the budget is said once per video and cut (logged), and
    carries the cut in ``DecodedVideo.cut``."""
    where = describe(video)
    fit = _Fitter(budget, factor, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qwen-vl-utils warns on its own choices; the cut is said below
        if isinstance(video, (str, Path)):
            arrays, indices, total, fps, cut = _read_file(str(video), budget, fit)
        elif isinstance(video, (list, tuple)):
            fps = getattr(video, "fps", None) or budget.fps
            arrays, indices, total, fps, cut = _read_frames(video, fps, budget, fit, where)
        else:
            raise VideoLoadError(f"video {where}: expected a file path or a list of frames, got {type(video).__name__}")
    import torch

    frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # the small, resized frames
    cut = "; ".join(part for part in (cut, fit.cut) if part)
    if cut and (where, cut) not in _said_cut:
        _said_cut.add((where, cut))
        log.info("video %s cut down to the budget: %s", where, cut)
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
