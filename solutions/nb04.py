"""Notebook 04: DDP in practice."""

from solutions.nb03 import _buckets


def my_ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap  # DDP's smaller first bucket, only when no cap is given
    rebuilt = [sum(sizes_bytes[i] for i in b) for b in _buckets(sizes_bytes, first_cap, cap)]
    synchronizing = steps * (1 if no_sync else k)  # backward passes outside no_sync
    if synchronizing == 0:
        return []
    # the first one: a single bucket of every gradient, in parameter order; then the rebuilt buckets
    return [sum(sizes_bytes)] + rebuilt * (synchronizing - 1)
