"""Clients for many executors: layer groups, adapter-affinity routing, failover.

    with ClusterClient(["dns:///executor-layers-0-23.ml.svc:50052",
                        "dns:///executor-layers-24-47.ml.svc:50052"]) as cluster:
        out = cluster.forward(layer=30, hidden=h, segments=[(5, "sql:2"), (3, None)]).output

``AsyncClusterClient`` is the same for asyncio; ``hf.attach_remote_experts`` puts a cluster
behind a Hugging Face model's MoE blocks. See docs/cluster.md.
"""

from moelora.client.cluster.aio import AsyncClusterClient
from moelora.client.cluster.router import ClusterSettings, ClusterStats
from moelora.client.cluster.sync import ClusterClient

__all__ = ["AsyncClusterClient", "ClusterClient", "ClusterSettings", "ClusterStats"]
