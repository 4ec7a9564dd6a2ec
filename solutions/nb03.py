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


def my_exposed_time(ready_s, sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    def ring(n):  # 2(p-1) alpha + 2(p-1)/p * n / busbw
        return 2 * (world_size - 1) * alpha_s + 2 * (world_size - 1) / world_size * n / (busbw_GBps * 1e9)

    free_at = 0.0  # when the network is done with the buckets before this one
    for bucket in _buckets(sizes_bytes, cap_bytes, cap_bytes):
        launched = max(free_at, ready_s[bucket[-1]])  # the bucket's last gradient, in backward's order
        free_at = launched + ring(sum(sizes_bytes[i] for i in bucket))
    return max(0.0, free_at - ready_s[-1])
