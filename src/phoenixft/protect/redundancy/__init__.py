"""Redundancy schemes for the per-step protection: `replicas:K` (full copies, replication.py) and
`ec:D+H` (erasure-coded parity groups, this package).

- `scheme`: parse and validate `--redundancy`; what a ring of n nodes can hold;
- `codes`: XOR (one parity block) and Reed-Solomon (zfec) over bytes;
- `placement`: the groups of one data-parallel ring and the nodes of their parity blocks (pure);
- `plan`: one rank's part in an epoch (today's DP rings, one per local rank);
- `parity`: the parity blocks a rank keeps, ping-pong in shared memory;
- `protect`: the per-step distributed encode, run by the `Replicator` thread;
- `erasure`: the `ec:D+H` side of `protect.scheme.RedundancyScheme` (the encode job, the parity a
  rank keeps, the rebuild of a plan's decode jobs by `recovery.rebuild`);
- `decodable`: which lost shards a group can rebuild and from which pieces (pure, for the planner);
- `estimate`: host memory per node and bytes per rank and step of a configuration (`--dry-run`).
"""

# only the pure, torch-free modules here: `phoenixft.config` imports this package, and the CLI must
# start without torch; import parity, plan, protect and erasure from their modules
from phoenixft.protect.redundancy.decodable import DecodeJob, decode_options
from phoenixft.protect.redundancy.placement import Group, RingRank, place_groups
from phoenixft.protect.redundancy.scheme import Redundancy, parse_redundancy

__all__ = ["DecodeJob", "decode_options", "Group", "RingRank", "place_groups", "Redundancy", "parse_redundancy"]
