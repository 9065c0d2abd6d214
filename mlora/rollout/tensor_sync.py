"""``generator.weight_sync=tensors``: the policy adapter handed to the engines as tensors in shared memory.

One POSIX shared-memory segment per adapter and run (:class:`TensorHandoff` of that adapter; an engine
serving several adapters loads each from its own) holds the adapter as the image of a PEFT
``adapter_model.safetensors`` file: an 8-byte header length, the JSON header (names, dtypes, shapes,
byte offsets; the PEFT ``adapter_config.json`` rides in its ``__metadata__``), then the tensor bytes.
The layout depends only on the model spec, the adapter's config and the dtype, so every trainer rank
computes it alone (no communication), and the segment is created once and refilled every step.

Writing (:class:`TensorHandoff`, collective): every trainer rank of data-parallel replica 0 copies
its *own* LoRA shards straight into their places in the segment (a TP shard of a factor is chunk
``tp_rank`` of the full tensor along its split dimension; a factor every TP rank holds whole is
written by one of them, spread round-robin). No collective gathers the adapter, nothing is
pickled, no rank holds more than its own shards. Ranks that cannot map global rank 0's segment
(another node, or a container with its own ``/dev/shm``: each rank tries to map it by its random
name once, no host names involved) send their shards to rank 0 (which owns the engines) with tensor
point-to-point ops (one flat buffer and an int64 index, no pickle), and rank 0 copies them in.

Reading (:func:`open_adapter_segment`, the engine's side): zero-copy tensor views of the segment.
vLLM builds its LoRA model from them (:mod:`mlora.rollout.vllm_lora_hook`) and copies them into
its LoRA slots: shards -> segment -> slots, the two copies that are the floor with the engine in
another process (plus vLLM's own pass that folds alpha/r into B, made out of place by the hook so
that no engine writes into the shared segment).

The segment lives as long as the run: rank 0 unlinks it at ``close`` (and at exit; if rank 0 is
killed, its resource tracker removes it). Engines keep their mapping until they end.
"""

from __future__ import annotations

import atexit
import json
import re
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from mlora.export.sharded_write import select_shards
from mlora.formats.dtypes import SAFETENSORS_DTYPES
from mlora.formats.safetensors_writer import Layout, TensorShard, safetensors_header
from mlora.parallel.small_collectives import ranks_seeing
from mlora.rollout.shm_names import shm_name

SCHEME = "mlora-shm://"  # LoRARequest.lora_path of an adapter in a segment: mlora-shm://<segment>#<version>
CONFIG_KEY = "mlora_peft_config"  # __metadata__ key holding adapter_config.json


def lora_scaling(config: dict, module: str | None = None) -> float:
    """The factor vLLM folds into B (``PEFTHelper``: alpha / r, or alpha / sqrt(r) with rsLoRA) of ``module``
    (a PEFT tensor or module name; its ``rank_pattern`` rank, as vLLM matches it), or of a module at ``r``."""
    return lora_scalings(config)(module) if module is not None else _scaling(config, config["r"])


def lora_scalings(config: dict) -> Callable[[str], float]:
    """:func:`lora_scaling` of ``config`` as a function of the module, its ``rank_pattern`` read once: keys that are
    escaped exact paths (what mlora writes) looked up directly, any other scanned as vLLM does (first match wins)."""
    r, pattern = config["r"], config.get("rank_pattern") or {}
    exact = {key.replace("\\.", "."): rank for key, rank in pattern.items()}
    if all(re.escape(path) == key for path, key in zip(exact, pattern)):
        def rank_of(module: str) -> int:
            return exact.get(module, r)
    else:
        compiled = [(re.compile(rf"(.*\.)?({key})$"), rank) for key, rank in pattern.items()]

        def rank_of(module: str) -> int:
            return next((rank for key, rank in compiled if key.match(module)), r)

    def scaling(module: str) -> float:
        module = module.removeprefix("base_model.model.").removesuffix(".weight").rsplit(".lora_", 1)[0]
        return _scaling(config, rank_of(module))
    return scaling


