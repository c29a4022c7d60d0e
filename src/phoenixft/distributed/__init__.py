"""The world of one epoch: its topology, its communicators, and the device seam they run on."""
