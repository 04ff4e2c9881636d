"""dcpc's device library: the @triton.jit helpers every generated kernel calls.

Generated modules import what their kernels use from here (``from dcpc.runtime.device
import ...``; dcpc.codegen.emit lists the names), so the signal/wait protocol, the
failure flags, the error record and the LSE-weighted merge are written once, here, not
in every module. Two parts:

- the signal/wait protocol on symmetric memory (docs/internals.md, "Signals and the
  guard"; design/domain.md): epochs in device memory advanced by the kernels, one vector
  release per step into every peer's signal cells after a block barrier, a bounded
  acquire spin, the failure flags and the error record (codes in dcpc.runtime.errors);
- the merge (design/domain.md): the LSE-weighted merge of W partials, its masks (empty KV
  shards, CUDA-graph padding rows), bf16 rounding and the fp8 e4m3 quantisation, shared
  by lse_combine, all_to_all_combine, lse_correct, all_reduce (lse) and the casts.

A generated module's kernels are compiled with these functions (Triton follows the calls
into this module; its cache key hashes their source). Under the CPU interpreter they run
as interpreted functions like the kernels. Nothing here is called from the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dcpc.numerics import FP8_FORMATS, SCALE_FLOOR, SCALE_MAX, SCALE_MIN
from dcpc.runtime import errors as _errors

# The error record and the failure flags as the kernels see them (defined once, in
# dcpc.runtime.errors): the codes, and the index of each word of the record. Every code
# of errors.KERNEL_ERRORS is DCPC_<name> here, its value read from its row (an op's
# template's kernels import it by that name): one line each, so that a reader and a type
# checker see every name (a new op's code is its row there and its line here;
# tests/runtime/test_runtime.py fails on a row without its line or a line off its row).
DCPC_TIMEOUT = tl.constexpr(_errors.KERNEL_ERRORS["TIMEOUT"].code)
DCPC_CONTRACT = tl.constexpr(_errors.KERNEL_ERRORS["CONTRACT"].code)
DCPC_PEER_FAILED = tl.constexpr(_errors.KERNEL_ERRORS["PEER_FAILED"].code)
DCPC_OVER_CAPACITY = tl.constexpr(_errors.KERNEL_ERRORS["OVER_CAPACITY"].code)
DCPC_BAD_INDEX = tl.constexpr(_errors.KERNEL_ERRORS["BAD_INDEX"].code)
DCPC_BAD_SCALE = tl.constexpr(_errors.KERNEL_ERRORS["BAD_SCALE"].code)
DCPC_OUTSIDE_SLOT = tl.constexpr(_errors.KERNEL_ERRORS["OUTSIDE_SLOT"].code)
DCPC_FLAG_FAILED = tl.constexpr(_errors.FLAG_FAILED)
DCPC_STEP_WORD = tl.constexpr(_errors.RECORD.index("step"))
DCPC_PEER_WORD = tl.constexpr(_errors.RECORD.index("peer"))
DCPC_EPOCH_WORD = tl.constexpr(_errors.RECORD.index("epoch"))
DCPC_HERE_WORD = tl.constexpr(_errors.RECORD.index("here"))
DCPC_THERE_WORD = tl.constexpr(_errors.RECORD.index("there"))
# the fp8 formats' (largest finite value, mantissa bits, smallest normal exponent)
DCPC_E4M3_TOP, DCPC_E4M3_MANTISSA, DCPC_E4M3_MIN_EXP = map(tl.constexpr, FP8_FORMATS["fp8e4m3"])
DCPC_E5M2_TOP, DCPC_E5M2_MANTISSA, DCPC_E5M2_MIN_EXP = map(tl.constexpr, FP8_FORMATS["fp8e5m2"])
DCPC_SCALE_MIN = tl.constexpr(SCALE_MIN)  # a per-tensor fp8 scale's bounds (scale_fault)
DCPC_SCALE_MAX = tl.constexpr(SCALE_MAX)
DCPC_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)  # a token's (group's) amax at least this: no 1/0
DCPC_STOP_WORD = tl.constexpr(_errors.RECORD.index("stop"))
DCPC_FLAG_WORD = tl.constexpr(_errors.RECORD.index("flag"))


# ---- the signal/wait protocol -------------------------------------------------------------
@triton.jit
def _dcpc_advance_epoch(epochs, channel, sig_programs):
    """Advance this program's epoch of ``channel`` (device memory, owned by kernels).

    One scalar atomic: it runs on one thread and its result is broadcast to the block,
    so every warp of the program agrees on the epoch. A plain load + store here races
    between warps (a warp that stores first makes a late warp read the new value and
    store it plus one), which desynchronises the ranks' epochs: a hang."""
    counter = epochs + channel * sig_programs + tl.program_id(0)
    return tl.atomic_add(counter, 1, sem="relaxed") + 1


