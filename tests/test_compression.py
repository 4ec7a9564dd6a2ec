"""The compressors of course_lib.compressors, one process: exactness, unbiasedness, bytes."""

import math

import pytest
import torch

from course_lib import compression, memory
from course_lib import compressors as C
from course_lib.launch import spawn
from tests import compression_workers as W

ALL = [C.TopK(0.1), C.RandomK(0.1), C.RandomK(0.1, scaled=True), C.Threshold(0.5), C.QSGD(4), C.QSGD(15),
       C.QSGD(16, bucket_size=None), C.SignSGD(), C.TernGrad(), C.TernGrad(clip_sigma=None), C.FP16(), C.BF16(),
       C.PerTensor(C.QSGD(15), [1, 500, 2]), C.PerTensor(C.SignSGD(), [503])]


def _x(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _pack_ref(values, bits):
    """Bit packing written out: each value's bits, lowest first, one stream; then 8 bits to a byte,
    the first bit of the stream the byte's lowest (the last byte padded with zeros)."""
    stream = [(v >> b) & 1 for v in values for b in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(bit << i for i, bit in enumerate(stream[j: j + 8])) for j in range(0, len(stream), 8)]


VALUE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def _format_bytes(compressor, n, kept, dtype=torch.float32):
    """The bytes a compressor's payload for n entries of ``dtype`` must have, counted from its format:
    kept values in the gradient's dtype (4 or 2 bytes), float32 scales (4 bytes), int32 indices (4),
    16-bit casts (2), packed fields of b bits per entry (ceil(n b / 8) bytes). ``kept``: the entries
    Threshold keeps."""
    if isinstance(compressor, C.PerTensor):
        return sum(_format_bytes(compressor.inner, m, kept, dtype) for m in compressor.numels)
    k = max(1, math.ceil(getattr(compressor, "ratio", 1) * n))
    value = VALUE_BYTES[dtype]
    if isinstance(compressor, C.TopK):
        return k * (value + 4)
    if isinstance(compressor, C.RandomK):
        return k * value  # values only: the indices come from the shared seed
    if isinstance(compressor, C.Threshold):
        return kept * (value + 4)
    if isinstance(compressor, C.QSGD):  # l in 0..levels takes levels.bit_length() bits; a sign bit; norms
        buckets = 1 if compressor.bucket_size is None else math.ceil(n / compressor.bucket_size)
        return 4 * buckets + math.ceil(n * compressor.levels.bit_length() / 8) + math.ceil(n / 8)
    if isinstance(compressor, C.SignSGD):
        return 4 + math.ceil(n / 8)
    if isinstance(compressor, C.TernGrad):
        return 4 + math.ceil(2 * n / 8)
    if isinstance(compressor, (C.FP16, C.BF16)):
        return 2 * n
    raise TypeError(compressor)


def _bytes_of(payload):
    """The payload's bytes as torch lays them out: each tensor viewed as raw uint8."""
    return sum(t.contiguous().view(torch.uint8).numel() for t in payload)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 33])
def test_pack_bits_round_trips(bits, n):
    values = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = C.pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert packed.tolist() == _pack_ref(values.tolist(), bits)
    assert torch.equal(C.unpack_bits(packed, bits, n).long(), values)


@pytest.mark.parametrize("dtype", list(VALUE_BYTES), ids=str)
@pytest.mark.parametrize("compressor", ALL, ids=repr)
@pytest.mark.parametrize("n", [1, 7, 1000, 1001])
def test_wire_bytes_are_the_payloads_bytes_counted_from_the_format(compressor, n, dtype):
    if isinstance(compressor, C.PerTensor):
        compressor = C.PerTensor(compressor.inner, [1, n - 1] if n > 1 else [1])
    x = _x(n).to(dtype)
    payload, ctx = compressor.compress(x)
    kept = int((x.abs() >= compressor.value).sum()) if isinstance(compressor, C.Threshold) else None
    expected = _format_bytes(compressor, n, kept, dtype)
    assert _bytes_of(payload) == expected  # what is really sent
    assert C.payload_bytes(payload) == expected
    # what it promises, for a gradient of this dtype
    assert compressor.wire_bytes(n, *([kept] if kept is not None else []), dtype=dtype) == expected
    assert compressor.decompress(payload, ctx).shape == (n,)