def _scaling(config: dict, r: int) -> float:
    import math

    alpha = config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def prescaled_config(config: dict) -> tuple[dict, float]:
    """The config of the same adapter with the scaling already in B (alpha = r per module, no rsLoRA), and the
    scaling of the modules at ``r`` (:func:`lora_scaling` gives each module's). vLLM multiplies B by the scaling
    when it adds an adapter; with it folded in by the ranks as they write (same arithmetic, in the same dtype),
    the engine has nothing to do but copy the views into its LoRA slots."""
    scaling = lora_scaling(config)
    ranks = dict(config.get("rank_pattern") or {})
    return {**config, "lora_alpha": config["r"], "alpha_pattern": ranks, "use_rslora": False,
            "mlora_b_prescaled_by": scaling}, scaling


def segment_image_size(layout: Layout, config: dict) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """Header bytes, each tensor's byte span and the total size of the segment image."""
    head, spans = safetensors_header(layout, {"format": "pt", CONFIG_KEY: json.dumps(config, sort_keys=True)})
    return head, spans, max((b for _, b in spans.values()), default=len(head))


class _Mapping:
    """A mapped segment this process did not create: ``name``, ``size``, ``buf``, ``close()``.

    Python < 3.13's ``SharedMemory(name=...)`` registers every attach with the process's resource
    tracker, which then unlinks the segment when the process exits, under its creator's feet; and a
    spawned child shares its parent's tracker, so unregistering there would drop the creator's own
    registration. Mapping through ``shm_open`` + ``mmap`` (what ``SharedMemory`` does) involves no tracker."""

    def __init__(self, name: str) -> None:
        import _posixshmem  # CPython's shm_open binding, the one SharedMemory uses
        import mmap
        import os

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name, self.buf = name, memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()  # BufferError while tensor views of it are alive


def _attach(name: str) -> _Mapping:
    """Map an existing segment without taking ownership of it."""
    try:
        return _Mapping(name)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared-memory segment {name!r} does not exist on this node "
                                f"({socket.gethostname()}): its creator is gone or runs elsewhere") from None


def _views(buf: memoryview, spans: dict[str, tuple[int, int]], layout: Layout) -> dict[str, torch.Tensor]:
    out = {}
    for tname, (dtype, shape) in layout.items():
        start, end = spans[tname]
        if end == start:
            out[tname] = torch.empty(shape, dtype=dtype)
            continue
        out[tname] = torch.frombuffer(buf, dtype=torch.uint8, count=end - start, offset=start).view(dtype).view(shape)
    return out


@dataclass
class AdapterSegment:
    """An adapter in a mapped segment: zero-copy ``tensors``, the PEFT ``config``, the mapping ``shm``
    and the ``header`` bytes they were parsed from."""

    shm: _Mapping
    tensors: dict[str, torch.Tensor]
    config: dict
    header: bytes = b""

    def refresh(self) -> None:
        """After the trainer refilled the segment: re-parse only if the header changed (the views see
        the new bytes already)."""
        if bytes(self.shm.buf[:len(self.header)]) != self.header:
            self.tensors, self.config = parse_segment(self.shm.buf, f"shared-memory segment {self.shm.name!r}")
            self.header = _header_bytes(self.shm.buf)

    def close(self) -> None:
        """Drop the views and unmap (views handed out that are still alive keep the mapping until the
        process ends)."""
        self.tensors = {}
        try:
            self.shm.close()
        except BufferError:
            pass


def _header_bytes(buf: memoryview) -> bytes:
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    return bytes(buf[:8 + hlen])