@triton.jit
def _dcpc_table(ptrs, WORLD: tl.constexpr, WP2: tl.constexpr):
    """The per-rank pointer table ``ptrs[0:WORLD]`` as one vector (one load, issued early)."""
    r = tl.arange(0, WP2)
    return tl.load(ptrs + r, mask=r < WORLD, other=0)


@triton.jit
def _dcpc_pick(table, i, WP2: tl.constexpr):
    """Entry ``i`` of a pointer table vector, without another memory access."""
    return tl.sum(tl.where(tl.arange(0, WP2) == i, table, 0), axis=0)


@triton.jit
def _dcpc_word(fingerprint, epoch):
    """The signal word: the call's fingerprint in the high half, the epoch in the low."""
    return (fingerprint.to(tl.int64) << 32) | epoch.to(tl.uint32).to(tl.int64)


@triton.jit
def _dcpc_release(
    bases, live, sig_channel, sig_programs, word, RANK: tl.constexpr, WORLD: tl.constexpr
):
    """Publish ``word`` in sig[sig_channel, RANK, program] of every live lane's peer at once:
    one vector atomic, one lane per peer (release, system scope). After the block barrier
    each lane's release covers the whole block's stores, and the lanes run on different
    threads, so the fences overlap: one fence's latency, not one per peer."""
    cells = bases + WORLD + (sig_channel * WORLD + RANK) * sig_programs + tl.program_id(0)
    tl.atomic_xchg(cells, word, mask=live, sem="release", scope="sys")