@pytest.mark.parametrize("dtype", list(VALUE_BYTES), ids=str)
def test_the_bytes_counted_on_the_wire_are_wire_bytes_for_every_compressor_and_dtype(dtype):
    # real gloo processes: what exchange hands the counted collectives (hooks.traffic, by op) for each
    # compressor, against what wire_bytes promises for a gradient of that dtype
    rows = spawn(W.bytes_on_the_wire, 2, sorted(W.COMPRESSORS), dtype, 1003)[0]
    for name, (counted, promised, sizes) in rows.items():
        assert counted == promised + sizes, (name, counted, promised, sizes)
        assert promised > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_a_gradient_that_is_not_finite_comes_back_not_finite_without_an_error(compressor, bad):
    """A diverging run must stop where its loss stops being finite, not crash inside a compressor (QSGD and
    TernGrad pack integer levels, which a nan is not), nor come back finite and hide the divergence."""
    n = sum(compressor.numels) if isinstance(compressor, C.PerTensor) else 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[7] = bad
    payload, ctx = compressor.compress(x)
    out = compressor.decompress(payload, ctx)
    kept = not isinstance(compressor, (C.RandomK, C.Threshold, C.TopK))  # those may drop entry 7: then finite
    assert (not torch.isfinite(out).all()) if kept else out.shape == x.shape


def test_signs_travel_as_one_bit_each():
    assert C.SignSGD().wire_bytes(8 * 1000) == 4 + 1000  # the scale, then a byte per 8 signs
    assert C.TernGrad().wire_bytes(4 * 1000) == 4 + 1000  # the scale, then a byte per 4 entries
    assert C.FP16().wire_bytes(1000) == 2000 and C.QSGD(127, bucket_size=None).wire_bytes(1000) == 4 + 875 + 125


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = _x(1000)
    out = C.TopK(0.05).decompress(*C.TopK(0.05).compress(x))
    kept = out.nonzero().view(-1)
    assert len(kept) == 50
    assert torch.equal(out[kept], x[kept])  # kept values are exact
    assert x[kept].abs().min() >= x[out == 0].abs().max()  # nothing dropped is larger than what is kept


def test_threshold_keeps_what_is_large_enough():
    x = _x(1000)
    out = C.Threshold(1.5).decompress(*C.Threshold(1.5).compress(x))
    assert torch.equal(out, torch.where(x.abs() >= 1.5, x, torch.zeros_like(x)))


@pytest.mark.parametrize("compressor", [C.RandomK(0.25, scaled=True), C.QSGD(2), C.QSGD(2, bucket_size=16),
                                        C.TernGrad(clip_sigma=None)], ids=repr)
def test_unbiased_compressors_average_back_to_the_input(compressor):
    x, draws = _x(64, seed=1), 4000
    samples = torch.stack([compressor.decompress(*compressor.compress(x)) for _ in range(draws)])
    error = (samples.mean(0) - x).abs()
    sigma = samples.std(0) / math.sqrt(draws)
    assert compressor.unbiased
    assert (error <= 5 * sigma + 1e-6).all(), (error / (sigma + 1e-12)).max()
    assert (samples.std(0) > 0).any()  # really random: each call draws afresh


def test_a_biased_compressor_does_not_average_back():
    x = _x(64, seed=1)
    sign = C.SignSGD()
    samples = torch.stack([sign.decompress(*sign.compress(x)) for _ in range(10)])
    assert not sign.unbiased and (samples.mean(0) - x).norm() > 0.3 * x.norm()
    assert torch.allclose(samples[0].abs(), x.abs().mean().expand(64))  # ±(mean magnitude)


def test_same_seed_same_draws_fresh_draws_per_call():
    x = _x(100)
    a, b = C.RandomK(0.1, seed=3), C.RandomK(0.1, seed=3)
    (pa, (ia, _)), (pb, (ib, _)) = a.compress(x), b.compress(x)
    assert torch.equal(ia, ib) and torch.equal(pa[0], pb[0])  # what lets ranks all-reduce random-k
    assert not torch.equal(a.compress(x)[1][0], ia)  # the next call draws other indices


@pytest.mark.parametrize("compressor",
                         ALL + [C.PerTensor(C.TernGrad(), [7, 300, 196]), C.PerTensor(C.TopK(0.1), [3, 497])], ids=repr)
