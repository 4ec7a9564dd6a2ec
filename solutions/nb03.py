"""Notebook 03: data parallelism."""


def my_ddp_buckets(sizes_bytes, first_cap_bytes, cap_bytes):
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        if filled >= (first_cap_bytes if not buckets else cap_bytes):  # closed once it holds its cap
            buckets.append(current)
            current, filled = [], 0
    return buckets + [current] if current else buckets


def my_sync_time(sizes_bytes, cap_bytes, world_size, alpha_s, busbw_GBps):
    def ring(n):  # 2(p-1) alpha + 2(p-1)/p * n / busbw
        return 2 * (world_size - 1) * alpha_s + 2 * (world_size - 1) / world_size * n / (busbw_GBps * 1e9)

    naive = sum(ring(n) for n in sizes_bytes)
    bucketed = sum(ring(sum(sizes_bytes[i] for i in b)) for b in my_ddp_buckets(sizes_bytes, cap_bytes, cap_bytes))
    return naive, bucketed
