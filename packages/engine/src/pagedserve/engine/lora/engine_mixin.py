"""The engine's adapter methods (vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras``), kept
beside the LoRA manager they drive; ``LLMEngine`` takes them as a mixin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.engine.lora.manager import LoRAManager, require_lora
from pagedserve.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedserve.engine.metrics import StatsCollector
    from pagedserve.scheduler import Scheduler


class LoRAEngineMixin:
    """Needs ``lora_manager`` (None without ``enable_lora``), ``scheduler`` and ``stats``."""

    lora_manager: LoRAManager | None
    scheduler: Scheduler
    stats: StatsCollector

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        if lora_request is None:
            return 0
        return require_lora(self.lora_manager).check_request(lora_request)

    def add_lora(self, lora_request: LoRARequest, weights=None) -> None:
        """Register an adapter (``weights``: what ``lora_manager.read`` gave, if read already)."""
        require_lora(self.lora_manager).add_lora(lora_request, weights)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter: its running and waiting requests finish with it first."""
        removed = self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)
        self._release_removed_loras()
        return removed

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora_manager is None else list(self.lora_manager.registered.values())

    def _release_removed_loras(self) -> None:
        """Free removed adapters whose last request is gone; record the adapters in use."""
        if (manager := self.lora_manager) is not None:
            manager.release_removed(self.scheduler.requests.values())
            self.stats.record_lora(*manager.adapters_in_use(self.scheduler.requests.values()))
