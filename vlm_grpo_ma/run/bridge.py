"""The channel between the trainer processes and the engine processes of a split launch
(``rollout.engine_processes``): a gloo process group of its own over every process of the launch, beside the
trainers' own (DDP or FSDP2 among themselves). Objects go as pickled bytes, weights as flat buckets of at most
``BUCKET_BYTES``. Sends never wait for the receiver (``isend``: the trainer pushes weights while its engine still
samples), so neither side can deadlock the other; a receive waits, and raises ``PeerLost`` naming the process when
that process has gone.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Iterable, Iterator

import torch

# Weights travel in buckets of at most this many bytes (one tensor larger than that goes alone), one message each:
# no message grows with the model. The sender's buckets stay in host memory until received (send_weights).
BUCKET_BYTES = 256 * 2**20
# How long a receive waits for its peer: an engine waits for weights through a held-out evaluation, a trainer for a
# tree through a long sampling. A peer that exits is noticed at once (its connection closes), not after this.
WAIT = datetime.timedelta(hours=2)

TREE, WEIGHTS_HEADER, WEIGHTS_DATA, START, EXCHANGE, GOODBYE = 1, 2, 3, 4, 5, 6  # message tags: each kind in its own order


class PeerLost(RuntimeError):
    """A receive from a process of the launch that has stopped (its connection closed)."""


class Bridge:
    """Point-to-point messages between the processes of a launch, by launch rank (``rank`` of ``size``)."""

    def __init__(self, group, rank: int, size: int, describe=lambda rank: f"process {rank}", store=None):
        self.group, self.rank, self.size, self.store = group, rank, size, store
        self.describe = describe  # launch rank -> what it is ("engine process 1 (launch rank 3)"): the error's words
        self.pending: list = []  # (work, buffers) of sends not known complete: buffers live until the work is done
        self.watched: dict[int, object] = {}  # rank -> a posted receive of its goodbye (``watch``)

    @classmethod
    def open(cls, store, rank: int, size: int, describe=lambda rank: f"process {rank}") -> Bridge:
        """The bridge over ``store`` (a torch.distributed Store every process of the launch reaches)."""
        import torch.distributed as dist

        group = dist.ProcessGroupGloo(dist.PrefixStore("vlm_grpo_ma/bridge", store), rank, size, WAIT)
        return cls(group, rank, size, describe, dist.PrefixStore("vlm_grpo_ma/board", store))

    def announce(self, version: int) -> None:
        """Post on the launch's store that weights ``version`` are on their way (after their sends): an engine
        reads it without waiting (``announced``); a gloo receive cannot be polled."""
        self.store.set("weights_version", str(version))

    def announced(self) -> int:
        """The newest weights version announced, -1 before any."""
        return int(self.store.get("weights_version")) if self.store.check(["weights_version"]) else -1

    def send_object(self, value, to: int, tag: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self._send(torch.tensor([payload.numel()], dtype=torch.int64), to, tag)
        self._send(payload, to, tag)

    def recv_object(self, source: int, tag: int):
        length = torch.zeros(1, dtype=torch.int64)
        self._recv(length, source, tag)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._recv(payload, source, tag)
        return pickle.loads(payload.numpy().tobytes())

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], to: list[int], header: dict) -> int:
        """Stream ``named_tensors`` (one dtype) to the processes ``to`` in buckets of at most ``BUCKET_BYTES``, then
        a header: ``header`` plus every tensor's name and shape (on its own tag, last: an engine learns of a version
        only once all of it is on its way). Returns the bytes sent to each process. The stream is consumed whole
        even where ``to`` is empty (FSDP's gathers are collective: every trainer walks it). The buckets stay in
        host memory until received (``pending``): the sender never waits for an engine that is still sampling."""
        names, shapes, bucket, bucket_bytes, total_bytes = [], [], [], 0, 0
        for name, tensor in named_tensors:
            flat = tensor.detach().reshape(-1).to("cpu", copy=True)
            size = flat.numel() * flat.element_size()
            if bucket and bucket_bytes + size > BUCKET_BYTES:
                self._send_bucket(torch.cat(bucket), to)
                bucket, bucket_bytes = [], 0
            names.append(name)
            shapes.append(tuple(tensor.shape))
            bucket.append(flat)
            bucket_bytes += size
            total_bytes += size
        if bucket:
            self._send_bucket(torch.cat(bucket), to)
        for rank in to:
            self.send_object({**header, "names": names, "shapes": shapes}, rank, WEIGHTS_HEADER)
        return total_bytes

    def _send_bucket(self, tensor: torch.Tensor, to: list[int]) -> None:
        for rank in to:
            self._send(torch.tensor([tensor.numel()], dtype=torch.int64), rank, WEIGHTS_DATA)
            self._send(tensor, rank, WEIGHTS_DATA)

    def recv_weights(self, source: int, header: dict, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of the version ``header`` announced (received with ``recv_object`` on ``WEIGHTS_HEADER``), bucket by bucket, as (name, tensor) in the sender's order."""
        names, shapes = header["names"], [torch.Size(shape) for shape in header["shapes"]]
        at = 0
        while at < len(names):
            length = torch.zeros(1, dtype=torch.int64)
            self._recv(length, source, WEIGHTS_DATA)
            bucket = torch.empty(int(length.item()), dtype=dtype)
            self._recv(bucket, source, WEIGHTS_DATA)
            offset = 0
            while offset < bucket.numel():
                size = shapes[at].numel()
                yield names[at], bucket[offset : offset + size].view(shapes[at])
                offset += size
                at += 1

    def flush(self) -> None:
        """Wait until every send has reached its receiver (the end of a run: nothing left in flight)."""
        for work, _buffer, to in self.pending:
            self.wait(work, to)
        self.pending.clear()

    def watch(self, ranks: list[int]) -> None:
        """Post a receive of each of ``ranks``' goodbye (``goodbye``), so that ``stopped`` can tell later which of
        them has gone without saying it."""
        self.watched = {rank: self.group.recv([torch.zeros(1)], rank, GOODBYE) for rank in ranks}

    def goodbye(self, ranks: list[int]) -> None:
        """Tell ``ranks`` that this process ends in order (their ``watch``)."""
        for rank in ranks:
            self._send(torch.ones(1), rank, GOODBYE)

    def stopped(self) -> list[int]:
        """The watched processes that have gone without a goodbye (a crash, a kill): their connection is closed.
        A moment's wait each; for the end of a run only (a receive that timed out is not used again)."""
        gone = []
        for rank, work in self.watched.items():
            try:
                work.wait(datetime.timedelta(milliseconds=200))
            except RuntimeError as error:
                if "closed" in str(error).lower() or "reset" in str(error).lower():
                    gone.append(rank)
        return gone

    def _send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        self.pending = [item for item in self.pending if not item[0].is_completed()]
        with self._peer(to):
            self.pending.append((self.group.send([tensor], to, tag), tensor, to))

    def _recv(self, tensor: torch.Tensor, source: int, tag: int) -> None:
        with self._peer(source):
            self.group.recv([tensor], source, tag).wait()

    def wait(self, work, peer: int) -> None:
        with self._peer(peer):
            work.wait()

    @contextlib.contextmanager
    def _peer(self, peer: int):
        """gloo's errors with ``peer`` ("Connection closed by peer", "Broken pipe", a timeout) as ``PeerLost``."""
        try:
            yield
        except RuntimeError as error:
            raise PeerLost(f"{self.describe(peer)} stopped mid-run ({str(error).splitlines()[0][:200]})") from None
