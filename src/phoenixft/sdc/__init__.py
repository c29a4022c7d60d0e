"""Silent data corruption: fingerprints across data-parallel peers, the spike guard, audits and the
proof by bitwise replay (docs/sdc.md). `logic` is pure; `checks` runs on a rank; `record` is what they
write to the control plane (the node named, its quarantine, the detections)."""