@pytest.mark.parametrize("ranks", [1, 2, 4, 9])
def test_the_sum_of_many_payloads_is_theirs_added_up(compressor, ranks):
    """``decompress_sum`` (all the ranks' payloads at once, what an all-gather's combine uses) gives
    what decompressing each and adding them in rank order gives: bit for bit up to 4 ranks (as the
    sum of a few rows does), to float32's rounding past them."""
    n = sum(compressor.numels) if isinstance(compressor, C.PerTensor) else 503
    made = [compressor.compress(_x(n, seed=r) * (r + 1)) for r in range(ranks)]
    payloads, ctx = [payload for payload, _ in made], made[0][1]
    if isinstance(compressor, C.RandomK):  # a shared seed: the same entries, the same ctx, on every rank
        made = [type(compressor)(0.1, seed=3, scaled=compressor.scaled).compress(_x(n, seed=r)) for r in range(ranks)]
        payloads, ctx = [payload for payload, _ in made], made[0][1]
    one_by_one = compressor.decompress(payloads[0], ctx)
    for payload in payloads[1:]:
        one_by_one = one_by_one + compressor.decompress(payload, ctx)
    together = compressor.decompress_sum(payloads, ctx)
    assert torch.equal(together, one_by_one) if ranks <= 4 else torch.allclose(together, one_by_one, rtol=1e-6,
                                                                               atol=1e-6)


def test_summable_payloads_add_up_to_the_sum():
    """Two ranks' payloads summed entry by entry (what an all-reduce does) decompress to the sum of
    the tensors as each format keeps it: in float16, every entry; random-k, the entries both drew."""
    x, y = _x(100, 1), _x(100, 2)
    fp16 = C.FP16()
    (px, ctx), (py, _) = fp16.compress(x), C.FP16().compress(y)
    assert torch.equal(fp16.decompress([a + b for a, b in zip(px, py)], ctx), (x.half() + y.half()).float())
    a, b = C.RandomK(0.2, seed=5), C.RandomK(0.2, seed=5)
    (px, ctx), (py, _) = a.compress(x), b.compress(y)
    chosen = torch.isin(x, px[0])  # where x's values went (x's entries are all different)
    assert chosen.sum() == 20 and torch.equal(torch.isin(y, py[0]), chosen)  # the same entries on both ranks
    assert torch.equal(a.decompress([px[0] + py[0]], ctx), torch.where(chosen, x + y, 0.0))
    assert fp16.summable and a.summable and C.BF16().summable
    assert not C.TopK(0.1).summable and not C.SignSGD().summable


@pytest.mark.parametrize("cast, dtype", [(C.FP16, torch.float16), (C.BF16, torch.bfloat16)])
def test_the_casts_round_as_torch_does(cast, dtype):
    """Against torch's own casts; float16 overflows past 65504 and flushes tiny values to zero,
    bfloat16 keeps float32's range (8 bits of mantissa)."""
    x = torch.cat([_x(1000, 3), torch.tensor([70000.0, -70000.0, 1e-9, 1 / 3])])
    if dtype == torch.float16:  # past 65504 torch's cast gives inf: the compressor says so instead of sending it
        with pytest.raises(OverflowError, match="do not fit in torch.float16"):
            cast().compress(x)
        x[-4:-2] = torch.tensor([65504.0, -65504.0])  # the largest float16, exactly
    payload, ctx = cast().compress(x)
    assert payload[0].dtype == dtype and len(payload) == 1
    got = cast().decompress(payload, ctx)
    assert got.dtype == torch.float32 and torch.equal(got, x.to(dtype).float())
    if dtype == torch.float16:
        assert got[-4:-2].tolist() == [65504.0, -65504.0] and got[-2] == 0  # 1e-9 flushed to zero
    else:
        assert got[-4] == 70144 and got[-2] > 0  # bfloat16's nearest, and no underflow
    assert got[-1] != x[-1]  # really rounded


