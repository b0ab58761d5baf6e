"""How each step's batch goes from rank 0 to the other ranks: torch.distributed broadcasts.

Rank 0 schedules and flattens the step (``ModelRunner.prepare_input``); the workers receive the
flat batch and run the same forward on their shard. One step is three broadcasts:

1. on the control group, a small pickled message: the command (``step``, ``keep_alive`` or
   ``stop``), the non-tensor fields (the padded batch size ...), and each tensor's name, dtype and
   shape;
2. on the step group, the tensors themselves, packed into one flat buffer per dtype (two
   buffers today: int64 token ids, positions, slots; int32 block tables, lengths), on the
   model's device (so NCCL carries them on GPUs).

The message lists fields by name from the dataclasses, so a field added to ``ModelInput`` or
``AttentionMetadata`` travels without changes here. A field marked as a host copy (its
metadata ``host_copy``: ``AttentionMetadata.query_start_loc_cpu``, ``seq_lens_cpu``) rides in
the pickled message itself, and arrives on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch
import torch.distributed as dist

from pagedserve.engine.distributed.group import ParallelGroups
from pagedserve.engine.model_runner import ModelInput
from pagedserve.models import AttentionMetadata

STEP, KEEP_ALIVE, STOP = "step", "keep_alive", "stop"


@dataclass
class Step:
    """What a worker needs to run one step: the prepared batch and the copy-on-write pairs."""

    model_input: ModelInput
    blocks_to_copy: list[tuple[int, int]]


class StepSender:
    """Rank 0's side: ``send(step)`` each step, ``keep_alive()`` when idle, ``stop()`` once."""

    def __init__(self, group: ParallelGroups) -> None:
        self.group = group
        self.control = group.control

    def send(self, step: Step) -> None:
        tensors: dict[str, torch.Tensor] = {}
        values = _flatten(step.model_input, "", tensors)
        values["blocks_to_copy"] = step.blocks_to_copy
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        dist.broadcast_object_list([(STEP, values, specs)], src=0, group=self.control)
        for names in _by_dtype(specs).values():
            self.group.broadcast(torch.cat([tensors[n].reshape(-1) for n in names]))

    def keep_alive(self) -> None:
        """Tell idle workers that rank 0 is alive, so their wait never reaches the timeout."""
        dist.broadcast_object_list([(KEEP_ALIVE, None, None)], src=0, group=self.control)

    def stop(self) -> None:
        dist.broadcast_object_list([(STOP, None, None)], src=0, group=self.control)


class StepReceiver:
    """A worker's side: ``receive()`` blocks until the next step, or returns None on stop."""

    def __init__(self, group: ParallelGroups, device: torch.device) -> None:
        self.group = group
        self.control = group.control
        self.device = device

    def receive(self) -> Step | None:
        command = KEEP_ALIVE
        while command == KEEP_ALIVE:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=self.control)
            command, values, specs = message[0]
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