def parse_segment(buf: memoryview, source: str = "segment") -> tuple[dict[str, torch.Tensor], dict]:
    """Zero-copy tensors and the PEFT config of a safetensors image in ``buf`` (see the module docstring)."""
    if len(buf) < 8:
        raise ValueError(f"{source}: {len(buf)} bytes, too small for a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if 8 + hlen > len(buf):
        raise ValueError(f"{source}: header of {hlen} bytes does not fit in {len(buf)} bytes")
    header = json.loads(bytes(buf[8:8 + hlen]))
    meta = header.pop("__metadata__", {}) or {}
    if CONFIG_KEY not in meta:
        raise ValueError(f"{source}: no {CONFIG_KEY!r} in the header's __metadata__ (not an mlora adapter segment)")
    layout, spans = {}, {}
    for tname, entry in header.items():
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{source}: tensor {tname!r} has dtype {entry['dtype']}, known: {sorted(SAFETENSORS_DTYPES)}")
        a, b = entry["data_offsets"]
        if not 0 <= a <= b <= len(buf) - 8 - hlen:
            raise ValueError(f"{source}: tensor {tname!r} spans bytes {a}..{b} beyond the segment's data")
        layout[tname] = (SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]))
        spans[tname] = (8 + hlen + a, 8 + hlen + b)
    return _views(buf, spans, layout), json.loads(meta[CONFIG_KEY])


def image_size(buf: memoryview) -> int:
    """Bytes of the safetensors image at the start of ``buf`` (a segment may be larger)."""
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    header = json.loads(bytes(buf[8:8 + hlen]))
    header.pop("__metadata__", None)
    return 8 + hlen + max((e["data_offsets"][1] for e in header.values()), default=0)


def open_adapter_segment(path: str) -> AdapterSegment:
    """Map the segment named by ``path`` (``mlora-shm://<segment>[#version]`` or a bare name)."""
    name = path[len(SCHEME):] if path.startswith(SCHEME) else path
    name = name.split("#", 1)[0]
    shm = _attach(name)
    tensors, config = parse_segment(shm.buf, f"shared-memory segment {name!r}")
    return AdapterSegment(shm, tensors, config, _header_bytes(shm.buf))


class SegmentWriter:
    """One process's handle on an adapter segment: create it (``create=True``, writes the header) or
    attach to it; ``view(name)`` is the tensor's place in it."""

    def __init__(self, layout: Layout, config: dict, name: str | None = None, create: bool = False) -> None:
        self.layout = dict(layout)
        head, self.spans, self.size = segment_image_size(self.layout, config)
        if create:
            self.name = name or shm_name("adapter")
            self.shm = SharedMemory(name=self.name, create=True, size=max(self.size, 1))
            self.shm.buf[:len(head)] = head
            atexit.register(self.unlink)
        else:
            if name is None:
                raise ValueError("attaching to an adapter segment needs its name")
            self.name, self.shm = name, _attach(name)
            if self.shm.size < self.size:
                raise ValueError(f"segment {name!r} holds {self.shm.size} bytes, the adapter needs {self.size}")
        self._owner = create
        self.tensors = _views(self.shm.buf, self.spans, self.layout)

    def view(self, tname: str) -> torch.Tensor:
        if tname not in self.tensors:
            raise KeyError(f"tensor {tname!r} is not in the adapter layout ({len(self.tensors)} tensors)")
        return self.tensors[tname]

    def close(self) -> None:
        self.tensors = {}
        try:
            self.shm.close()
        except BufferError:  # views handed out are still alive: the mapping goes with the process
            pass

    def unlink(self) -> None:
        """Remove the segment's name (creator only); mappings stay valid until closed."""
        if self._owner:
            self._owner = False
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _pieces(shards: Iterable[TensorShard]) -> list[tuple[str, torch.Tensor, int, int]]:
    """(name, shard, split dim or -1 for whole, chunk index) of each of ``shards``."""
    return [(s.name, s.tensor, -1 if s.dim is None else s.dim, s.index) for s in shards]


