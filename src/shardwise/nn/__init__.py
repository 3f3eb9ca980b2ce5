"""Model pieces: bundled models, mixed precision, SyncBatchNorm, recompute, LR schedules."""
