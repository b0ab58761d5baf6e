"""Blocks over TCP between a prefill engine and a decode engine: the buffer, the server, the
fetch.

The prefill engine (producer) copies the full blocks of each prompt it prefills for a remote
decode into a ``TransferBuffer`` as they are computed (host memory, within ``kv_buffer_size``
bytes), marks the transfer ready when the request finishes, and serves it from a
``TransferServer`` thread. The KV cache's own blocks are freed as any finished request's:
nothing on the prefill side waits for the decode side.

The decode engine (consumer) fetches a transfer once (``fetch_blocks``, in a loader thread):

    -> {"transfer_id": ID, "first_block": i, "num_blocks": n}\\n
    <- {"num_blocks": k}\\n  then k times: 8-byte little-endian length, one block record
    <- {"error": "..."}\\n   (an unknown, expired or already fetched transfer)

Each record is checked against the decode engine's own layout and the key it expects for that
block (block_record.py): the chain hash of the block's tokens from ``TRANSFER_ROOT``, which
both engines compute from the prompt alone. A record that fails is refused and counted; the
fetch ends at it, and what did not arrive is recomputed. Every socket operation runs under one
deadline (``transfer_timeout``), so a dead or stalled prefill engine costs a decode request at
most that long, never a hang. A transfer is dropped once sent, or ``transfer_ttl`` seconds
after it was ready if nobody fetched it.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pagedserve.engine.kv_connector.block_record import (
    BlockLayout,
    BlockRecordError,
    check_record,
    encode_header,
)
from pagedserve.engine.kv_connector.stats import StatsRecorder

logger = logging.getLogger("pagedserve.engine")

TRANSFER_ROOT = b"pagedserve:xfer1"  # the public root of transfer keys: both sides agree
LENGTH = struct.Struct("<Q")
MAX_REQUEST_LINE = 4096


@dataclass
class Transfer:
    """One prompt's blocks, in order, under the keys the consumer checks them by."""

    keys: list[bytes]
    payloads: list[np.ndarray] = field(default_factory=list)
    ready_until: float | None = None  # set when the request finished: expires then
    truncated: bool = False  # the buffer was full: no later block joins it

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)


class TransferBuffer:
    """Transfers by id, within ``capacity_bytes``; the engine thread fills, the server takes."""

    def __init__(self, capacity_bytes: int, stats: StatsRecorder) -> None:
        self.capacity_bytes = capacity_bytes
        self._stats = stats
        self._lock = threading.Lock()
        self._transfers: OrderedDict[str, Transfer] = OrderedDict()
        self._used = self._num_blocks = 0

    def open(self, transfer_id: str, keys: list[bytes]) -> None:
        with self._lock:
            self._transfers[transfer_id] = Transfer(keys)

    def add(self, transfer_id: str, payload: np.ndarray) -> None:
        """The transfer's next block; dropped (counted) when the buffer cannot make room even
        by dropping expired and then the oldest ready transfers."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None or transfer.truncated:
                return
            self._make_room(payload.nbytes)
            if self._used + payload.nbytes > self.capacity_bytes:
                transfer.truncated = True
                self._stats.dropped("remote")
                return
            transfer.payloads.append(payload)
            self._used += payload.nbytes
            self._num_blocks += 1
            self._stats.usage("remote", self._num_blocks, self._used)
        self._stats.saved("remote", payload.nbytes)

    def finish(self, transfer_id: str, ttl: float) -> int:
        """Mark a transfer ready for ``ttl`` seconds; how many blocks it holds."""
        with self._lock:
            transfer = self._transfers[transfer_id]
            transfer.ready_until = time.monotonic() + ttl
            return len(transfer.payloads)

    def drop(self, transfer_id: str) -> None:
        with self._lock:
            self._remove(transfer_id)

    def take(self, transfer_id: str) -> Transfer | None:
        """A ready, unexpired transfer, removed from the buffer (served once)."""
        with self._lock:
            self._expire()
            transfer = self._transfers.get(transfer_id)
            if transfer is None or transfer.ready_until is None:
                return None
            self._remove(transfer_id)
            return transfer

    def _make_room(self, nbytes: int) -> None:
        self._expire()
        ready = [tid for tid, t in self._transfers.items() if t.ready_until is not None]
        while self._used + nbytes > self.capacity_bytes and ready:
            self._remove(ready.pop(0))  # the oldest ready transfer: its consumer is late

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, x in self._transfers.items() if (x.ready_until or now) < now]:
            self._remove(tid)

    def _remove(self, transfer_id: str) -> None:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            self._used -= transfer.nbytes
            self._num_blocks -= len(transfer.payloads)
        self._stats.usage("remote", self._num_blocks, self._used)


class TransferServer:
    """Serves a ``TransferBuffer`` on ``host:port`` (port 0: any free one) from threads."""

    def __init__(self, buffer: TransferBuffer, layout: BlockLayout, host: str, port: int):
        handler = _handler(buffer, layout)
        self._server = socketserver.ThreadingTCPServer((host, port), handler, False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-transfer-server", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(buffer: TransferBuffer, layout: BlockLayout):
    class Handler(socketserver.StreamRequestHandler):
        timeout = 30.0

        def handle(self) -> None:
            try:
                ask = json.loads(self.rfile.readline(MAX_REQUEST_LINE))
                transfer = buffer.take(str(ask["transfer_id"]))
                first, count = int(ask["first_block"]), int(ask["num_blocks"])
            except (ValueError, KeyError, TypeError, OSError):
                return self._reply({"error": "not a transfer request"})
            if transfer is None:
                return self._reply({"error": "unknown, expired or already fetched transfer"})
            blocks = list(range(first, min(first + count, len(transfer.payloads))))
            self._reply({"num_blocks": len(blocks)})
            for index in blocks:
                payload = transfer.payloads[index]
                header = encode_header(layout, transfer.keys[index], payload)
                self.wfile.write(LENGTH.pack(len(header) + payload.nbytes) + header)
                self.wfile.write(memoryview(payload))

        def _reply(self, message: dict) -> None:
            self.wfile.write(json.dumps(message).encode() + b"\n")

    return Handler


def fetch_blocks(
    address: tuple[str, int],
    transfer_id: str,
    first_block: int,
    keys: list[bytes],
    layout: BlockLayout,
    timeout: float,
    stats: StatsRecorder,
) -> list[np.ndarray]:
    """The blocks ``first_block``... of a transfer, checked against ``keys`` (one per block
    wanted): the leading ones that arrived whole and sound, all within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    payloads: list[np.ndarray] = []
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            ask = {"transfer_id": transfer_id, "first_block": first_block, "num_blocks": len(keys)}
            sock.sendall(json.dumps(ask).encode() + b"\n")
            reply = json.loads(_read_line(sock, deadline))
            if "error" in reply:
                raise ConnectionError(reply["error"])
            for key in keys[: int(reply["num_blocks"])]:
                (length,) = LENGTH.unpack(_read_exactly(sock, LENGTH.size, deadline))
                if length > layout.payload_bytes + 4096:
                    raise BlockRecordError("corrupt", f"a record of {length} bytes")
                payloads.append(check_record(layout, key, _read_exactly(sock, length, deadline)))
    except BlockRecordError as e:
        stats.rejected(e.kind)
        logger.warning("KV transfer %s: block %d refused: %s", transfer_id, len(payloads), e)
    except (OSError, ValueError, KeyError) as e:
        logger.warning("KV transfer %s from %s:%s failed: %s", transfer_id, *address, e)
    return payloads


def _read_exactly(sock: socket.socket, size: int, deadline: float) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the prefill engine closed the transfer after {got} bytes")
        got += n
    return buffer


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        if len(line) > MAX_REQUEST_LINE:
            raise ConnectionError("no reply line from the prefill engine")
        line += _read_exactly(sock, 1, deadline)
    return bytes(line)