def select_pieces(shards: Iterable[tuple[str, torch.Tensor, str]], tp: int, tp_rank: int, dp_rank: int = 0
                  ) -> list[tuple[str, torch.Tensor, int, int]]:
    """What this rank writes of its ``shards`` ((PEFT name, shard, kind), in an order the stage's TP ranks
    share), as (name, shard, split dim or -1 for whole, chunk index): the choice every collective write of
    an adapter makes (:func:`mlora.export.sharded_write.select_shards`)."""
    return _pieces(select_shards(shards, tp, tp_rank, dp_rank))


def my_pieces(model, name: str) -> list[tuple[str, torch.Tensor, int, int]]:
    """This rank's pieces of adapter ``name``: the shards ``save_adapter`` writes (``model.adapter_shards``)."""
    return _pieces(model.adapter_shards(name))


def _place(seg: SegmentWriter, tname: str, dim: int, index: int, parts: int, shard: torch.Tensor,
           scale: float = 1.0) -> None:
    full = seg.view(tname)
    dst = full if dim < 0 else full.chunk(parts, dim=dim)[index]
    if tuple(dst.shape) != tuple(shard.shape):
        raise ValueError(f"adapter hand-off: {tname!r} shard {tuple(shard.shape)} (dim {dim}, chunk {index} of "
                         f"{parts}) does not fit its place {tuple(dst.shape)} in the full {tuple(full.shape)}")
    if scale == 1.0:
        dst.copy_(shard)  # one copy, device -> shared memory, with the dtype cast if any
    elif shard.dtype == dst.dtype and shard.device == dst.device:
        torch.mul(shard, scale, out=dst)  # the same one pass, scaled on the way
    else:  # cast first, then scale in the segment's dtype: vLLM's arithmetic (lora_b *= scaling) exactly
        dst.copy_(shard)
        dst.mul_(scale)


