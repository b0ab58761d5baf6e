"""KV connectors: keys and values that travel out of the engine's KV cache and back in.

- ``OffloadingConnector`` (offloading.py): a prefix cache that spills to host memory and disk
  (``--kv-offload-memory``, ``--kv-offload-dir``, ``--kv-offload-disk``) and survives a
  restart;
- ``TCPConnector`` (tcp_connector.py): disaggregated prefill and decode, the blocks a prefill
  engine computed fetched by the decode engine over TCP (``--kv-transfer-config``).

Both are one machinery (base.py, in vLLM V1's shape): the scheduler asks how many of a
request's tokens the connector can supply, the runner loads and saves whole blocks around the
forward (block_io.py), and every block that leaves the process is a record whose header pins
what it is (block_record.py). docs/kv_connectors.md tells the story.
"""

from __future__ import annotations

from pagedserve.engine.kv_connector.base import KVConnectorBase
from pagedserve.engine.kv_connector.block_record import (
    BlockLayout,
    model_fingerprint,
    record_dtype_name,
)
from pagedserve.engine.kv_connector.config import (
    DEFAULT_DISK_BYTES,
    KVTransferConfig,
    KVTransferConfigError,
    check_connector_args,
)
from pagedserve.engine.kv_connector.stats import KVConnectorStats, StatsRecorder

__all__ = [
    "KVConnectorBase",
    "KVConnectorStats",
    "KVTransferConfig",
    "KVTransferConfigError",
    "check_connector_args",
    "create_kv_connector",
]


def create_kv_connector(args, model_config, runner) -> KVConnectorBase | None:
    """The engine's connector, its KV cache registered (None when no option asks for one)."""
    offload = args.kv_offload_memory is not None or args.kv_offload_dir is not None
    if not offload and args.kv_transfer_config is None:
        return None
    if model_config.kv_cache_window is not None:
        raise ValueError(
            "KV offloading and kv_transfer_config do not support a model whose every layer has "
            "a sliding window yet (its blocks behind the window are released as it runs)"
        )
    layout = BlockLayout(
        model_fingerprint(model_config.model, args.dtype, model_config.quantization),
        record_dtype_name(runner.kv_cache_dtype),
        args.block_size,
        model_config.num_layers,
        runner.kv_caches[0][0].shape[2],
        model_config.head_dim,
    )
    stats = StatsRecorder()
    if offload:
        connector = _offloading_connector(args, layout, stats)
    else:
        from pagedserve.engine.kv_connector.tcp_connector import TCPConnector

        config = KVTransferConfig.from_dict(args.kv_transfer_config)
        connector = TCPConnector(config, layout, stats)
    connector.register_kv_caches(runner.kv_caches)
    return connector


def _offloading_connector(args, layout: BlockLayout, stats: StatsRecorder):
    from pagedserve.engine.kv_connector.disk_tier import DiskTier
    from pagedserve.engine.kv_connector.host_tier import HostTier
    from pagedserve.engine.kv_connector.offloading import OffloadingConnector

    block_bytes = layout.payload_bytes
    host = HostTier(args.kv_offload_memory, block_bytes) if args.kv_offload_memory else None
    disk = None
    if args.kv_offload_dir is not None:
        capacity = args.kv_offload_disk or DEFAULT_DISK_BYTES
        disk = DiskTier(args.kv_offload_dir, layout, capacity, stats)
    return OffloadingConnector(layout.block_size, host, disk, stats)
