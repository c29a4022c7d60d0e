"""How replicas move from owner to holder: one interface (base.py), a backend per way (shm.py, tcp.py),
and the per-epoch handshake that picks each pair's backend (routes.py)."""

from phoenixft.protect.transport.base import ReplicaTransport, TransportMode
from phoenixft.protect.transport.routes import Routes
from phoenixft.protect.transport.shm import Hello, PeerShard, ShmTransport, host_key, shard_hello
from phoenixft.protect.transport.tcp import TcpTransport

__all__ = ["ReplicaTransport", "TransportMode", "Routes", "ShmTransport", "TcpTransport", "Hello", "PeerShard",
           "host_key", "shard_hello"]
