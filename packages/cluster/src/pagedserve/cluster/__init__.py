"""pagedserve.cluster: replicas of several models behind one OpenAI endpoint, on Ray Serve.

Ray Serve runs the replicas (placement, restarts, autoscaling, the HTTP proxy); pagedserve runs
one engine per replica (``replica.EngineReplica``), the ingress (the server package's routes over
remote engines, ``ingress``), and the routing inside a model (``routing``: prefix-aware or
round-robin). ``config`` reads the cluster's YAML; ``deploy`` applies it; ``cli`` is
``pagedserve cluster``. Imports of Ray Serve are at module level, so importing this package
needs ``ray[serve]``; nothing else in pagedserve imports it.
"""

from pagedserve.cluster.config import (
    ClusterConfig,
    ClusterConfigError,
    ModelDeploymentConfig,
    build_serve_config,
    load_config,
)

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "ModelDeploymentConfig",
    "build_serve_config",
    "load_config",
]