@triton.jit
def _dcpc_globaltimer(like):
    """Nanoseconds of the GPU's global timer (not in the Triton interpreter)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _dcpc_count(lanes):
    return tl.sum(lanes.to(tl.int32), axis=0)


@triton.jit
def _dcpc_spin(cells, peer_flags, pending, got, epoch, errors, timeout_ns, CLOCK: tl.constexpr):
    """Poll every pending lane's cell at once (one vector acquire per iteration) until all
    reached ``epoch``, a pending peer's failure flag is set, or time is up: ``timeout_ns``
    of the global timer on GPU (CLOCK); on CPU until the host's watchdog sets errors[6] or
    another program of this rank recorded an error."""
    if CLOCK:
        start = _dcpc_globaltimer(epoch)
    waiting = _dcpc_count(pending) > 0
    while waiting:
        if not CLOCK:
            # CPU: the flags before the cells. A peer raises its flag (closed, failed)
            # after its signals, so a flag seen up here means its signal is seen by the
            # poll below; read after the poll, a rank descheduled between the two (a
            # thread or process on a loaded CPU) saw its peer's signal pending and its
            # flag up: "peer was closed before it made this call" for a peer that
            # signalled and closed meanwhile (tests/runtime/test_flag_order.py)
            flagged = tl.load(peer_flags, mask=pending, other=0, volatile=True) != 0
        polled = tl.atomic_add(cells, 0, mask=pending, sem="acquire", scope="sys")
        got = tl.where(pending, polled, got)
        if CLOCK:
            in_time = (_dcpc_globaltimer(epoch) - start) <= timeout_ns
            flagged = tl.load(peer_flags, mask=pending, other=0, volatile=True) != 0
        else:
            stop = tl.load(errors + DCPC_STOP_WORD, volatile=True) | tl.load(errors, volatile=True)
            in_time = stop == 0
        pending = pending & ((got.to(tl.int32) - epoch) < 0)
        waiting = (_dcpc_count(pending) > 0) & (_dcpc_count(pending & flagged) == 0) & in_time
    return got


@triton.jit
def _dcpc_flag_all(sig_ptrs, value, RANK: tl.constexpr, WORLD: tl.constexpr, WP2: tl.constexpr):
    """flags[RANK] = value in every peer's bank at once (release, system scope); a peer
    whose bank address is 0 (a rank outside this heap's team: per-axis backends) is
    skipped."""
    r = tl.arange(0, WP2)
    others = (r < WORLD) & (r != RANK)
    words = tl.load(sig_ptrs + r, mask=others, other=0)
    live = others & (words != 0)
    tl.atomic_xchg(
        words.to(tl.pointer_type(tl.int64)) + RANK, value, mask=live, sem="release", scope="sys"
    )


@triton.jit
def _dcpc_fail(
    sig_ptrs,
    peer,
    flag,
    epoch,
    fingerprint,
    got,
    errors,
    STEP: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WP2: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Record the first failed wait of this rank (the record: dcpc.runtime.errors):
    timeout, contract (another call's fingerprint), or peer failed (its signal pending and
    its flag set, or its flag says failed). On GPU, set this rank's failure flag in every
    peer's bank, then trap."""
    pending = (got.to(tl.int32) - epoch) < 0
    code = tl.where(
        pending | (flag == DCPC_FLAG_FAILED),
        tl.where(flag != 0, DCPC_PEER_FAILED, DCPC_TIMEOUT),
        DCPC_CONTRACT,
    )
    first = tl.atomic_cas(errors, 0, code)
    if first == 0:
        tl.store(errors + DCPC_STEP_WORD, STEP)
        tl.store(errors + DCPC_PEER_WORD, peer)
        tl.store(errors + DCPC_EPOCH_WORD, epoch)
        tl.store(errors + DCPC_HERE_WORD, fingerprint)
        tl.store(errors + DCPC_THERE_WORD, (got >> 32).to(tl.int32))
        tl.store(errors + DCPC_FLAG_WORD, flag)
    if TRAP:  # the trap ends this process: peers must not wait for it
        _dcpc_flag_all(sig_ptrs, 1, RANK, WORLD, WP2)
        tl.inline_asm_elementwise("trap;", "=r,r", [epoch], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dcpc_wait(
    sig_ptrs,
    mine,
    peers,
    live,
    sig_channel,
    sig_programs,
    epoch,
    fingerprint,
    errors,
    timeout_ns,
    STEP: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WP2: tl.constexpr,
    TRAP: tl.constexpr,
    CLOCK: tl.constexpr,
    GUARD: tl.constexpr,
):
    """Wait (acquire, bounded) until every live lane's peer published ``epoch`` in our own
    sig[sig_channel, peer, program]: one vector acquire of all of them, then, only if one
    is not there yet, the spin. Refused after it: a signal still pending (timeout, or
    peer failed by its flag), a peer whose flag says failed even though its signal
    arrived (its call failed), any signal once this launch failed (errors[0]), and with
    GUARD a word of exactly our epoch carrying another call's ``fingerprint`` (a peer
    that already moved on has passed this call). The first refused lane (in peer order
    RANK+1, RANK+2, ...; a pending flagged one first, then a pending one) goes to the
    error record (``_dcpc_fail``)."""
    cells = mine + WORLD + (sig_channel * WORLD + peers) * sig_programs + tl.program_id(0)
    got = tl.atomic_add(cells, 0, mask=live, sem="acquire", scope="sys")
    got = tl.where(live, got, 0)
    pending = live & ((got.to(tl.int32) - epoch) < 0)
    if _dcpc_count(pending) > 0:
        got = _dcpc_spin(cells, mine + peers, pending, got, epoch, errors, timeout_ns, CLOCK)
        pending = live & ((got.to(tl.int32) - epoch) < 0)
    flags = tl.load(mine + peers, mask=live, other=0, volatile=True).to(tl.int32)
    bad = pending | (live & (flags == DCPC_FLAG_FAILED))
    if GUARD:
        stale = (got.to(tl.int32) == epoch) & ((got >> 32).to(tl.int32) != fingerprint)
        bad = bad | (live & stale)
    if (_dcpc_count(bad) > 0) | (tl.load(errors, volatile=True) != 0):
        # a peer that never arrived is the cause, a flagged one first (dead, failed or
        # closed: what stopped the wait, not a live peer still blocked behind it); one
        # that arrived and then failed, only when every peer arrived (a survivor's flag
        # must not hide the absent peer)
        lane = tl.arange(0, WP2)
        stopped = pending & (flags != 0)
        culprits = tl.where(_dcpc_count(pending) > 0, pending, bad)
        culprits = tl.where(_dcpc_count(stopped) > 0, stopped, culprits)
        first = tl.min(tl.where(culprits, lane, WP2 - 1), axis=0)
        at = lane == first
        _dcpc_fail(
            sig_ptrs,
            tl.sum(tl.where(at, peers, 0), axis=0),
            tl.sum(tl.where(at, flags, 0), axis=0),
            epoch,
            fingerprint,
            tl.sum(tl.where(at, got, 0), axis=0),
            errors,
            STEP,
            RANK,
            WORLD,
            WP2,
            TRAP,
        )


# ---- the LSE-weighted merge, bf16 rounding, fp8 e4m3 -----------------------------------------
@triton.jit
def _dcpc_row_seq(
    seq_lens,
    query_start_loc,
    n,
    live,
    group_rows,
    batch,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """(sequence length of each row's request, padding flag): request =
    searchsorted(query_start_loc[1:], token, right=True); tokens at or past
    query_start_loc[batch] are CUDA-graph padding. INTERLEAVE = 0: seq_lens holds the
    local lengths [B, W] (every rank's, as vLLM's get_dcp_local_seq_lens), and the
    first value is a pointer to the request's row of them instead. BLOCK_B > 0 (at most
    a few hundred requests): one vector load of the request ends and a count, so the
    lookup costs one memory round trip; else a binary search of SEARCH_STEPS dependent
    loads."""
    token = n // group_rows
    end = tl.load(query_start_loc + batch)
    if BLOCK_B > 0:
        b = tl.arange(0, BLOCK_B)
        ends = tl.load(query_start_loc + 1 + b, mask=b < batch, other=2147483647)
        lo = tl.sum((ends[None, :] <= token[:, None]).to(tl.int32), axis=1)
    else:
        lo = tl.zeros_like(n)
        hi = lo + batch
        for _ in tl.static_range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc + 1 + mid, mask=live & active, other=0)
            lo = tl.where(active & (start <= token), mid + 1, lo)
            hi = tl.where(active & (start > token), mid, hi)
    request = tl.minimum(lo, tl.maximum(batch - 1, 0))
    if INTERLEAVE == 0:  # a constexpr branch: one return, whatever type seq has
        seq = seq_lens + request.to(tl.int64) * WORLD
    else:
        seq = tl.load(seq_lens + request, mask=live & (token < end), other=0)
    return seq, token >= end


@triton.jit
def _dcpc_part_ptrs(
    via,
    src,
    p,
    n,
    rows,
    part_rows,
    row_len,
    s0,
    s1,
    WORLD: tl.constexpr,
    FROM_SRC: tl.constexpr,
):
    """Rows n of partial p: via[p, n] (what the exchange received) or, for p == FROM_SRC
    (>= 0 only in a fused exchange that does not copy its own part), this rank's own
    src rows, which are [outer, W * part_rows] with n = outer * part_rows + row, at
    strides (s0, s1) (a strided engine input)."""
    ptrs = via + (p * rows + n).to(tl.int64) * row_len
    if FROM_SRC >= 0:
        row = (p * part_rows + n % part_rows).to(tl.int64)
        ptrs = tl.where(p == FROM_SRC, src + (n // part_rows).to(tl.int64) * s0 + row * s1, ptrs)
    return ptrs


@triton.jit
def _dcpc_partial_lse(
    lse,
    src_lse,
    p,
    n,
    live,
    rows,
    part_rows,
    seq,
    padding,
    sl0,
    sl1,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    MASK: tl.constexpr,
    FROM_SRC: tl.constexpr,
):
    """Rank p's LSE of rows n, -inf where it must not contribute."""
    ptrs = _dcpc_part_ptrs(lse, src_lse, p, n, rows, part_rows, 1, sl0, sl1, WORLD, FROM_SRC)
    lse_p = tl.load(ptrs, mask=live, other=float("-inf")).to(tl.float32)
    lse_p = tl.where((lse_p != lse_p) | (lse_p == float("inf")), float("-inf"), lse_p)
    if MASK:
        if INTERLEAVE == 0:  # seq: each row's pointer to its request's local lengths
            held = tl.load(seq + p, mask=live & (padding == 0), other=0)
        else:
            base = seq // INTERLEAVE // WORLD * INTERLEAVE
            held = base + tl.minimum(tl.maximum(seq - base * WORLD - p * INTERLEAVE, 0), INTERLEAVE)
        lse_p = tl.where(padding | (held == 0), float("-inf"), lse_p)
    return lse_p


@triton.jit
def _dcpc_exp(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _dcpc_log(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.log2(x)
    else:
        return tl.log(x)


@triton.jit
def _dcpc_merged_lse(
    lse,
    src_lse,
    n,
    live,
    rows,
    part_rows,
    seq,
    padding,
    sl0,
    sl1,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    MASK: tl.constexpr,
    FROM_SRC: tl.constexpr,
    BASE2: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(m, 1 / max(S, 1), LSE = m + log(S)): m = max_p lse_p (0 when every lse_p is -inf),
    S = sum_p exp(lse_p - m), which is 0 (every partial -inf) or at least 1."""
    top = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for p in tl.static_range(WORLD):  # all loads in flight at once
        lse_p = _dcpc_partial_lse(
            lse,
            src_lse,
            p,
            n,
            live,
            rows,
            part_rows,
            seq,
            padding,
            sl0,
            sl1,
            WORLD,
            INTERLEAVE,
            MASK,
            FROM_SRC,
        )
        top = tl.maximum(top, lse_p)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_N], tl.float32)
    for p in tl.static_range(WORLD):  # all loads in flight at once
        lse_p = _dcpc_partial_lse(
            lse,
            src_lse,
            p,
            n,
            live,
            rows,
            part_rows,
            seq,
            padding,
            sl0,
            sl1,
            WORLD,
            INTERLEAVE,
            MASK,
            FROM_SRC,
        )
        total += _dcpc_exp(lse_p - top, BASE2)
    return top, tl.math.div_rn(1.0, tl.maximum(total, 1.0)), top + _dcpc_log(total, BASE2)


@triton.jit
def _dcpc_weight(lse_p, top, inv_total, BASE2: tl.constexpr):
    """exp(lse_p - m) / S (see _dcpc_merged_lse), exactly 0 for a masked (-inf) partial.
    Never exp(lse_p - LSE): LSE is rounded to ulp(LSE), 1 at LSE = 1e7 in fp32, while
    lse_p - m is exact for partials near the max (issue 22, item 7)."""
    return tl.where(lse_p == float("-inf"), 0.0, _dcpc_exp(lse_p - top, BASE2) * inv_total)


@triton.jit
def _dcpc_round_bf16(x):
    """fp32 x rounded to the bf16 grid to nearest even, in fp32 bits, so that the store
    converts exactly: the Triton 3.6 interpreter's fp32 -> bf16 rounds toward zero
    (a cast in a move: dcpc/ops/cast.py)."""
    bits = x.to(tl.int32, bitcast=True)
    up = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(x != x, x, (up & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _dcpc_quantize(x, inv_scale):
    """x / scale, the value an fp8 output holds before _dcpc_store_fp8 clamps and rounds
    it to dst's format."""
    return x * inv_scale


@triton.jit
def _dcpc_round_fp8(y, TOP: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                    EVEN: tl.constexpr = False):
    """y clamped to +-TOP (NaN stays NaN, also through the clamp, whose min/max drop a
    NaN) and rounded to the fp8 grid of MANTISSA bits (2^(MIN_EXP - MANTISSA) below
    2^MIN_EXP) here, in fp32, half away from zero, or to even with EVEN (a DeepEP rule's
    conversion) (dcpc.numerics.round_fp8, the one rule:
    FP8_FORMATS), so that the store converts exactly: the Triton 3.6 interpreter's
    fp32 -> fp8 conversion drops the carry of a rounding into the exponent (7.9 -> 4.0)."""
    nan = y != y
    y = tl.minimum(tl.maximum(y, -TOP), TOP)
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of |y|
    ulp = (tl.maximum(exponent - MANTISSA, 127 + MIN_EXP - MANTISSA) << 23).to(
        tl.float32, bitcast=True
    )
    x = tl.math.div_rn(tl.abs(y), ulp)  # exact; x - floor(x) too (x + 0.5 may round up)
    t = tl.floor(x)
    half = x - t
    if EVEN:  # a tie goes up from an odd t only
        up = (half > 0.5) | ((half == 0.5) & (t - 2.0 * tl.floor(t * 0.5) == 1.0))
    else:
        up = half >= 0.5
    r = tl.where(up, t + 1.0, t) * ulp
    # the sign bit decides, and -1.0 * r keeps it on a zero (-r is 0 - r: +0.0 for r = 0)
    negative = y.to(tl.int32, bitcast=True) < 0
    return tl.where(nan, float("nan"), tl.where(negative, -1.0 * r, r))


@triton.jit
def _dcpc_scale(scale, errors, STEP: tl.constexpr):
    """The per-tensor fp8 scale scale[0] (f32), or NaN when it is not a positive finite
    normal of a normal inverse (2^-126 to 2^126: dcpc.numerics.scale_fault's bounds):
    0, a denormal, a negative, NaN or inf would quantise to +-448, flip signs, or give
    NaN or 0; above 2^126 div_rn's 1 / s flushes to 0 on a GPU. Such a scale is
    recorded as BAD_SCALE with its f32 bits in the record's "epoch" word
    (dcpc.runtime.errors): the call raises (CPU backends at once, CUDA at
    check_errors(); no host sync here) and every value it scales is NaN."""
    s = tl.load(scale).to(tl.float32)
    bad = (s < DCPC_SCALE_MIN) | (s > DCPC_SCALE_MAX) | (s != s)  # inf > SCALE_MAX
    if bad:
        if tl.atomic_cas(errors, 0, DCPC_BAD_SCALE) == 0:
            tl.store(errors + DCPC_STEP_WORD, STEP)
            tl.store(errors + DCPC_EPOCH_WORD, s.to(tl.int32, bitcast=True))
    return tl.where(bad, float("nan"), s)


@triton.jit
def _dcpc_inv_scale(scale, errors, STEP: tl.constexpr):
    """1 / _dcpc_scale(scale), rounded to nearest (a GPU's ``/`` is approximate)."""
    return tl.math.div_rn(1.0, _dcpc_scale(scale, errors, STEP))


@triton.jit
def _dcpc_store_fp8(ptr, y, mask, EVEN: tl.constexpr = False):
    """Store _dcpc_quantize's y into the fp8 ``ptr`` (e4m3 or e5m2, by its type) as bytes:
    clamped and rounded to the format's grid (_dcpc_round_fp8, ties to even with EVEN,
    dcpc.numerics
    FP8_FORMATS), a NaN as the byte 0x7F (dcpc.numerics.round_fp8): never the
    conversion's own NaN (the Triton 3.6 interpreter stores an fp32 NaN as e4m3's 0x7C =
    384; a GPU's cvt may differ too), -0.0 as 0x80. e5m2 is fp16's high byte: the
    rounded value converts to fp16 exactly (no fp8 conversion at all)."""
    if ptr.dtype.element_ty == tl.float8e5:
        r = _dcpc_round_fp8(y, DCPC_E5M2_TOP, DCPC_E5M2_MANTISSA, DCPC_E5M2_MIN_EXP, EVEN)
        q = ((r.to(tl.float16).to(tl.int16, bitcast=True) >> 8) & 0xFF).to(tl.uint8)
    else:
        tl.static_assert(ptr.dtype.element_ty == tl.float8e4nv)  # FP8_FORMATS: e4m3 or e5m2
        r = _dcpc_round_fp8(y, DCPC_E4M3_TOP, DCPC_E4M3_MANTISSA, DCPC_E4M3_MIN_EXP, EVEN)
        q = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    # the sign bit of every negative y, -0.0 included (the interpreter drops it from -0.0)
    q = tl.where(y.to(tl.int32, bitcast=True) < 0, q | 0x80, q)
    q = tl.where(y != y, 0x7F, q).to(tl.uint8)
    tl.store(ptr.to(tl.pointer_type(tl.uint8)), q, mask=mask)


@triton.jit
def _dcpc_deepep_scales(amax, TOP: tl.constexpr, INV_TOP: tl.constexpr,
                        ROUND_SCALE: tl.constexpr):
    """(scale sent, inverse multiplied) of a floored amax by DeepEP's calculate_fp8_scales
    (dcpc.numerics.token_scales, rule deepep or with ROUND_SCALE deepep_round_scale):
    amax * INV_TOP (fl32(1 / TOP)) and TOP / amax, or 2^e and 2^-e, e the ceiling of
    log2(amax * INV_TOP) from its bits."""
    scale = amax * INV_TOP
    if ROUND_SCALE:
        bits = scale.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)
    else:
        inverse = tl.math.div_rn(TOP, amax)
    return scale, inverse


@triton.jit
def _dcpc_widen(v):
    """An fp8 value (or any float) as fp32: every fp8 operand's load. e5m2 by its bits,
    as fp16's high byte: the Triton 3.6 interpreter's e5m2 conversion reads inf and NaN
    as finite (0x7C: 65536). e4m3 converted, its NaN bytes (0x7F, 0xFF: the low 7 bits
    set) NaN by a select: the interpreter reads them as +-480 (a GPU as NaN)."""
    if v.dtype == tl.float8e5:
        h = v.to(tl.uint8, bitcast=True).to(tl.uint16) << 8
        return h.to(tl.float16, bitcast=True).to(tl.float32)
    if v.dtype == tl.float8e4nv:
        nan = (v.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        return tl.where(nan, float("nan"), v.to(tl.float32))
    return v.to(tl.float32)


@triton.jit
def _dcpc_merge_cols(
    o,
    lse,
    dst,
    src_o,
    src_lse,
    c0,
    n,
    live,
    top,
    inv_total,
    seq,
    padding,
    rows,
    part_rows,
    row_len,
    so0,
    so1,
    sl0,
    sl1,
    inv_scale,
    OWN: tl.constexpr,
    FROM_SRC: tl.constexpr,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    MASK: tl.constexpr,
    BASE2: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Columns [c0, c0 + BLOCK_D) of rows n of dst (see _dcpc_merge_rows)."""
    c = c0 + tl.arange(0, BLOCK_D)
    m = live[:, None] & (c < row_len)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if OWN < 0:
        for p in tl.static_range(WORLD):  # all W partials' loads in flight at once
            lse_p = _dcpc_partial_lse(
                lse,
                src_lse,
                p,
                n,
                live,
                rows,
                part_rows,
                seq,
                padding,
                sl0,
                sl1,
                WORLD,
                INTERLEAVE,
                MASK,
                FROM_SRC,
            )
            w = _dcpc_weight(lse_p, top, inv_total, BASE2)[:, None]
            ptrs = _dcpc_part_ptrs(
                o, src_o, p, n, rows, part_rows, row_len, so0, so1, WORLD, FROM_SRC
            )
            part = _dcpc_widen(tl.load(ptrs[:, None] + c[None, :], mask=m, other=0.0))
            acc += tl.where(w > 0, w * part, 0.0)
    else:
        lse_p = _dcpc_partial_lse(
            lse,
            src_lse,
            OWN,
            n,
            live,
            rows,
            part_rows,
            seq,
            padding,
            sl0,
            sl1,
            WORLD,
            INTERLEAVE,
            MASK,
            FROM_SRC,
        )
        w = _dcpc_weight(lse_p, top, inv_total, BASE2)[:, None]
        at = (n // part_rows).to(tl.int64) * so0 + (n % part_rows).to(tl.int64) * so1
        part = _dcpc_widen(tl.load(o + at[:, None] + c[None, :], mask=m, other=0.0))
        acc = tl.where(w > 0, w * part, 0.0)
    out = dst + n.to(tl.int64)[:, None] * row_len + c[None, :]
    if SCALE:
        acc = _dcpc_quantize(acc, inv_scale)
        _dcpc_store_fp8(out, acc, m)
    else:
        tl.store(out, acc, mask=m)


@triton.jit
def _dcpc_row_mask(
    seq_lens,
    query_start_loc,
    row0,
    rows,
    group_rows,
    batch,
    MASK: tl.constexpr,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows n = [row0, row0 + BLOCK_N): (n, live, sequence length, padding flag). Local
    inputs only, so a fused kernel can look them up before it waits for peers."""
    n = row0 + tl.arange(0, BLOCK_N)
    live = n < rows
    if MASK:
        seq, padding = _dcpc_row_seq(
            seq_lens,
            query_start_loc,
            n,
            live,
            group_rows,
            batch,
            WORLD,
            INTERLEAVE,
            SEARCH_STEPS,
            BLOCK_B,
        )
    else:
        seq = n
        padding = n < 0
    return n, live, seq, padding


@triton.jit
def _dcpc_merge_masked(
    o,
    lse,
    dst,
    dst_lse,
    src_o,
    src_lse,
    n,
    live,
    seq,
    padding,
    rows,
    part_rows,
    row_len,
    so0,
    so1,
    sl0,
    sl1,
    inv_scale,
    OWN: tl.constexpr,
    FROM_SRC: tl.constexpr,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    MASK: tl.constexpr,
    BASE2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    SCALE: tl.constexpr,
    ROW_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows n of dst, given their mask (_dcpc_row_mask). OWN < 0: sum the W partials o[p]
    weighted by exp(lse_p - LSE) (lse_combine); OWN = r: o is rank r's partial alone,
    rescaled by its weight (lse_correct). FROM_SRC = r >= 0: partial r is read from
    src_o/src_lse (see _dcpc_part_ptrs); -1: every partial is in o/lse. ROW_LEN > 0:
    row_len is fixed for the module and the column loop is unrolled (the partials'
    loads issue with the LSE's). (so0, so1), (sl0, sl1): strides of the outer and mid
    axes of this rank's own partial o (OWN >= 0, or src_o for FROM_SRC) and of src_lse;
    OWN >= 0 reads o rows n as [n // part_rows, n % part_rows]. SCALE: dst is quantized,
    x * inv_scale (_dcpc_inv_scale of the output scale) clamped to dst's range (fp8
    output)."""
    top, inv_total, merged = _dcpc_merged_lse(
        lse,
        src_lse,
        n,
        live,
        rows,
        part_rows,
        seq,
        padding,
        sl0,
        sl1,
        WORLD,
        INTERLEAVE,
        MASK,
        FROM_SRC,
        BASE2,
        BLOCK_N,
    )
    if ROW_LEN > 0:
        for c0 in tl.static_range(0, ROW_LEN, BLOCK_D):
            _dcpc_merge_cols(
                o,
                lse,
                dst,
                src_o,
                src_lse,
                c0,
                n,
                live,
                top,
                inv_total,
                seq,
                padding,
                rows,
                part_rows,
                row_len,
                so0,
                so1,
                sl0,
                sl1,
                inv_scale,
                OWN,
                FROM_SRC,
                WORLD,
                INTERLEAVE,
                MASK,
                BASE2,
                SCALE,
                BLOCK_N,
                BLOCK_D,
            )
    else:
        for c0 in range(0, row_len, BLOCK_D):
            _dcpc_merge_cols(
                o,
                lse,
                dst,
                src_o,
                src_lse,
                c0,
                n,
                live,
                top,
                inv_total,
                seq,
                padding,
                rows,
                part_rows,
                row_len,
                so0,
                so1,
                sl0,
                sl1,
                inv_scale,
                OWN,
                FROM_SRC,
                WORLD,
                INTERLEAVE,
                MASK,
                BASE2,
                SCALE,
                BLOCK_N,
                BLOCK_D,
            )
    if RETURN_LSE:
        tl.store(dst_lse + n, merged, mask=live)


@triton.jit
def _dcpc_merge_rows(
    o,
    lse,
    dst,
    dst_lse,
    seq_lens,
    query_start_loc,
    src_o,
    src_lse,
    row0,
    rows,
    part_rows,
    row_len,
    group_rows,
    batch,
    so0,
    so1,
    sl0,
    sl1,
    inv_scale,
    OWN: tl.constexpr,
    FROM_SRC: tl.constexpr,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    MASK: tl.constexpr,
    BASE2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    SCALE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ROW_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows [row0, row0 + BLOCK_N) of dst: _dcpc_row_mask, then _dcpc_merge_masked."""
    n, live, seq, padding = _dcpc_row_mask(
        seq_lens,
        query_start_loc,
        row0,
        rows,
        group_rows,
        batch,
        MASK,
        WORLD,
        INTERLEAVE,
        SEARCH_STEPS,
        BLOCK_B,
        BLOCK_N,
    )
    _dcpc_merge_masked(
        o,
        lse,
        dst,
        dst_lse,
        src_o,
        src_lse,
        n,
        live,
        seq,
        padding,
        rows,
        part_rows,
        row_len,
        so0,
        so1,
        sl0,
        sl1,
        inv_scale,
        OWN,
        FROM_SRC,
        WORLD,
        INTERLEAVE,
        MASK,
        BASE2,
        RETURN_LSE,
        SCALE,
        ROW_LEN,
        BLOCK_N,
        BLOCK_D,
    )