class SegmentHandoff:
    """Ranks fill one shared-memory segment with their pieces of an adapter (collective; every rank).

    ``layout``/``config``: the adapter's tensors (one dtype) and PEFT config, the same on every rank;
    ``tp``: the tensor-parallel size the pieces are cut for; ``device``: where point-to-point buffers
    live (the process group's device). Global rank 0 creates the segment (``segment`` is its name)
    and unlinks it at ``close``. Ranks that cannot map rank 0's segment (found once: each rank tries to map
    it by its random name; ``remote_ranks`` adds ranks that must not, for tests) ship their pieces to rank 0
    by point-to-point sends of one flat buffer and an int64 index. ``prescale``: B goes into the
    segment multiplied by the LoRA scaling, under a config with alpha = r (:func:`prescaled_config`),
    so that vLLM has no pass of its own to make over B.
    """

    def __init__(self, layout: Layout, config: dict, tp: int, device: torch.device | str = "cpu",
                 remote_ranks: Iterable[int] | None = None, prescale: bool = True) -> None:
        self.layout, self.tp, self.device = dict(layout), tp, torch.device(device)
        self.peft_config = config
        self.config, self.scaling = prescaled_config(config) if prescale else (config, 1.0)
        # each B's scaling, once: with a rank_pattern it differs between modules (an adapter's experts' own rank)
        scaling_of = lora_scalings(config) if prescale and config.get("rank_pattern") else lambda name: self.scaling
        self._b_scales = {name: scaling_of(name) for name in self.layout if name.endswith("lora_B.weight")}
        dtypes = {d for d, _ in self.layout.values()}
        if len(dtypes) > 1:
            raise ValueError(f"adapter hand-off: one dtype per adapter, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        rank, forced = dist.get_rank(), set(remote_ranks or ())
        if 0 in forced:
            raise ValueError("remote_ranks must not contain global rank 0 (it owns the segment)")
        self.seg = None

        def create() -> str:
            self.seg = SegmentWriter(self.layout, self.config, create=True)
            return self.seg.name

        def probe(name: str) -> bool:  # the name is a fresh random token: mapping it means sharing /dev/shm
            if rank in forced:
                return False
            try:
                self.seg = SegmentWriter(self.layout, self.config, name)
            except FileNotFoundError:
                return False
            return True

        # once per run; by token, not host name: containers of one host may not share /dev/shm
        self.segment, seen = ranks_seeing(create, probe, "creating the adapter's shared-memory segment")
        self.remote = [r for r, ok in enumerate(seen) if not ok]
        self.version = 0
        self._index = {n: i for i, n in enumerate(self.layout)}
        self._names = list(self.layout)

    @property
    def nbytes(self) -> int:
        """Bytes of the segment (header + tensors)."""
        return segment_image_size(self.layout, self.config)[2]

    def write_pieces(self, pieces: list[tuple[str, torch.Tensor, int, int]]) -> str:
        """Copy this rank's ``pieces`` (see :func:`select_pieces`) into the segment (collective);
        returns the ``LoRARequest`` path of this version on rank 0 (a new one each call, so that
        nothing cached under the old adapter's path, e.g. vLLM's prefix cache, is reused), "" elsewhere."""
        rank = dist.get_rank()
        with torch.no_grad():
            if rank in self.remote:
                self._send(pieces)
            else:
                for tname, shard, dim, index in pieces:
                    _place(self.seg, tname, dim, index, self.tp, shard, self._scale(tname))
            if rank == 0:
                for src in self.remote:
                    self._receive(src)
        dist.barrier()  # every piece is in place before rank 0 tells the engines
        self.version += 1
        return f"{SCHEME}{self.segment}#{self.version}" if rank == 0 else ""

    def _scale(self, tname: str) -> float:
        return self._b_scales.get(tname, 1.0)

    def _send(self, pieces) -> None:
        dev = self.device
        rows = [[self._index[t], dim, i, s.numel()] for t, s, dim, i in pieces]
        dist.send(torch.tensor([len(rows)], dtype=torch.long, device=dev), dst=0)
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        dist.send(index, dst=0)
        # one flat buffer, in the adapter's dtype: the size of this rank's share, never more
        dist.send(torch.cat([s.reshape(-1).to(dev, self.dtype) for _, s, _, _ in pieces]), dst=0)

    def _receive(self, src: int) -> None:
        dev = self.device
        count = torch.zeros(1, dtype=torch.long, device=dev)
        dist.recv(count, src=src)
        if int(count) == 0:
            return
        index = torch.empty(int(count), 4, dtype=torch.long, device=dev)
        dist.recv(index, src=src)
        index = index.cpu().tolist()
        flat = torch.empty(sum(r[3] for r in index), dtype=self.dtype, device=dev)
        dist.recv(flat, src=src)
        at = 0
        for t, dim, i, n in index:
            tname = self._names[t]
            full = self.seg.view(tname)
            place = full if dim < 0 else full.chunk(self.tp, dim=dim)[i]
            _place(self.seg, tname, dim, i, self.tp, flat[at:at + n].view(place.shape), self._scale(tname))
            at += n

    def close(self) -> None:
        """Unmap (every rank) and remove the segment (rank 0)."""
        if self.seg is not None:
            self.seg.unlink()
            self.seg.close()
            self.seg = None


class TensorHandoff(SegmentHandoff):
    """The trainer's side of ``weight_sync=tensors`` for adapter ``name`` of ``model`` (collective):
    the segment laid out from the model's spec, filled by :meth:`write` from each rank's own shards."""

    def __init__(self, model, name: str, remote_ranks: Iterable[int] | None = None) -> None:
        self.model, self.name = model, name
        # the segment holds the adapter in the base's dtype, tensors in layer order
        super().__init__(model.adapter_layout(name, dtype=model.dtype, order="layer"), model.adapter_peft_config(name),
                         model.mesh.tp, model.mesh.device, remote_ranks)

    def write(self) -> str:
        """This rank's shards of the adapter into the segment; see :meth:`SegmentHandoff.write_pieces`."""
        return self.write_pieces(my_pieces(self.model, self.name))
