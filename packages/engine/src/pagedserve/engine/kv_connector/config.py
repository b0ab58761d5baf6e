"""The KV connector's configuration: offloading's three options, and vLLM's KVTransferConfig.

Offloading is ``kv_offload_memory`` (bytes of host memory), ``kv_offload_dir`` (a folder) and
``kv_offload_disk`` (bytes of files in it); a disaggregated prefill/decode pair is
``kv_transfer_config``, vLLM's JSON::

    {"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1",
     "kv_port": 14579}                                    # the prefill engine
    {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}   # the decode engine

Every field of vLLM's that pagedserve does not implement is refused by name (a value that
changes nothing, such as its default, is let through), as is every key of
``kv_connector_extra_config`` it does not read. Every check runs at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.engine.config import ConfigFieldError, config_dict

CONNECTORS = ("TCPConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_DISK_BYTES = 4 << 30
DEFAULT_PORT = 14579  # vLLM's default kv_port
# kv_connector_extra_config keys: what each sets, and its default
EXTRA_KEYS = {
    "transfer_timeout": 10.0,  # seconds a decode engine waits for a transfer (else recomputes)
    "transfer_ttl": 60.0,  # seconds a prefill engine keeps a transfer nobody has fetched
    "prefill_url": None,  # a decode server's prefill server (its proxy route)
}
# vLLM's fields without a counterpart here, and why (refused unless given their default)
REFUSED = {
    "kv_rank": "pagedserve pairs engines by the handle each prefill returns (remote_host, "
    "remote_port), not by ranks",
    "kv_parallel_size": "pagedserve pairs engines by the handle each prefill returns, not by "
    "a group size",
    "kv_connector_module_path": "pagedserve loads no connector code named in its config",
    "enable_permute_local_kv": "pagedserve's transfers keep the cache's own layout",
    "kv_buffer_device": "the transfer buffer is host memory: only 'cpu' is implemented",
    "kv_load_failure_policy": "a failed transfer is always recomputed ('recompute')",
}
_REFUSED_DEFAULTS = {
    "kv_rank": None,
    "kv_parallel_size": 1,
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
    "kv_buffer_device": "cpu",
    "kv_load_failure_policy": "recompute",
}


class KVTransferConfigError(ConfigFieldError):
    """An invalid kv_transfer_config; ``param`` names the field at fault."""

    config_name = "kv_transfer_config"


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's KVTransferConfig, the fields pagedserve implements (module docstring).

    ``kv_role``: ``kv_producer`` (a prefill engine: it keeps the blocks of requests sent with
    ``do_remote_decode`` and serves them on ``kv_ip:kv_port``), ``kv_consumer`` (a decode
    engine: it fetches the blocks a request's ``kv_transfer_params`` name) or ``kv_both``.
    ``kv_buffer_size``: bytes of host memory the producer keeps unfetched transfers in.
    """

    kv_connector: str = "TCPConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_PORT
    kv_buffer_size: float = 1e9
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str) -> KVTransferConfig:
        value = config_dict(value, KVTransferConfigError)
        known = {f.name for f in fields(cls)}
        for name, given in value.items():
            if name in REFUSED and given != _REFUSED_DEFAULTS[name]:
                raise KVTransferConfigError(name, f"not implemented: {REFUSED[name]}")
            if name not in known and name not in REFUSED:
                raise KVTransferConfigError(name, "unknown field")
        config = cls(**{k: v for k, v in value.items() if k in known})
        config.check()
        return config

    def check(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise KVTransferConfigError(
                "kv_connector",
                f"{self.kv_connector!r} is not implemented; pagedserve has {CONNECTORS} (blocks "
                "over TCP); for KV offloading use --kv-offload-memory / --kv-offload-dir",
            )
        if self.kv_role not in ROLES:
            raise KVTransferConfigError("kv_role", f"must be one of {ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise KVTransferConfigError("kv_port", f"not a port: {self.kv_port!r}")
        if not self.kv_buffer_size > 0:
            raise KVTransferConfigError("kv_buffer_size", "must be a positive number of bytes")
        for key, given in self.kv_connector_extra_config.items():
            if key not in EXTRA_KEYS:
                raise KVTransferConfigError(
                    f"kv_connector_extra_config.{key}",
                    f"not implemented; pagedserve reads {sorted(EXTRA_KEYS)}",
                )
            if key != "prefill_url" and not (isinstance(given, int | float) and given > 0):
                raise KVTransferConfigError(
                    f"kv_connector_extra_config.{key}", "must be a positive number of seconds"
                )
        url = self.extra("prefill_url")
        if url is not None and not (
            self.is_consumer and isinstance(url, str) and url.startswith(("http://", "https://"))
        ):
            raise KVTransferConfigError(
                "kv_connector_extra_config.prefill_url",
                "the prefill server's http(s):// URL, for a kv_consumer (or kv_both) engine",
            )

    def extra(self, key: str):
        """A ``kv_connector_extra_config`` value, or its default."""
        return self.kv_connector_extra_config.get(key, EXTRA_KEYS[key])

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def check_connector_args(args) -> None:
    """What the engine's other options rule out with a KV connector (``EngineArgs``), at
    start-up: each message names the option at fault."""
    offload = args.kv_offload_memory is not None or args.kv_offload_dir is not None
    if args.kv_offload_disk is not None and args.kv_offload_dir is None:
        raise ValueError("kv_offload_disk bounds the files in kv_offload_dir: give that folder")
    if not offload and args.kv_transfer_config is None:
        return
    if offload and args.kv_transfer_config is not None:
        raise ValueError(
            "kv_transfer_config with KV offloading (kv_offload_memory, kv_offload_dir) is not "
            "implemented yet: give one or the other"
        )
    what = "kv_transfer_config" if not offload else "KV offloading (kv_offload_*)"
    refused = {
        "enable_prefix_caching=False": (
            not args.enable_prefix_caching,
            "its blocks are named by the prefix cache's hashes",
        ),
        "tensor_parallel_size > 1": (
            args.tensor_parallel_size > 1,
            "it moves the blocks of one process's cache",
        ),
        "pipeline_parallel_size > 1": (
            args.pipeline_parallel_size > 1,
            "it moves the blocks of one process's cache",
        ),
        "a draft model (speculative_config)": (
            _has_draft_model(args.speculative_config),
            "it carries the target model's cache, not the draft's",
        ),
    }
    for name, (given, why) in refused.items():
        if given:
            raise ValueError(f"{what} does not work with {name}: {why}")


def _has_draft_model(speculative_config: dict | None) -> bool:
    if speculative_config is None:
        return False
    method = speculative_config.get("method")
    model = speculative_config.get("model")
    return method == "draft_model" or (method is None and model not in (None, "ngram", "[ngram]"))
