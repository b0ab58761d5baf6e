"""CUDA graphs for decode: persistent, padded input buffers and one captured forward per bucket.

A decode step launches a few kernels per layer for a handful of tokens each; on a fast GPU the
launches, not the math, set the step time. A CUDA graph records the whole forward once and
replays it with one launch, but it replays the very same tensors, shapes and grids. So, as in
vLLM:

- the inputs live in persistent buffers (token ids, positions, slot mapping, block tables, seq
  lens, query_start_loc), sized for the largest batch and written in place every step;
- batch sizes come in buckets (``cuda_graph_sizes``): a pure-decode step of b sequences (every
  scheduled request runs exactly one new token) is padded to the smallest bucket >= b, and the
  graph captured for that bucket is replayed;
- a padding row is a one-token sequence over a reserved KV block that no sequence owns: the
  runner allocates one block more than it hands the KVCacheManager, and padding rows store
  their key and value into slot 0 of that block and attend over it alone (seq_len 1). They read
  and write nothing a real sequence owns, and their outputs are never turned into logits;
- prefill and mixed steps stay eager, and so does everything when ``enforce_eager`` is set.

On CPU there is nothing to capture, but the same padded path runs eagerly when
``pad_decode_on_cpu`` is set, which is how the tests hold it equal to the unpadded path.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.blockmgr.slot_mapping import PagedBatch
from pagedserve.models import AttentionMetadata

logger = logging.getLogger("pagedserve.engine")


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode buckets: 1, 2, 4, 8, then every 8 up to 256, then every 16, as vLLM's
    defaults; capped at ``max_num_seqs``, which is always a bucket itself."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16)]
    sizes = [s for s in sizes if s < max_num_seqs]
    return [*sizes, max_num_seqs]


@dataclass(frozen=True)
class CUDAGraphConfig:
    """How the model runner runs decode steps.

    ``enforce_eager`` (vLLM's name): never capture; every step runs eagerly and unpadded.
    ``pad_decode_on_cpu``: on CPU, run pure-decode steps through the padded buffers anyway
    (eagerly); for tests, which check that padding changes no real row's output.
    """

    max_num_seqs: int = 64
    enforce_eager: bool = False
    pad_decode_on_cpu: bool = False

    def capture_sizes(self) -> list[int]:
        return cuda_graph_sizes(self.max_num_seqs)

    def pads_decode(self, device: torch.device) -> bool:
        if device.type == "cuda":
            return not self.enforce_eager
        return self.pad_decode_on_cpu

    def captures(self, device: torch.device) -> bool:
        return device.type == "cuda" and not self.enforce_eager


class DecodeInputBuffers:
    """The persistent inputs of padded decode steps, ``sizes[-1]`` rows each.

    ``load`` writes a step into the host side (pinned on CUDA) and copies the first ``bucket``
    rows to the device without blocking. Before the next ``load`` rewrites the host side it
    waits for that copy (an event; in practice long done, since the engine has read the step's
    sampled tokens back by then).
    Block-table columns past a sequence's own blocks keep stale ids from earlier steps: every
    kernel stops at ``seq_len``, so they are never read.
    """

    def __init__(
        self,
        sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        padding_block: int,
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.padding_block = padding_block
        self.padding_slot = padding_block * block_size
        rows = self.sizes[-1]
        shapes = {
            "input_ids": ((rows,), torch.int64),
            "positions": ((rows,), torch.int64),
            "slot_mapping": ((rows,), torch.int64),
            "block_tables": ((rows, max_blocks_per_seq), torch.int32),
            "seq_lens": ((rows,), torch.int32),
        }
        pin = device.type == "cuda"
        self.host = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=pin)
            for name, (shape, dtype) in shapes.items()
        }
        self._np = {name: t.numpy() for name, t in self.host.items()}
        self.device_buffers = (
            self.host
            if device.type == "cpu"
            else {name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
        )
        # query_start_loc of a decode batch is 0, 1, ..., n whatever the tokens: written once
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.arange(rows + 1, dtype=torch.int32)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pad_rows(0, rows)  # capture runs on these: padding rows only
        if self.device_buffers is not self.host:
            for name, t in self.device_buffers.items():
                t.copy_(self.host[name])

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds ``num_seqs`` rows; None past the largest."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def _pad_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) as padding: token 0 at position 0, in the reserved block."""
        a = self._np
        a["input_ids"][start:stop] = 0
        a["positions"][start:stop] = 0
        a["slot_mapping"][start:stop] = self.padding_slot
        a["block_tables"][start:stop] = self.padding_block
        a["seq_lens"][start:stop] = 1

    def load(
        self, input_ids: np.ndarray, batch: PagedBatch, bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write a pure-decode step padded to ``bucket`` rows; returns views of the buffers."""
        num_seqs, width = batch.block_tables.shape
        if self._copied is not None:
            self._copied.synchronize()
        a = self._np
        a["input_ids"][:num_seqs] = input_ids
        a["positions"][:num_seqs] = batch.positions
        a["slot_mapping"][:num_seqs] = batch.slot_mapping
        a["block_tables"][:num_seqs, :width] = batch.block_tables
        a["seq_lens"][:num_seqs] = batch.seq_lens
        self._pad_rows(num_seqs, bucket)
        if self.device_buffers is not self.host:
            for name, t in self.device_buffers.items():
                t[:bucket].copy_(self.host[name][:bucket], non_blocking=True)
            self._copied.record()
        return self.views(bucket)

    def views(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The first ``bucket`` rows of every buffer: what one padded step reads."""
        d = self.device_buffers
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:bucket],
            block_tables=d["block_tables"][:bucket],
            seq_lens=d["seq_lens"][:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: bucket + 1],
        )
        return d["input_ids"][:bucket], d["positions"][:bucket], meta


class DecodeCUDAGraphs:
    """One captured decode forward per bucket, all reading ``buffers`` and sharing one pool.

    Captured largest first (vLLM's order) so the smaller graphs reuse the largest one's memory.
    Each bucket runs once eagerly before its capture, on a side stream as torch's CUDA-graph
    notes advise: Triton compiles its kernels then, never inside a capture. Capture runs on the
    padding rows the buffers start with, so it writes only the reserved block. The forward must
    not synchronise with the host (the Triton kernels do not; the torch references do, which is
    why the runner captures only when the kernels dispatch to Triton).
    """

    def __init__(self, model, kv_caches, buffers: DecodeInputBuffers) -> None:
        self.buffers = buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = None
        for size in reversed(buffers.sizes):
            input_ids, positions, meta = buffers.views(size)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(input_ids, positions, kv_caches, meta)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model(input_ids, positions, kv_caches, meta)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (%d..%d) in %.1f s",
            len(self.graphs),
            buffers.sizes[0],
            buffers.sizes[-1],
            time.perf_counter() - start,
        )

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of ``bucket`` on what the buffers hold now; its hidden states [bucket, H]
        (a buffer the next replay overwrites)."""
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden
