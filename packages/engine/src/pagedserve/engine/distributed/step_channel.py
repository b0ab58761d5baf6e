"""How each step's batch goes from rank 0 to the other ranks: torch.distributed broadcasts.

Rank 0 schedules and flattens the step (``ModelRunner.prepare_input``); the workers receive the
flat batch and run the same forward on their shard. One step is a few broadcasts:

1. on the control group, a small pickled message (its length, then its bytes): the command
   (``step``, ``keep_alive`` or ``stop``), the non-tensor fields (the padded batch size ...),
   and each tensor's name, dtype and shape;
2. on the step group, the tensors themselves, packed into one flat buffer per dtype (two
   buffers today: int64 token ids, positions, slots; int32 block tables, lengths), on the
   model's device (so NCCL carries them on GPUs).

Rank 0 sends a step without waiting for it to arrive (``async_op``): with pipeline stages it
sends step N+1 and then runs its own part of step N, while a stage-mate of its own may still be
inside step N's collectives and take N+1's broadcast only afterwards (``SentStep.wait``, once
the step is done, releases the buffers).

The message lists fields by name from the dataclasses, so a field added to ``ModelInput`` or
``AttentionMetadata`` travels without changes here. A field marked as a host copy (its
metadata ``host_copy``: ``AttentionMetadata.query_start_loc_cpu``, ``seq_lens_cpu``) rides in
the pickled message itself, and arrives on the host.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, fields, is_dataclass

import torch
import torch.distributed as dist

from pagedserve.engine.distributed.group import ParallelGroups
from pagedserve.engine.model_input import ModelInput
from pagedserve.models import AttentionMetadata

STEP, KEEP_ALIVE, STOP = "step", "keep_alive", "stop"


@dataclass
class Step:
    """What a worker needs to run one step: the prepared batch and the copy-on-write pairs."""

    model_input: ModelInput
    blocks_to_copy: list[tuple[int, int]]


@dataclass
class SentStep:
    """Broadcasts under way, and the buffers they read (kept alive until they are done)."""

    works: list = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


class StepSender:
    """Rank 0's side: ``send(step)`` each step, ``keep_alive()`` when idle, ``stop()`` once."""

    def __init__(self, group: ParallelGroups) -> None:
        self.group = group
        self.control = group.control

    def send(self, step: Step) -> SentStep:
        """Start broadcasting ``step``; the caller waits on the result once the step is done."""
        tensors: dict[str, torch.Tensor] = {}
        values = _flatten(step.model_input, "", tensors)
        values["blocks_to_copy"] = step.blocks_to_copy
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        sent = _send_message((STEP, values, specs), self.control)
        for names in _by_dtype(specs).values():
            flat = torch.cat([tensors[n].reshape(-1) for n in names])
            sent.works.append(self.group.broadcast(flat, async_op=True))
            sent.buffers.append(flat)
        return sent

    def keep_alive(self) -> None:
        """Tell idle workers that rank 0 is alive, so their wait never reaches the timeout."""
        _send_message((KEEP_ALIVE, None, None), self.control).wait()

    def stop(self) -> None:
        _send_message((STOP, None, None), self.control).wait()


class StepReceiver:
    """A worker's side: ``receive()`` blocks until the next step, or returns None on stop."""

    def __init__(self, group: ParallelGroups, device: torch.device) -> None:
        self.group = group
        self.control = group.control
        self.device = device

    def receive(self) -> Step | None:
        command = KEEP_ALIVE
        while command == KEEP_ALIVE:
            command, values, specs = _receive_message(self.control)
        if command == STOP:
            return None
        tensors: dict[str, torch.Tensor] = {}
        shapes = {name: shape for name, _, shape in specs}
        for dtype, names in _by_dtype(specs).items():
            sizes = [_numel(shapes[n]) for n in names]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self.group.broadcast(flat)
            for name, piece in zip(names, flat.split(sizes), strict=True):
                tensors[name] = piece.view(shapes[name])
        blocks_to_copy = values.pop("blocks_to_copy")
        return Step(_unflatten(ModelInput, "", values, tensors), blocks_to_copy)


def _send_message(message, group) -> SentStep:
    """Broadcast a picklable ``message`` from rank 0: its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in (size, data)]
    return SentStep(works, [size, data])


def _receive_message(group):
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


_NESTED = {"attn_metadata": AttentionMetadata}


def _flatten(obj, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors into ``tensors`` under dotted names; every other field into the returned dict."""
    values = {}
    for f in fields(obj):
        value, name = getattr(obj, f.name), prefix + f.name
        if isinstance(value, torch.Tensor) and not f.metadata.get("host_copy"):
            tensors[name] = value
        elif is_dataclass(value):
            values.update(_flatten(value, name + ".", tensors))
        else:
            values[name] = value
    return values


def _unflatten(cls, prefix: str, values: dict, tensors: dict[str, torch.Tensor]):
    kwargs = {}
    for f in fields(cls):
        name = prefix + f.name
        if f.name in _NESTED:
            kwargs[f.name] = _unflatten(_NESTED[f.name], name + ".", values, tensors)
        else:
            kwargs[f.name] = tensors[name] if name in tensors else values[name]
    return cls(**kwargs)


def _by_dtype(specs) -> dict[torch.dtype, list[str]]:
    groups: dict[torch.dtype, list[str]] = {}
    for name, dtype, _ in specs:
        groups.setdefault(dtype, []).append(name)
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
