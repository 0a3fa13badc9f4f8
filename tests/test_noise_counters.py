"""The counter-based seed noise Z (issue #8, #15): secret keys, distinct counters, layout.

Independent references: a scalar pure-Python Philox4x32-10 checked against the Random123
known-answer vectors (kat_vectors, philox4x32 10), numpy's Philox4x64-10 driven by hand with
the documented counters, and math.log / math.cos Box-Muller.
"""

from __future__ import annotations

import math
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from corrnoise.errors import CorrnoiseError
from corrnoise.noise import make_generator, seed_noise
from corrnoise.noise import seeds as S
from corrnoise.strategies import DPCGD, Identity, ToeplitzSqrt

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# Random123 kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words), output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def ref_philox4x32_10(ctr, key):
    """Scalar Philox4x32-10 (Salmon et al. 2011): key bumped before rounds 2..10."""
    x0, x1, x2, x3 = ctr
    k0, k1 = key
    for r in range(10):
        if r > 0:
            k0 = (k0 + 0x9E3779B9) % 2**32
            k1 = (k1 + 0xBB67AE85) % 2**32
        p0 = 0xD2511F53 * x0
        p1 = 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 % 2**32, (p0 >> 32) ^ x3 ^ k1, p0 % 2**32
    return x0, x1, x2, x3


def ref_box_muller(u1, u2):
    r = math.sqrt(-2.0 * math.log(u1))
    return r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)


def torch_path(seed, t, m, dtype=torch.float64, start=0, stop=None, chunk=S.DEFAULT_CHUNK):
    """Z on the torch (CUDA) path, computed with the same torch ops on the CPU."""
    stop = m if stop is None else stop
    out = torch.empty(stop - start, dtype=dtype)
    S._fill_torch(out, seed, [(t, 1.0)], m, start, chunk)
    return out


# --- Philox -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox4x32_matches_random123_known_answers(ctr, key, want):
    assert ref_philox4x32_10(ctr, key) == want
    got = S.philox4x32(*[torch.tensor([c], dtype=torch.int64) for c in ctr], *key)
    assert tuple(int(g) for g in got) == want


def test_torch_philox_equals_scalar_reference_on_random_words():
    rng = np.random.default_rng(0)
    ctr = rng.integers(0, 2**32, size=(4, 300), dtype=np.int64)
    key = [int(k) for k in rng.integers(0, 2**32, size=2)]
    got = S.philox4x32(*[torch.from_numpy(c) for c in ctr], *key)
    for i in range(300):
        assert tuple(int(g[i]) for g in got) == ref_philox4x32_10(tuple(int(c[i]) for c in ctr), key)


