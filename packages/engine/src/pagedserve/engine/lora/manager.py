"""LoRAManager: the adapters an engine knows, which are read into host memory, which have a slot.

Three tiers, as in vLLM:

- registered: every adapter a request may name (its ``LoRARequest``), until it is removed;
- in host memory: at most ``max_cpu_loras`` adapters read and checked (``load_peft_adapter``),
  least recently used dropped first and read again from their folder when needed;
- on the device: ``max_loras`` slots of the model's stacked LoRA tensors. Each step, the
  adapters of its rows get a slot (a free one, else the least recently used slot whose adapter
  is not in the step) and every token gets its row's slot, ``-1`` for the base model.

The scheduler keeps the running requests within ``max_loras`` adapters, so a step always fits.
Removing an adapter that requests still use lets them finish: it leaves the registry at once
(no new request can name it) and its memory when its last request is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.lora.config import LoRAConfig
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.models import ModelConfig
from pagedserve.models.lora import (
    LoRAAdapterError,
    LoRAAdapterWeights,
    LoRAModel,
    load_peft_adapter,
)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: LoRAConfig):
        self.config = config
        self.dtype, self.device = model_config.torch_dtype, model_config.torch_device
        self.lora_model = LoRAModel(model, model_config, config.max_loras, config.max_lora_rank)
        self.registered: dict[int, LoRARequest] = {}
        self._removing: dict[int, LoRARequest] = {}
        # adapters whose weights are kept in host memory, least recently used first
        self.host: OrderedDict[int, LoRAAdapterWeights] = OrderedDict()
        self._slots: list[int | None] = [None] * config.max_loras
        self._slot_order: list[int] = list(range(config.max_loras))  # least recently used first

    # ---- registry ------------------------------------------------------------------------

    def read(self, request: LoRARequest) -> LoRAAdapterWeights:
        """Read and check an adapter's files; no state changes (safe from any thread)."""
        try:
            return load_peft_adapter(
                request.lora_path, self.lora_model, self.config.max_lora_rank, self.dtype
            )
        except LoRAAdapterError as e:
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r}: {e}", "lora_path"
            ) from e

    def add_lora(self, request: LoRARequest, weights: LoRAAdapterWeights | None = None) -> None:
        """Register ``request``'s adapter (read now unless ``weights`` were read already)."""
        known = self.registered.get(request.lora_int_id)
        if known == request:
            return
        if known is not None or request.lora_int_id in self._removing:
            raise InvalidRequestError(
                f"LoRA id {request.lora_int_id} is already used by another adapter", "lora_int_id"
            )
        if any(r.lora_name == request.lora_name for r in self.registered.values()):
            raise InvalidRequestError(
                f"a LoRA adapter named {request.lora_name!r} is already loaded", "lora_name"
            )
        weights = weights if weights is not None else self.read(request)
        self.registered[request.lora_int_id] = request
        self._keep_in_host(request.lora_int_id, weights)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; its memory goes once no live request uses it
        (``release_removed``). False if it was not registered."""
        request = self.registered.pop(lora_int_id, None)
        if request is None:
            return False
        self._removing[lora_int_id] = request
        return True

    def release_removed(self, live_requests: Iterable) -> None:
        """Free the host copy and the slot of each removed adapter that none of
        ``live_requests`` (the scheduler's requests) uses."""
        if not self._removing:
            return
        live_ids = {r.lora_int_id for r in live_requests}
        for lora_int_id in [i for i in self._removing if i not in live_ids]:
            del self._removing[lora_int_id]
            self.host.pop(lora_int_id, None)
            if lora_int_id in self._slots:
                slot = self._slots.index(lora_int_id)
                self._slots[slot] = None
                self.lora_model.clear_slot(slot)

    def adapters_in_use(self, live_requests: Iterable) -> tuple[int, tuple, tuple]:
        """(max_loras, names of the running requests' adapters, of the waiting ones')."""
        running, waiting = set(), set()
        for r in live_requests:
            if r.lora_int_id:
                known = self.registered.get(r.lora_int_id) or self._removing.get(r.lora_int_id)
                (running if r.status.name == "RUNNING" else waiting).add(known.lora_name)
        return self.config.max_loras, tuple(sorted(running)), tuple(sorted(waiting))

    def check_request(self, request: LoRARequest) -> int:
        """The id a new request runs with: its adapter registered (read now if it is new)."""
        if request.lora_int_id in self._removing:
            raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} is being unloaded")
        self.add_lora(request)
        return request.lora_int_id

    # ---- memory tiers --------------------------------------------------------------------

    def _keep_in_host(self, lora_int_id: int, weights: LoRAAdapterWeights) -> None:
        self.host[lora_int_id] = weights
        self.host.move_to_end(lora_int_id)
        while len(self.host) > self.config.cpu_capacity:
            self.host.popitem(last=False)

    def _host_weights(self, lora_int_id: int) -> LoRAAdapterWeights:
        weights = self.host.get(lora_int_id)
        if weights is None:  # dropped from host memory: read its folder again
            request = self.registered.get(lora_int_id) or self._removing[lora_int_id]
            weights = self.read(request)
            self._keep_in_host(lora_int_id, weights)
        else:
            self.host.move_to_end(lora_int_id)
        return weights

    def _slot_for(self, lora_int_id: int, in_step: set[int]) -> int:
        if lora_int_id in self._slots:
            slot = self._slots.index(lora_int_id)
        else:
            free = [s for s in self._slot_order if self._slots[s] not in in_step]
            slot = next((s for s in free if self._slots[s] is None), free[0])
            self.lora_model.set_slot(slot, self._host_weights(lora_int_id).weights)
            self._slots[slot] = lora_int_id
        self._slot_order.remove(slot)
        self._slot_order.append(slot)
        return slot

    def token_slots(self, lora_ids: list[int], counts: list[int]) -> torch.Tensor | None:
        """The slot of every token of a step whose requests (in order) use ``lora_ids`` (0: the
        base model) for ``counts`` tokens each; None when no row has an adapter."""
        in_step = {i for i in lora_ids if i}
        if not in_step:
            return None
        if len(in_step) > self.config.max_loras:
            raise RuntimeError(
                f"a step with {len(in_step)} adapters; max_loras is {self.config.max_loras}"
            )
        slot_of = {i: self._slot_for(i, in_step) for i in in_step}
        per_row = np.array([slot_of[i] if i else -1 for i in lora_ids], dtype=np.int64)
        return torch.from_numpy(np.repeat(per_row, counts)).to(self.device)

    def set_batch(self, token_slot: torch.Tensor | None) -> None:
        self.lora_model.set_batch(token_slot)

    @property
    def resident(self) -> dict[int, int]:
        """adapter id -> slot, for the adapters on the device."""
        return {i: s for s, i in enumerate(self._slots) if i is not None}


def require_lora(manager: LoRAManager | None) -> LoRAManager:
    """The engine's manager, or the error a LoRA request gets from an engine without LoRA."""
    if manager is None:
        raise InvalidRequestError("LoRA is not enabled (start with enable_lora)", "lora_request")
    return manager
