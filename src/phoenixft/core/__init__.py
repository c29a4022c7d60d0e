"""The per-rank core shared by every front door: what a rank is (`context.RankContext`), handed to
protection, recovery, fault injection and the SDC checks instead of the process that runs them."""
