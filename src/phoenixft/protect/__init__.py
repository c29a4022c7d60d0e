"""Per-step protection: snapshot halves in shared memory, replicas and erasure-coded parity, the persistent tier."""