@pytest.mark.parametrize("make, match", [
    (lambda: C.TopK(0), "0 < ratio <= 1"), (lambda: C.RandomK(1.5), "0 < ratio <= 1"),
    (lambda: C.QSGD(300), "from 1 to 255"), (lambda: C.TernGrad(clip_sigma=0), "standard deviations"),
    (lambda: C.Threshold(0), "must be a finite number > 0"),
    (lambda: C.SignSGD("vote"), "'mean' or 'majority'"),
])
def test_bad_arguments_say_what_to_write(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _hook_reference(name, grads):
    """What the hook must hand DDP on its first step, from first principles, with no compressor of
    the package: each rank's gradient compressed by its paper's rule written out here, then averaged.
    The random compressors draw their uniforms from a generator of the compressor's seed (0): every
    rank's fresh compressor draws the same numbers."""
    world_size, n = len(grads), grads[0].numel()
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    if name == "topk":  # the ceil(0.1 n) largest magnitudes, picked by a full sort
        parts = []
        for g in grads:
            keep = torch.sort(g.abs(), descending=True).indices[: math.ceil(0.1 * n)]
            parts.append(torch.zeros(n).index_put((keep,), g[keep]))
    elif name == "threshold":
        parts = [torch.where(g.abs() >= 0.05, g, 0.0) for g in grads]
    elif name == "qsgd":  # 4 levels, a norm per 128 entries (the bucket whole, as the worker asks)
        parts = [W._qsgd_ref(g, u, levels=4, bucket=128) for g in grads]
    elif name == "terngrad":
        parts = [W._terngrad_ref(g, u) for g in grads]
    elif name in ("sign", "sign_majority"):
        parts = [W._sign_ref(g, u) for g in grads]
        if name == "sign_majority":  # the sign of the summed signs, times the mean of the ranks' scales
            votes = sum(torch.where(g >= 0, 1.0, -1.0) for g in grads)
            return torch.sign(votes) * sum(g.abs().mean() for g in grads) / world_size
    elif name in ("fp16", "bf16"):  # each rank's cast, summed in 16 bits (what the all-reduce does), then halved
        dtype = torch.float16 if name == "fp16" else torch.bfloat16
        total = grads[0].to(dtype)
        for g in grads[1:]:
            total = total + g.to(dtype)
        return total.float() / world_size
    else:
        raise KeyError(name)
    return sum(parts) / world_size


def _hook_bytes(name, n, kept):
    """The bytes one rank hands over, counted from the format: float32 values and scales (4 bytes),
    int32 indices (4), int64 sizes (8), 16-bit casts (2); QSGD(4): levels 0..4 in 3 bits, a sign bit
    and a norm per 128 entries; signSGD: a bit per entry; TernGrad: 2 bits per entry."""
    return {"topk": math.ceil(0.1 * n) * (4 + 4),
            "randomk": math.ceil(0.2 * n) * 4,  # values only: every rank draws the same indices
            "threshold": 8 + max(kept) * (4 + 4),  # the sizes first, then payloads padded to the largest
            "qsgd": 4 * math.ceil(n / 128) + math.ceil(3 * n / 8) + math.ceil(n / 8),
            "sign": 4 + math.ceil(n / 8), "sign_majority": 4 + math.ceil(n / 8),
            "terngrad": 4 + math.ceil(2 * n / 8),
            "fp16": 2 * n, "bf16": 2 * n}[name]


@pytest.mark.parametrize("name", sorted(W.COMPRESSORS))
def test_the_hook_averages_what_each_rank_compressed_and_counts_its_bytes(name):
    outs = spawn(W.one_step_against_a_reference, 2, name, backend="gloo", timeout_s=120)
    grads = outs[0]["everyone"]
    n = grads[0].numel()
    assert n == 20 * 10 + 10
    for rank, out in enumerate(outs):
        got = out["got"]
        if name == "randomk":  # the chosen entries hold the dense mean of the raw gradients, the rest zero
            chosen = got != 0
            assert chosen.sum() == math.ceil(0.2 * n), f"rank {rank}: {int(chosen.sum())} entries kept"
            reference = torch.where(chosen, sum(grads) / len(grads), 0.0)
        else:
            reference = _hook_reference(name, grads)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6, msg=f"{name}, rank {rank}")
        if name in ("fp16", "bf16"):  # and what torch's own hook gives, on gloo
            torch.testing.assert_close(got, out["torch_hook"], rtol=1e-5, atol=1e-6, msg=f"{name}: torch's hook")
        kept = [int((g.abs() >= 0.05).sum()) for g in grads]
        assert out["bytes"] == _hook_bytes(name, n, kept), f"{name}, rank {rank}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_compressor_keeps_the_ranks_identical(world_size):
    names = sorted(W.COMPRESSORS)
    outs = spawn(W.train_and_compare_ranks, world_size, names, backend="gloo", timeout_s=240)
    for name in names:
        for rank in range(1, world_size):
            assert torch.equal(outs[rank][name], outs[0][name]), f"{name}: rank {rank} differs from rank 0"