# --- documented layouts, recomputed independently ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_z_follows_documented_philox4x64_layout(dtype):
    seed, t, m, chunk = 99, 5, 23, 10  # blocks of 10, 10, 3 (the last one odd)
    key = S.derive_key(seed)
    key = [int.from_bytes(key[0:8], "little"), int.from_bytes(key[8:16], "little")]
    dom = 0x5A02 if dtype == torch.float64 else 0x5A01
    want = np.zeros(m)
    for k in range(3):
        length = min(chunk, m - k * chunk)
        h = (length + 1) // 2
        raw = np.random.Philox(key=key, counter=[0, k, t, dom]).random_raw(2 * h if dtype == torch.float64 else h)
        vals = np.zeros(2 * h)
        for i in range(h):
            if dtype == torch.float64:
                u1, u2 = ((int(raw[2 * i]) >> 11) + 1) / 2**53, (int(raw[2 * i + 1]) >> 11) / 2**53
            else:
                u1, u2 = ((int(raw[i]) & 0xFFFFFFFF) + 1) / 2**32, (int(raw[i]) >> 32) / 2**32
            vals[i], vals[h + i] = ref_box_muller(u1, u2)
        want[k * chunk: k * chunk + length] = vals[:length]
    got = seed_noise(seed, t, m, dtype=dtype, chunk_size=chunk).double().numpy()
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_path_follows_documented_philox4x32_layout(dtype):
    seed, t, m, chunk = 1234, 7, 21, 6  # blocks 6, 6, 6, 3; odd half-pairs share calls
    k0, k1, s0, s1 = (int.from_bytes(S.derive_key(seed)[16 + 4 * i: 20 + 4 * i], "little") for i in range(4))
    hc = (chunk + 1) // 2
    want = np.zeros(m)
    for k in range(-(-m // chunk)):
        length = min(chunk, m - k * chunk)
        h = (length + 1) // 2
        for i in range(h):
            p = k * hc + i
            if dtype == torch.float64:
                w = ref_philox4x32_10((p, t | 2**31, s0, s1), (k0, k1))
                u1 = ((((w[0] << 32) | w[1]) >> 11) + 1) / 2**53
                u2 = (((w[2] << 32) | w[3]) >> 11) / 2**53
            else:
                w = ref_philox4x32_10((p // 2, t, s0, s1), (k0, k1))
                u1, u2 = (w[2 * (p % 2)] + 1) / 2**32, w[2 * (p % 2) + 1] / 2**32
            c, s = ref_box_muller(u1, u2)
            want[k * chunk + i] = c
            if h + i < length:
                want[k * chunk + h + i] = s
    got = torch_path(seed, t, m, dtype=dtype, chunk=chunk).double().numpy()
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# --- distinct counters ---------------------------------------------------------------------------

triples = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.sampled_from([torch.float32, torch.float64]))


@given(triples, triples, st.integers(1, 10**6), st.integers(1, 10**6))
@example((0, 0, torch.float32), (2**32, 0, torch.float32), 5, 5)  # the old breach: seeds equal mod 2^32
@example((2**16, 3, torch.float32), (0, 3, torch.float32), 5, 5)
@example((7, 2**40, torch.float64), (7, 0, torch.float64), 5, 5)
@example((7, 1, torch.float64), (7, 1, torch.float32), 5, 5)
def test_distinct_step_block_dtype_get_disjoint_counter_ranges(a, b, len_a, len_b):
    """A block draw uses counters (i, block, t, domain), 1 <= i <= ceil(words / 4): the
    (block, t, domain) words decode back to the triple, so distinct triples never meet."""
    ca, cb = S.block_counter(a[0], a[1], a[2]), S.block_counter(b[0], b[1], b[2])
    for c, (t, block, dtype) in ((ca, a), (cb, b)):
        assert c[0] == 0 and c[1] == block and c[2] == t and c[3] == (0x5A02 if dtype == torch.float64 else 0x5A01)
    ra = {(i,) + ca[1:] for i in range(1, min(4, -(-S.block_words(len_a, a[2]) // 4)) + 1)}
    rb = {(i,) + cb[1:] for i in range(1, min(4, -(-S.block_words(len_b, b[2]) // 4)) + 1)}
    if a != b:
        assert ca != cb and ca[1:] != cb[1:] and not ra & rb


def test_block_counter_refuses_words_that_do_not_fit():
    with pytest.raises(CorrnoiseError) as err:
        S.block_counter(2**64, 0, torch.float32)
    assert err.value.param == "t"


_REAL_PHILOX = np.random.Philox


class _RecordingPhilox:
    """np.random.Philox that records the counter range each draw consumes."""

    log: list = []

    def __init__(self, key, counter):
        self._bg = _REAL_PHILOX(key=key, counter=counter)
        self.start = tuple(int(c) for c in counter)

    def random_raw(self, n):
        out = self._bg.random_raw(n)
        end = tuple(int(c) for c in self._bg.state["state"]["counter"])
        _RecordingPhilox.log.append((self.start, end, out.copy()))
        return out

    @property
    def state(self):
        return self._bg.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_two_draws_of_a_run_share_a_counter(monkeypatch, dtype):
    """Every draw of a sharded DP-CGD run and a regenerating run (Z[t-1], Z[tau] redrawn):
    draws whose counter ranges overlap are the same (t, block) redrawn, with identical words."""
    monkeypatch.setattr(S.np.random, "Philox", _RecordingPhilox)
    _RecordingPhilox.log = []
    m, chunk, n = 50, 8, 6
    for strategy in (DPCGD(0.7, n), ToeplitzSqrt(n)):
        for shard in [(0, 21), (21, 50), (0, 50)]:
            gen = make_generator(strategy, m, seed=77, dtype=dtype, chunk_size=chunk, shard=shard,
                                 method="regenerate" if strategy.kind == "toeplitz-sqrt" else "auto")
            for _ in range(n):
                gen.next_flat()
    log = _RecordingPhilox.log
    assert len(log) > 100
    ranges = {}
    for start, end, words in log:
        assert start[0] == 0 and end[1:] == start[1:]  # word 0 never carried into the block word
        block, t, dom = start[1:]
        length = min(chunk, m - block * chunk)
        assert end[0] == -(-S.block_words(length, dtype) // 4)  # consumed exactly [1, ceil(words/4)]
        counters = frozenset((i, block, t, dom) for i in range(1, end[0] + 1))
        key = (t, block)
        if key in ranges:
            assert ranges[key][0] == counters and np.array_equal(ranges[key][1], words)
        else:
            ranges[key] = (counters, words)
    keys = list(ranges)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not ranges[a][0] & ranges[b][0]
    assert {t for t, _ in keys} == set(range(n)) and {k for _, k in keys} == set(range(7))


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_torch_path_coordinates_use_distinct_words(chunk):
    """(call, c1, word, cos/sin) is injective over (t, coordinate, dtype) on the torch path."""
    m = 131
    pos = torch.arange(m)
    seen = set()
    count = 0
    for f64 in (False, True):
        for t in range(5):
            call, c1, word0, is_sin = S.torch_coordinate_source(t, pos, m, chunk, f64)
            for c, w, s in zip(call.tolist(), word0.tolist(), is_sin.tolist()):
                seen.add((c, c1, w, s))
                count += 1
    assert len(seen) == count


# --- the breach: repeated rows --------------------------------------------------------------------

def _has_repeated_rows(rows: np.ndarray) -> bool:
    return len(np.unique(rows, axis=0)) < len(rows)


@pytest.mark.slow
def test_frozen_old_generator_repeats_dpsgd_rows():
    """The pre-#8 generator (frozen in benchmarks/) fails the check below: torch keeps 32 seed bits."""
    sys.path.insert(0, str(BENCH))
    try:
        from old_seed_noise import old_fill_seed_noise
    finally:
        sys.path.remove(str(BENCH))
    gen = torch.Generator()
    out = torch.empty(2)
    rows = np.stack([old_fill_seed_noise(out, 2024, t, 2, generator=gen).numpy().copy() for t in range(300_000)])
    assert _has_repeated_rows(rows)
    np.testing.assert_array_equal(rows[645], rows[19405])


@pytest.mark.slow
def test_300k_dpsgd_rows_from_one_seed_never_repeat():
    n = 300_000
    gen = make_generator(Identity(n), 2, seed=2024, dtype=torch.float32)
    rows = np.stack([gen.next_flat().numpy() for _ in range(n)])
    assert not _has_repeated_rows(rows)
    assert not np.array_equal(rows[645], rows[19405])


# --- secret seeds ---------------------------------------------------------------------------------

def test_default_seed_is_a_fresh_256_bit_secret(monkeypatch):
    asked = []
    real = S.secrets.randbits
    monkeypatch.setattr(S.secrets, "randbits", lambda k: asked.append(k) or real(k))
    a = make_generator(Identity(3), 100)
    b = make_generator(Identity(3), 100)
    assert asked == [256, 256] and S.SEED_BITS >= 128
    assert a.seed != b.seed and max(a.seed, b.seed).bit_length() > 128  # fails with prob 2^-127
    assert not torch.equal(a.next_flat(), b.next_flat())


def test_every_seed_bit_changes_the_noise():
    """The old generator gave identical noise for seeds s and s + 2^32 (and ignored bits >= 64)."""
    s = 12345
    rows = [seed_noise(s + d, 0, 16) for d in (0, 2**32, 2**63, 2**64, 2**255, 2**1000)]
    for i in range(len(rows)):
        for j in range(i):
            assert not torch.equal(rows[i], rows[j])
    assert len({S.derive_key(v) for v in (0, 1, 256, 2**64, 2**64 + 1)}) == 5


def test_bad_seeds_and_steps_raise_naming_the_parameter():
    for bad in (-1, 1.5, "7", None):
        with pytest.raises(CorrnoiseError) as err:
            seed_noise(bad, 0, 4)
        assert err.value.param == "seed"
    with pytest.raises(CorrnoiseError) as err:
        torch_path(1, 2**31, 4)
    assert err.value.param == "t"
    with pytest.raises(CorrnoiseError) as err:
        seed_noise(1, 0, 4, chunk_size=0)
    assert err.value.param == "chunk_size"


def test_version_1_generator_states_are_refused():
    gen = make_generator(Identity(4), 10, seed=1)
    state = gen.state_dict()
    state["version"] = 1
    with pytest.raises(CorrnoiseError) as err:
        make_generator(Identity(4), 10, seed=1).load_state_dict(state)
    assert err.value.param == "state"


# --- slices, combinations, threads, dtypes --------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 70), st.data(), st.sampled_from([torch.float32, torch.float64]),
       st.booleans())
def test_any_slice_equals_the_full_row(m, chunk, data, dtype, on_torch_path):
    start = data.draw(st.integers(0, m - 1))
    stop = data.draw(st.integers(start + 1, m))
    if on_torch_path:
        full, part = torch_path(5, 3, m, dtype, chunk=chunk), torch_path(5, 3, m, dtype, start, stop, chunk)
    else:
        full = seed_noise(5, 3, m, dtype=dtype, chunk_size=chunk)
        part = seed_noise(5, 3, m, dtype=dtype, start=start, stop=stop, chunk_size=chunk)
    assert torch.equal(part, full[start:stop])


def test_fused_combination_equals_sum_of_rows():
    m, chunk = 1000, 64
    terms = [(4, 1.5), (3, -0.9), (0, 0.25)]
    out = torch.empty(600, dtype=torch.float64)
    S.fill_noise_combination(out, 3, terms, m, start=250, chunk_size=chunk)
    want = sum(c * seed_noise(3, tau, m, chunk_size=chunk) for tau, c in terms)[250:850]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert torch.equal(S.fill_noise_combination(out, 3, [], m, 250, chunk), torch.zeros(600, dtype=torch.float64))


def test_thread_count_does_not_change_z():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = seed_noise(8, 2, 50_000, dtype=torch.float32, chunk_size=1000)
        torch.set_num_threads(2)
        two = seed_noise(8, 2, 50_000, dtype=torch.float32, chunk_size=1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_half_precision_is_rounded_float32_noise():
    z32 = seed_noise(4, 1, 500, dtype=torch.float32, chunk_size=64)
    assert torch.equal(seed_noise(4, 1, 500, dtype=torch.bfloat16, chunk_size=64), z32.to(torch.bfloat16))


@pytest.mark.parametrize("path", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_z_is_standard_normal(path, dtype):
    from scipy import stats

    m = 200_000
    z = seed_noise(21, 0, m, dtype=dtype) if path == "cpu" else torch_path(21, 0, m, dtype)
    z = z.double().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    bound = math.sqrt(-2 * math.log(2.0 ** -53 if dtype == torch.float64 else 2.0 ** -32))
    assert np.max(np.abs(z)) <= bound + 1e-4
    # different steps are uncorrelated streams
    z2 = (seed_noise(21, 1, m, dtype=dtype) if path == "cpu" else torch_path(21, 1, m, dtype)).double().numpy()
    assert abs(np.corrcoef(z, z2)[0, 1]) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_z_equals_the_torch_path_on_cpu(dtype):
    m, chunk = 300_001, 1 << 12
    got = seed_noise(6, 9, m, dtype=dtype, device="cuda", chunk_size=chunk).cpu()
    want = torch_path(6, 9, m, dtype, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    part = seed_noise(6, 9, m, dtype=dtype, device="cuda", start=777, stop=200_000, chunk_size=chunk).cpu()
    torch.testing.assert_close(part, got[777:200_000], rtol=0, atol=0)
    # the fused kernel ran: the eager fallback is identical in value and ~100x slower (RESULTS.md);
    # float32 with Triton installed: the Triton kernel, else the compiled torch ops
    if dtype == torch.float32 and _has_triton():
        assert S._TRITON["cuda"] is not None
    else:
        assert S._COMPILED["cuda"] is not None and ("cuda", dtype == torch.float64) in S._CHECKED


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --- the Triton kernel ---------------------------------------------------------------------------

@pytest.fixture
def fresh_triton_state(monkeypatch):
    """The Triton kernel's cache emptied for one test, "cpu" among its devices (Triton runs on
    the CPU only in its interpreter, TRITON_INTERPRET=1; the fakes below need no Triton)."""
    monkeypatch.setattr(S, "_TRITON", {})
    monkeypatch.setattr(S, "TRITON_DEVICES", {"cpu"})
    monkeypatch.delenv("CORRNOISE_NO_TRITON", raising=False)


def _eager_fill(out, seed, terms, m, start, chunk):
    """The same fill with the Triton kernel off (the torch ops, eager on the CPU)."""
    saved = dict(S._TRITON)
    S._TRITON["cpu"] = None
    try:
        S._fill_torch(out, seed, terms, m, start, chunk)
    finally:
        S._TRITON.clear()
        S._TRITON.update(saved)
    return out


@pytest.mark.skipif(not _has_triton(), reason="needs Triton")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_triton_kernel_matches_the_torch_ops(fresh_triton_state, monkeypatch, device):
    """The Triton kernel gives the torch path's Z (bit-identical Philox words; log, sin, cos to
    float32 rounding): two terms, a shard that starts and ends inside blocks, odd block lengths,
    the largest step. On the CPU it runs in Triton's interpreter (TRITON_INTERPRET=1)."""
    import os

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on the CPU only with TRITON_INTERPRET=1")
    S.TRITON_DEVICES.add(device)
    m, chunk, start, stop = 70_001, 1 << 12, 333, 65_555
    terms = [(S._MAX_T_TORCH, 1.3), (4, -0.5)]
    got = torch.empty(stop - start, device=device)
    S._fill_torch(got, 2**200 + 7, terms, m, start, chunk)
    assert S._TRITON[device] is not None
    want = _eager_fill(torch.empty(stop - start), 2**200 + 7, terms, m, start, chunk)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _fake_triton(monkeypatch, fill_normals):
    """A stand-in for :mod:`corrnoise.noise.triton_philox` whose fill is ``fill_normals``."""
    import types

    fake = types.ModuleType("corrnoise.noise.triton_philox")
    fake.fill_normals = fill_normals
    monkeypatch.setitem(sys.modules, "corrnoise.noise.triton_philox", fake)


def _eager_kernel(out, start, t, chunk, m, key, coef, accumulate):
    """What the Triton kernel computes, with the eager torch ops."""
    pos = torch.arange(start, start + out.numel(), dtype=torch.int64, device=out.device)
    z = coef * S._torch_normals_eager(pos, t, (chunk, m), key, False, torch.float32)
    return out.add_(z) if accumulate else out.copy_(z)


def test_triton_fill_is_used_after_its_probe(fresh_triton_state, monkeypatch):
    calls = []

    def fill(out, *args):
        calls.append(out.numel())
        return _eager_kernel(out, *args)

    _fake_triton(monkeypatch, fill)
    got = S._fill_torch(torch.empty(5_000), 3, [(2, 1.0), (7, 0.25)], 5_000, 0, 512) or None
    assert got is None and calls == [4096, 4096, 5_000, 5_000]  # the probe's two, then one per term
    assert S._TRITON["cpu"] is fill
    # float64, a non-contiguous output and CORRNOISE_NO_TRITON take the torch ops
    S._fill_torch(torch.empty(100, dtype=torch.float64), 3, [(2, 1.0)], 100, 0, 512)
    S._fill_torch(torch.empty(200)[::2], 3, [(2, 1.0)], 100, 0, 512)
    monkeypatch.setenv("CORRNOISE_NO_TRITON", "1")
    S._fill_torch(torch.empty(100), 3, [(2, 1.0)], 100, 0, 512)
    assert len(calls) == 4


def test_no_triton_is_silent(fresh_triton_state, monkeypatch):
    import warnings

    monkeypatch.setitem(sys.modules, "corrnoise.noise.triton_philox", None)  # import raises ImportError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.empty(3_000)
        S._fill_torch(got, 5, [(2, 1.0)], 3_000, 0, 512)
    assert S._TRITON["cpu"] is None
    assert torch.equal(got, torch_path(5, 2, 3_000, torch.float32, chunk=512))


@pytest.mark.parametrize("fill,message", [
    (lambda out, *a: _eager_kernel(out, *a).mul_(1 + 1e-3), r"\(it differs from the eager ops by [0-9.e+-]+ on a probe\)"),
    (lambda out, *a: (_ for _ in ()).throw(RuntimeError("PTX error\nline 2")), r"\(RuntimeError: PTX error\)"),
])
def test_a_triton_kernel_that_fails_or_disagrees_is_refused(fresh_triton_state, monkeypatch, fill, message):
    """Said once in one line; the row is then the torch ops' (identical in value)."""
    _fake_triton(monkeypatch, fill)
    got = torch.empty(3_000)
    with pytest.warns(RuntimeWarning, match="Triton seed-noise kernel is not used on cpu " + message) as caught:
        S._fill_torch(got, 5, [(2, 1.0)], 3_000, 0, 512)
        S._fill_torch(got, 5, [(2, 1.0)], 3_000, 0, 512)
    assert len([w for w in caught if "Triton" in str(w.message)]) == 1
    assert S._TRITON["cpu"] is None and torch.equal(got, torch_path(5, 2, 3_000, torch.float32, chunk=512))


def test_a_triton_launch_that_fails_after_the_probe_falls_back(fresh_triton_state, monkeypatch):
    def fill(out, *args):
        if out.numel() != 4096:
            raise RuntimeError("out of resources: shared memory")
        return _eager_kernel(out, *args)

    _fake_triton(monkeypatch, fill)
    got = torch.empty(3_000)
    with pytest.warns(RuntimeWarning, match=r"not used on cpu \(RuntimeError: out of resources: shared memory\)"):
        S._fill_torch(got, 5, [(2, 1.0), (3, 2.0)], 3_000, 0, 512)
    want = torch.empty(3_000)
    S._fill_torch(want, 5, [(2, 1.0), (3, 2.0)], 3_000, 0, 512)
    assert S._TRITON["cpu"] is None and torch.equal(got, want)


# --- the compiled torch path -------------------------------------------------------------------

@pytest.fixture
def fresh_compile_state(monkeypatch):
    """The torch path's compile cache emptied for one test, no device compiled until the test
    adds one to ``COMPILE_DEVICES`` (all restored after it)."""
    monkeypatch.setattr(S, "_COMPILED", {})
    monkeypatch.setattr(S, "_CHECKED", set())
    monkeypatch.setattr(S, "COMPILE_DEVICES", set())
    monkeypatch.delenv("CORRNOISE_NO_COMPILE", raising=False)


@pytest.mark.parametrize("f64", [False, True])
def test_tensor_scalars_give_the_same_words_as_ints(f64):
    """The compiled kernel takes t, chunk, m and the key as 0-d int64 tensors: the same ops on
    them give bit-identical normals to Python ints (integer arithmetic is exact)."""
    pos = torch.arange(20_000, dtype=torch.int64)
    key = S._torch_key(123)
    dtype = torch.float64 if f64 else torch.float32
    want = S._torch_normals_eager(pos, 77, (1000, 19_999), key, f64, dtype)
    sc = torch.tensor([77, 1000, 19_999, *key], dtype=torch.int64)
    got = S._torch_normals_eager(pos, sc[0], (sc[1], sc[2]), tuple(sc[3:]), f64, dtype)
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="needs a C++ compiler")
def test_compiled_torch_path_on_cpu_matches_eager(fresh_compile_state):
    """The same torch.compile(dynamic=True) as on CUDA, through inductor's CPU backend: dynamo
    traces it with tensor scalars, it passes its probe, is reused for other steps without
    recompiling, and agrees with the eager ops to float32 rounding (2 steps, 2 pieces of
    different lengths). Where inductor's own C++ does not compile (torch 2.13 under
    ATEN_CPU_CAPABILITY=default emits at::vec code its headers then lack), the test skips: that
    is the compiler's environment, and the fallback it takes is tested below."""
    import warnings

    m, chunk = S._TORCH_PIECE + 5_001, 1 << 12
    S.COMPILE_DEVICES.add("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        got = torch.empty(m)
        S._fill_torch(got, 9, [(3, 1.0), (4, -0.5)], m, 0, chunk)
    said = [str(w.message) for w in caught if "seed-noise kernel" in str(w.message)]
    if said and "CppCompileError" in said[0]:
        pytest.skip(f"inductor's C++ backend does not build here: {said[0]}")
    assert not said and S._COMPILED["cpu"] is not None and ("cpu", False) in S._CHECKED
    S.COMPILE_DEVICES.clear()
    want = torch.empty(m)
    S._fill_torch(want, 9, [(3, 1.0), (4, -0.5)], m, 0, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[:chunk], want[chunk:2 * chunk])  # not a constant or repeated block


def _falls_back(monkeypatch, compile_fn, message: str, calls: int = 1):
    """Fill a row with ``torch.compile`` replaced by ``compile_fn`` on the CPU: the warnings
    matching ``message`` (one is asked for), and the row equal to the eager ops' (the fallback)."""
    monkeypatch.setattr(torch, "compile", compile_fn)
    want = torch_path(5, 2, 10_000, torch.float32, chunk=512)
    S.COMPILE_DEVICES.add("cpu")
    got = torch.empty(10_000)
    with pytest.warns(RuntimeWarning, match=message) as caught:
        for _ in range(calls):
            S._fill_torch(got, 5, [(2, 1.0)], 10_000, 0, 512)
    assert S._COMPILED["cpu"] is None and torch.equal(got, want)
    return [w for w in caught if "seed-noise kernel" in str(w.message)]


def test_compile_failure_is_said_once_and_the_eager_path_used(fresh_compile_state, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no backend here\nsecond line")

    said = _falls_back(monkeypatch, broken, r"not used on cpu \(RuntimeError: no backend here\)", calls=2)
    assert len(said) == 1


def test_a_recompilation_that_fails_later_is_said_and_the_eager_path_used(fresh_compile_state, monkeypatch):
    def probe_only(fn, **kwargs):
        def run(pos, *a):
            if pos.numel() != 4096:  # the probe passes; the run's own length does not build
                raise RuntimeError("CompilationError at 68:12")
            return fn(pos, *a)
        return run

    _falls_back(monkeypatch, probe_only, r"not used on cpu \(RuntimeError: CompilationError at 68:12\)")


def test_a_compiled_kernel_that_disagrees_is_refused(fresh_compile_state, monkeypatch):
    def off_by_a_bit(fn, **kwargs):
        return lambda *a: fn(*a) * (1 + 1e-3)

    _falls_back(monkeypatch, off_by_a_bit, r"differs from the eager ops by [0-9.e+-]+ on a probe")


def test_a_wrapped_compiler_error_is_named_by_its_inner_error(fresh_compile_state, monkeypatch):
    class BackendCompilerFailed(RuntimeError):  # dynamo's wrapper keeps the compiler's error
        def __init__(self):
            super().__init__("backend='inductor' raised:\nCppCompileError: ...")
            self.inner_exception = ValueError("C++ compile error\nCommand: g++ ...")

    def wrapped(fn, **kwargs):
        def run(*a):
            raise BackendCompilerFailed()
        return run

    _falls_back(monkeypatch, wrapped, r"not used on cpu \(BackendCompilerFailed \(ValueError: C\+\+ compile error\)\);")


# --- distributed seed broadcast -------------------------------------------------------------------

@given(st.integers(0, 2**600))
def test_seed_limbs_round_trip(seed):
    from corrnoise.torch.distributed import limbs_to_seed, seed_to_limbs

    limbs = seed_to_limbs(seed)
    assert limbs_to_seed(limbs) == seed and all(0 <= v < 2**32 for v in limbs)


def test_broadcast_seed_keeps_every_bit():
    import torch.distributed as dist

    from corrnoise.torch.distributed import broadcast_seed

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        big = 2**255 + 2**64 + 2**32 + 7
        assert broadcast_seed(big) == big
        drawn = broadcast_seed(None)
        assert drawn.bit_length() > 128 and drawn != broadcast_seed(None)
    finally:
        dist.destroy_process_group()


def test_a_small_fill_stays_on_the_calling_thread(monkeypatch):
    """A CPU fill of fewer than PARALLEL_MIN_BLOCKS blocks runs on the calling thread (a training
    step's fill follows torch's kernels, whose spinning OpenMP workers our threads would share the
    cores with); from that many on, the worker threads share the blocks. The thread count does not
    change a value."""
    pools = []
    real = S._pool
    monkeypatch.setattr(S, "_threads", lambda: 2)
    monkeypatch.setattr(S, "_pool", lambda n: pools.append(n) or real(n))
    chunk, k = 64, S.PARALLEL_MIN_BLOCKS
    small = torch.empty((k - 1) * chunk)
    S.fill_seed_noise(small, 5, 3, small.numel(), chunk_size=chunk)
    assert pools == []
    big = torch.empty(k * chunk)
    S.fill_seed_noise(big, 5, 3, big.numel(), chunk_size=chunk)
    assert pools and set(pools) == {2}
    used = len(pools)
    monkeypatch.setattr(S, "PARALLEL_MIN_BLOCKS", k + 1)
    alone = torch.empty(k * chunk)
    S.fill_seed_noise(alone, 5, 3, alone.numel(), chunk_size=chunk)
    assert len(pools) == used and torch.equal(alone, big)
