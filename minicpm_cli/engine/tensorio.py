"""Reading safetensors files fast: each tensor's bytes read once, straight onto its device.

`read_tensors(path_of, device)` takes {name: (file, header entry)} and returns {name: tensor} in the
file's dtype on `device`. On CUDA, the files are read in chunks by a few threads into a ring of pinned
host buffers while a copy stream moves the chunks already read to their tensors on the GPU, so disk (or
page-cache) reads overlap host-to-device copies and no tensor passes through pageable memory or a
second host copy. On a CPU, the threads read each tensor's bytes straight into its own storage.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}} with offsets from the end of the
header, then the data. Nothing else is interpreted here: names, shapes and checks are the caller's.

`Upload` and `to_device` move small host values (ids, positions) to the device through pinned
memory too, so that the host never waits for the device's queue to send them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import trace
from .warmstart import cpus

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
CHUNK = 16 << 20  # bytes a read moves into one pinned buffer
# pinned buffers in the ring, and reader threads: a read from the page cache is a copy by the reading
# CPU, so threads up to the CPUs make it faster (15.6 GB to an H100: 4 of 64 MB 13.8 GB/s, 8 of 32 MB
# 21.6, 16 of 16 MB 28.9, 16 of 32 MB 31.5). 16 of 16 MB: the 256 MB of pinned memory that 4 of 64
# held, which torch's pinned-memory cache keeps for the process's life
BUFFERS = max(4, min(16, cpus()))


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in its file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of its bytes
    end: int


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"header of {n} bytes is not plausible")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {info['dtype']} is not supported")
        e = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end)
        nbytes = e.dtype.itemsize * _numel(e.shape)
        if e.end - e.begin != nbytes or e.end > size:
            raise ValueError(f"tensor {name}: bytes {begin}..{end} do not hold {list(e.shape)} {info['dtype']} "
                             f"within the file's {size - base} data bytes (truncated?)")
        out[name] = e
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pread(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `fd` at `offset` (pread may return less than asked)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def _bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's storage as flat bytes (a view)."""
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def read_tensors(entries: dict[str, Entry], device: torch.device) -> dict[str, Tensor]:
    """{name: tensor in its file dtype on `device`}, each tensor's bytes read once."""
    device = torch.device(device)
    nbytes = sum(e.end - e.begin for e in entries.values())
    with trace.span("tensors", bytes=nbytes):
        out = {k: torch.empty(e.shape, dtype=e.dtype, device=device) for k, e in entries.items()}
        fds = {p: os.open(p, os.O_RDONLY) for p in {e.path for e in entries.values()}}
        try:
            if device.type == "cuda":
                _read_cuda(entries, out, fds, device)
            else:
                _read_host(entries, out, fds)
        finally:
            for fd in fds.values():
                os.close(fd)
    return out


def _read_host(entries: dict[str, Entry], out: dict[str, Tensor], fds: dict[Path, int]) -> None:
    def read(name: str) -> None:
        e = entries[name]
        _pread(fds[e.path], memoryview(_bytes(out[name]).numpy()), e.begin)

    with ThreadPoolExecutor(BUFFERS) as pool:
        list(pool.map(read, sorted(entries, key=lambda k: (entries[k].path, entries[k].begin))))


@dataclass
class _Chunk:
    path: Path
    offset: int
    length: int
    pieces: list[tuple[str, int, int, int]]  # (tensor, byte offset in the tensor, offset in the chunk, bytes)


def _chunks(entries: dict[str, Entry], limit: int | None = None) -> Iterator[_Chunk]:
    """The needed bytes of each file in file order, cut into reads of at most `limit` bytes (CHUNK);
    a read spans several tensors where they lie back to back (the usual case), and a gap ends it."""
    limit = limit or CHUNK
    order = sorted((k for k, e in entries.items() if e.end > e.begin), key=lambda k: (str(entries[k].path), entries[k].begin))
    cur: _Chunk | None = None
    for name in order:
        e = entries[name]
        pos = e.begin
        while pos < e.end:
            if cur is not None and (cur.path != e.path or cur.offset + cur.length != pos or cur.length == limit):
                yield cur
                cur = None
            if cur is None:
                cur = _Chunk(e.path, pos, 0, [])
            take = min(e.end - pos, limit - cur.length)
            cur.pieces.append((name, pos - e.begin, cur.length, take))
            cur.length += take
            pos += take
    if cur is not None:
        yield cur


def _read_cuda(entries: dict[str, Entry], out: dict[str, Tensor], fds: dict[Path, int],
               device: torch.device) -> None:
    chunks = list(_chunks(entries))
    if not chunks:
        return
    size = max(c.length for c in chunks)
    ring = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(BUFFERS, len(chunks)))]
    views = [memoryview(b.numpy()) for b in ring]
    copied = [torch.cuda.Event() for _ in ring]  # the copies out of a buffer have run
    stream = torch.cuda.Stream(device)
    targets = {k: _bytes(t) for k, t in out.items()}

    def read(j: int) -> int:
        # chunk j goes into the buffer chunk j - len(ring) used; its read is submitted only after
        # that chunk's copies were queued, so waiting on their event is enough
        slot = j % len(ring)
        copied[slot].synchronize()
        c = chunks[j]
        _pread(fds[c.path], views[slot][: c.length], c.offset)
        return slot

    with ThreadPoolExecutor(len(ring)) as pool:
        pending = [pool.submit(read, j) for j in range(len(ring))]
        for j, c in enumerate(chunks):
            slot = pending[j].result()
            with torch.cuda.stream(stream):
                for name, at, src, n in c.pieces:
                    targets[name][at: at + n].copy_(ring[slot][src: src + n], non_blocking=True)
                copied[slot].record(stream)
            if j + len(ring) < len(chunks):
                pending.append(pool.submit(read, j + len(ring)))
    stream.synchronize()


def to_device(values, device: torch.device) -> Tensor:
    """Ints (a list, nested lists) as a long tensor on `device`, without waiting for the work queued
    there: `torch.tensor(..., device=)` and copies from pageable memory wait for all of it. The values
    go through pinned memory from torch's caching host allocator, which keeps a block until the copy
    that reads it has run."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=torch.long, pin_memory=cuda).to(device, non_blocking=True)


class Upload:
    """Small integer arrays to a device tensor without waiting for the device: `torch.tensor(...,
    device=)` and a copy from pageable memory wait for all the work queued before them; this writes
    pinned host buffers of `shape`, taken in turn, each written again only once the copy that read
    it has run (an event each)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, ring: int = 4):
        cuda = torch.device(device).type == "cuda"
        self.bufs = [torch.zeros(shape, dtype=torch.long, pin_memory=cuda) for _ in range(ring)]
        self.views = [b.numpy() for b in self.bufs]
        self.read = [torch.cuda.Event() if cuda else None for _ in range(ring)]
        self.next = 0

    def __call__(self, values, out: Tensor) -> None:
        """`values` (nested lists, or an array) into `out`, a slice of the destination that starts
        at index 0 in every dimension and has their shape."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.read[i] is not None:
            self.read[i].synchronize()
        at = tuple(slice(0, d) for d in out.shape)
        self.views[i][at] = values
        out.copy_(self.bufs[i][at], non_blocking=True)
        if self.read[i] is not None:
            self.read[i].record()