def test_a_state_refuses_what_cannot_work():
    with pytest.raises(TypeError, match=r"CompressionState\(TopK\(0.01\)\)"):
        compression.CompressionState("topk")
    with pytest.raises(ValueError, match="cannot be all-reduced"):
        compression.CompressionState(C.TopK(0.1), communicator="all_reduce")
    assert compression.CompressionState(C.TopK(0.1)).communicator == "all_gather"
    assert compression.CompressionState(C.FP16()).communicator == "all_reduce"
    assert isinstance(compression.CompressionState(C.TopK(0.1)).memory, memory.ErrorFeedback)
    assert isinstance(compression.CompressionState(C.QSGD(4)).memory, memory.NoMemory)


# --- Deep Gradient Compression ---------------------------------------------------------------------

def _dgc_reference(world_size, steps, lr, density, momentum, clip_norm, masking, densities=None):
    """DGC computed another way: one process, no DDP, no hook, no torch.topk. Every rank's velocity u
    and accumulation v kept as plain tensors; the k largest picked by a full sort."""
    net = W.dgc_net()
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    u = [torch.zeros(n) for _ in range(world_size)]
    v = [torch.zeros(n) for _ in range(world_size)]
    trajectory = []
    for step in range(steps):
        ratio = densities[step] if densities else density
        k = max(1, math.ceil(ratio * n))
        sent = []
        for r in range(world_size):
            x, y = W.dgc_batch(step, r)
            grads = torch.autograd.grad((net(x) - y).square().mean(), params)
            g = torch.cat([t.flatten() for t in grads])
            if clip_norm is not None:
                # the paper clips a worker's share g / N at clip_norm / sqrt(N): g itself at clip_norm * sqrt(N)
                share = g / world_size
                g = world_size * share * min(1.0, clip_norm / world_size**0.5 / share.norm().item())
            u[r] = momentum * u[r] + g
            v[r] = v[r] + u[r]
            chosen = torch.sort(v[r].abs(), descending=True).indices[:k]
            s = torch.zeros(n)
            s[chosen] = v[r][chosen]
            sent.append(s)
            v[r][chosen] = 0
            if masking:
                u[r][chosen] = 0
        update = sum(sent) / world_size
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= lr * update[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        trajectory.append(torch.cat([p.detach().flatten() for p in params]))
    return trajectory


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("pieces", [
    dict(momentum=0.9, clip_norm=None, masking=False),  # momentum correction alone
    dict(momentum=0.9, clip_norm=0.5, masking=True),  # + local clipping and momentum-factor masking
    dict(momentum=0.0, clip_norm=None, masking=False),  # plain error feedback
], ids=["momentum_correction", "clip_and_mask", "error_feedback"])
def test_dgc_matches_a_single_process_reference(world_size, pieces):
    steps, lr, density = 8, 0.1, 0.05
    outs = spawn(W.train_dgc, world_size, steps, lr, dict(density=density, **pieces), backend="gloo", timeout_s=120)
    reference = _dgc_reference(world_size, steps, lr, density, **pieces)
    for rank, out in enumerate(outs):
        assert out["iteration"] == steps and out["codec_s"] > 0
        for step in range(steps):
            torch.testing.assert_close(out["trajectory"][step], reference[step], rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}, after step {step + 1}")


def test_error_feedback_follows_the_parameters_when_ddp_rebuilds_its_buckets():
    """Plain top-k with ErrorFeedback is DGC without momentum, clipping or masking. DDP reorders its
    bucket after the first step; the memory must still line up with the parameters."""
    steps, lr, density = 8, 0.1, 0.05
    outs = spawn(W.train_dgc, 2, steps, lr, dict(topk=density), backend="gloo", timeout_s=120)
    reference = _dgc_reference(2, steps, lr, density, momentum=0.0, clip_norm=None, masking=False)
    for step in range(steps):
        torch.testing.assert_close(outs[0]["trajectory"][step], reference[step], rtol=1e-5, atol=1e-6,
                                   msg=f"after step {step + 1}")


def test_dgc_warm_up_follows_its_schedule_in_the_hook():
    steps, lr = 10, 0.1
    schedule = C.DensityWarmUp(0.01, warmup_steps=8)
    densities = [schedule(s) for s in range(steps)]
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01, 0.01, 0.01]
    outs = spawn(W.train_dgc, 2, steps, lr, dict(density=0.01, warmup_steps=8), backend="gloo", timeout_s=120)
    reference = _dgc_reference(2, steps, lr, 0.01, 0.9, None, True, densities=densities)
    torch.testing.assert_close(outs[0]["trajectory"][-1], reference[-1], rtol=1e-5, atol=1e-6)


