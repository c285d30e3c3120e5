"""Clips for the video tests, written with PyAV: a bright square that moves right one step a frame on a dark
background, so a frame's index can be read back from its pixels (``square_column``)."""

from pathlib import Path

import av
import numpy as np

STEP = 3  # pixels the square moves per frame
SIDE = 8  # the square's side


def frame_array(index: int, width: int = 56, height: int = 56) -> np.ndarray:
    frame = np.full((height, width, 3), 30, np.uint8)
    left = 2 + STEP * index
    frame[height // 2 - SIDE // 2 : height // 2 + SIDE // 2, left : left + SIDE] = (240, 60, 60)
    return frame


def write_clip(
    path: Path, frames: int = 8, fps: int = 4, width: int = 56, height: int = 56, codec: str = "libx264", container_format: str | None = None
) -> Path:
    """A clip of ``frames`` frames at ``fps``; frame i has the square at column 2 + STEP * i. ``container_format``
    names FFmpeg's muxer where the file name does not (``h264``: a raw stream, no container)."""
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_array(i, width, height), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def square_column(frame) -> float:
    """The left edge of the red square in a frame ([3, H, W] or [H, W, 3], any size: scaled to 56 wide)."""
    array = np.asarray(frame)
    if array.shape[0] == 3:
        array = array.transpose(1, 2, 0)
    red = (array[..., 0].astype(int) > 150) & (array[..., 1].astype(int) < 130)
    columns = np.nonzero(red.any(axis=0))[0]
    return float(columns.min()) * 56 / array.shape[1]
