"""Notebook 03: data parallelism."""


def _buckets(sizes_bytes, first_cap_bytes, cap_bytes):
    """Indices of each bucket: one is closed once it holds its cap or more (the first its own cap)."""
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        if filled >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, filled = [], 0
    return buckets + [current] if current else buckets


def my_ddp_all_reduces(sizes_bytes, bucket_cap_mb, steps, k, no_sync):
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first_cap = 2**20 if bucket_cap_mb is None else cap  # DDP's smaller first bucket, only when no cap is given
    rebuilt = [sum(sizes_bytes[i] for i in b) for b in _buckets(sizes_bytes, first_cap, cap)]
    synchronizing = steps * (1 if no_sync else k)  # backward passes outside no_sync
    if synchronizing == 0:
        return []
    # the first one: a single bucket of every gradient, in parameter order; then the rebuilt buckets
    return [sum(sizes_bytes)] + rebuilt * (synchronizing - 1)


def my_exposed_time(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    def ring(n):  # 2(p-1) alpha + 2(p-1)/p * n / busbw
        return 2 * (world_size - 1) * alpha_s + 2 * (world_size - 1) / world_size * n / (busbw_GBps * 1e9)

    free_at = 0.0  # when the network is done with the buckets before this one
    for bucket in _buckets(sizes_bytes, cap_bytes, cap_bytes):
        launched = max(free_at, ready_s[bucket[-1]])  # the bucket's last gradient, in backward's order
        free_at = launched + ring(sum(sizes_bytes[i] for i in bucket))
    return max(0.0, free_at - ready_s[-1])