def test_dgc_at_full_density_is_momentum_sgd_on_the_global_batch():
    """With every entry sent, momentum correction is exactly the optimizer's momentum, applied to the
    mean gradient: torch's own SGD(momentum=0.9) on the whole batch, one process."""
    steps, lr, world_size = 6, 0.1, 2
    outs = spawn(W.train_dgc, world_size, steps, lr, dict(density=1.0, masking=False), backend="gloo", timeout_s=120)
    net = W.dgc_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        batches = [W.dgc_batch(step, r) for r in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        opt.zero_grad()
        (net(x) - y).square().mean().backward()
        opt.step()
        expected = torch.cat([p.detach().flatten() for p in net.parameters()])
        torch.testing.assert_close(outs[1]["trajectory"][step], expected, rtol=1e-5, atol=1e-6)


def test_the_warm_up_schedule_is_lin_et_als():
    schedule = C.DensityWarmUp(0.001, warmup_steps=4)
    assert [schedule(s) for s in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert C.DensityWarmUp(0.01)(0) == 0.01  # no warm-up


def test_dgc_pieces_refuse_bad_values():
    with pytest.raises(ValueError, match="momentum must be in"):
        memory.DGCMemory(momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        memory.DGCMemory(clip_norm=0)
    with pytest.raises(ValueError, match="density sets the ratio"):
        compression.CompressionState(C.QSGD(4), density=C.DensityWarmUp(0.01, 10))


# --- per tensor, as the papers and GRACE compress ----------------------------------------------------

@pytest.mark.parametrize("name", sorted(W.PER_TENSOR))
def test_the_hook_scales_each_tensor_on_its_own_as_the_papers_do(name):
    """Against each paper's formula written out per parameter; the same hook with one scale for the
    whole bucket (the variant the course used before) must fail the same comparison."""
    for rank, out in enumerate(spawn(W.per_tensor_against_a_reference, 2, name, backend="gloo", timeout_s=120)):
        torch.testing.assert_close(out["per_tensor"], out["reference"], rtol=1e-5, atol=1e-6,
                                   msg=f"{name}, rank {rank}")
        assert not torch.allclose(out["whole"], out["reference"], rtol=1e-3, atol=1e-4), f"{name}: whole bucket passed"
        assert out["numels"] == [320, 16, 64, 4]
        # from the format, tensor by tensor: float32 scales (QSGD: a norm per 128 entries), then packed
        # fields of so many bits per entry (signs: 1; TernGrad: 2; QSGD(15): l in 4 bits, a sign bit)
        fields = {"sign": [1], "sign_majority": [1], "terngrad": [2], "qsgd": [4, 1]}[name]
        scales = [math.ceil(n / 128) if name == "qsgd" else 1 for n in out["numels"]]
        assert out["bytes"] == sum(4 * s + sum(math.ceil(n * b / 8) for b in fields)
                                   for n, s in zip(out["numels"], scales))


def test_qsgd_sends_its_levels_in_as_few_bits_as_they_need():
    # 15 levels: l in 0..15 is 4 bits, plus a sign bit: 5 bits per entry, and a float32 norm per 128
    n = 1000
    q = C.QSGD(15)
    payload, ctx = q.compress(_x(n))
    norms, levels, signs = payload
    assert norms.numel() == math.ceil(n / 128) and norms.dtype == torch.float32
    assert levels.dtype == torch.uint8 and levels.numel() == math.ceil(n * 4 / 8)
    assert signs.dtype == torch.uint8 and signs.numel() == math.ceil(n / 8)
    assert C.payload_bytes(payload) == q.wire_bytes(n) == 4 * 8 + 500 + 125
    assert C.QSGD(16).wire_bytes(n) == 4 * 8 + math.ceil(n * 5 / 8) + 125  # 17 values of l: 5 bits
    assert C.QSGD(1, bucket_size=None).wire_bytes(n) == 4 + 125 + 125  # one norm, l in {0, 1}


def test_qsgd_decodes_to_the_papers_formula_bucket_by_bucket():
    x = _x(300, seed=4) * torch.linspace(0.01, 10, 300)  # buckets of very different norms
    got = C.QSGD(15, seed=3).decompress(*C.QSGD(15, seed=3).compress(x))
    expected = W._qsgd_ref(x, torch.rand(300, generator=torch.Generator().manual_seed(3)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    whole = C.QSGD(15, bucket_size=None, seed=3)
    assert not torch.allclose(whole.decompress(*whole.compress(x)), expected, rtol=1e-3, atol=1e-4)


def test_terngrad_clips_at_two_and_a_half_standard_deviations():
    x = _x(500, seed=5)
    x[7] = 40.0  # one outlier: unclipped, it would set the scale
    payload, _ = C.TernGrad().compress(x)
    assert payload[0].item() == pytest.approx(2.5 * x.std(unbiased=False).item(), rel=1e-5)
    assert C.TernGrad(clip_sigma=None).compress(x)[0][0].item() == 40.0


def test_random_k_is_stichs_unscaled_with_memory_unless_asked_to_scale():
    x = _x(100)
    stich, scaled = C.RandomK(0.1, seed=2), C.RandomK(0.1, seed=2, scaled=True)
    (ps, (idx, _)), (pu, _) = stich.compress(x), scaled.compress(x)
    assert torch.equal(ps[0], x[idx]) and torch.allclose(pu[0], x[idx] * 10)
    assert isinstance(compression.CompressionState(stich).memory, memory.ErrorFeedback)
    assert isinstance(compression.CompressionState(scaled).memory, memory.NoMemory)
    assert not stich.unbiased and scaled.unbiased


def test_per_tensor_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="per_tensor changes nothing"):
        compression.CompressionState(C.Threshold(0.1), per_tensor=True)
    State = compression.CompressionState
    assert State(C.QSGD(15)).per_tensor and not State(C.TopK(0.1)).per_tensor
    assert not State(C.RandomK(0.1, scaled=True)).per_tensor  # scaled by numel/k, no scale of its own


def test_a_memory_follows_parameters_whatever_the_bucket_layout():
    # DDP's first iteration lays a bucket out in parameter order, later ones in gradient-ready order: the
    # memory must hand each parameter its own error whatever the order, and read back a layout it kept
    # whole as a view of what it kept (no copy), a reordered one as a copy.
    m = memory.ErrorFeedback()
    first, rebuilt = ((0, 4), (1, 6)), ((1, 6), (0, 4))
    corrected = torch.arange(10.0)
    m.update(first, corrected, torch.zeros(10))  # parameter 0 left out 0..3, parameter 1 left out 4..9
    assert torch.equal(m.compensate(rebuilt, torch.zeros(10)), torch.cat([corrected[4:], corrected[:4]]))
    kept = m.memory[0]
    whole = memory._joined([m.memory[0], m.memory[1]])
    assert whole.data_ptr() == kept.data_ptr() and torch.equal(whole, corrected)
    assert torch.equal(memory._joined([m.memory[1], m.memory[0]]), torch.cat([corrected[4:], corrected[:4]]))


def test_a_compression_hook_resumes_from_a_checkpoint_as_if_never_stopped():
    # The hook state is pickled whole with the checkpoint (as torch's docs show for PowerSGD's): its
    # parameter keys start afresh in the new model, whose first bucket layout gives them the same keys,
    # so each parameter finds its own error again. Deterministic compressors then match bit for bit
    # (a stochastic one draws per bucket, and the new model's first buckets are laid out differently).
    from dataclasses import replace

    from course_lib.train import TrainConfig, train_several

    base = TrainConfig(steps=12, hidden=32, lr=0.1, eval_every=100)
    configs = [replace(base, hook=hook, resume_at=resume) for hook in ("topk", "signsgd") for resume in (None, 6)]
    outs = spawn(train_several, 2, configs + [replace(base, hook="topk", memory="none")], backend="gloo",
                 timeout_s=300)[0]
    for straight, resumed in zip(outs[0:4:2], outs[1:4:2]):
        assert all(torch.equal(a, b) for a, b in zip(straight.final_params, resumed.final_params))
    # the memory matters here (top-k without it ends elsewhere): a resume that lost it would not match
    assert not all(torch.equal(a, b) for a, b in zip(outs[0].final_params, outs[4].final_params))
