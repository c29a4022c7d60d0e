"""Training: the trainer, the ZeRO-1 flat model, gradient buckets, gather/reduce, the GPT and data preparation."""
