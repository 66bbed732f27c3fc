"""The C kernels against plain PyTorch references, shape by shape: paged attention (decodes and
prefill tiles, every KV cache dtype), the fused small ops, the KV-cache write."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from unison.model.decoder import TorchOps
from unison.model.kernels import cpu_kernels
from unison.model.layers import key_rounding
from unison.model.layers.recent_rows import RecentRows
from unison.model.runner import BatchItem

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the runner uses torch's path")


def reference(q, k_cache, v_cache, tables, row_seq, row_len, window):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, (i, n) in enumerate(zip(row_seq.tolist(), row_len.tolist())):
        k = k_cache[tables[i]].flatten(0, 1)[:n].float()  # [n, kv_heads, d], in position order
        v = v_cache[tables[i]].flatten(0, 1)[:n].float()
        if window:
            k, v = k[-window:], v[-window:]
        k = k.transpose(0, 1).repeat_interleave(group, 0)
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        out[r] = F.scaled_dot_product_attention(q[r][:, None], k, v)[:, 0]
    return out


def _case(seqs, heads, kv_heads, head_dim, block_size, dtype, rows_per_seq, g):
    """Random caches, scattered tables whose unused tail points at a block of NaNs (which the
    kernel must never read), and query rows: the last `rows_per_seq` positions of each request."""
    lens = torch.randint(rows_per_seq, 300, (seqs,), generator=g)
    lens[0] = rows_per_seq  # the shortest context there is
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = seqs * width + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=g)[: seqs * width].view(seqs, width).contiguous()
    k_cache[-1], v_cache[-1] = float("nan"), float("nan")
    for i, n in enumerate(lens.tolist()):
        tables[i, (n + block_size - 1) // block_size:] = num_blocks - 1
    row_seq = torch.arange(seqs).repeat_interleave(rows_per_seq)
    row_len = torch.cat([torch.arange(n - rows_per_seq + 1, n + 1) for n in lens.tolist()])
    q = torch.randn(len(row_seq), heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, row_seq, row_len


@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window,rows", [
    (64, 9, 3, 64, 16, None, 1),  # SmolLM2-135M's decode shapes, one task per request
    (1, 9, 3, 64, 16, None, 1),  # a single decode: split by kv head across threads
    (3, 8, 8, 128, 4, None, 1),  # no GQA, the other unrolled head_dim
    (2, 4, 1, 256, 16, 40, 37),  # Gemma 3's head_dim; prefill tiles across a sliding window
    (5, 4, 2, 32, 16, 7, 20),  # a head_dim without its own copy; window shorter than a tile
    (2, 6, 1, 16, 1, 3, 5),  # multi-query; one-token blocks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_matches_reference(seqs, heads, kv_heads, head_dim, block_size, window, rows,
                                           dtype, threads):
    g = torch.Generator().manual_seed(seqs * heads + head_dim + rows)
    case = _case(seqs, heads, kv_heads, head_dim, block_size, dtype, rows, g)
    got = kernels.paged_attention(*case, window, threads)
    torch.testing.assert_close(got, reference(*case, window), rtol=1e-5, atol=1e-5)


def sink_reference(q, k_cache, v_cache, tables, row_seq, row_len, window, sinks):
    """gpt-oss's attention as transformers' eager path computes it: each head's learned sink is one
    more logit in the softmax, whose probability is then dropped (it has no value)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, (i, n) in enumerate(zip(row_seq.tolist(), row_len.tolist())):
        k = k_cache[tables[i]].flatten(0, 1)[:n].float()[-(window or n):]
        v = v_cache[tables[i]].flatten(0, 1)[:n].float()[-(window or n):]
        k = k.transpose(0, 1).repeat_interleave(group, 0).double()  # [heads, n, d]
        v = v.transpose(0, 1).repeat_interleave(group, 0).double()
        logits = q[r].double()[:, None] @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # [heads, 1, n]
        logits = torch.cat([logits, sinks.double()[:, None, None]], dim=-1)
        probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
        out[r] = (probs @ v)[:, 0].float()
    return out


@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window,rows", [
    (5, 8, 2, 64, 16, None, 1),  # decodes (the unrolled head_dim's path)
    (2, 8, 2, 64, 16, 128, 37),  # prefill tiles with gpt-oss's window, across a block edge
    (3, 4, 1, 32, 4, 7, 20),  # a head_dim without its own copy; window shorter than a tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_attention_sinks_match_the_float_reference(seqs, heads, kv_heads, head_dim, block_size, window,
                                                    rows, dtype):
    g = torch.Generator().manual_seed(11 + heads + rows)
    q, kc, vc, tables, row_seq, row_len = _case(seqs, heads, kv_heads, head_dim, block_size,
                                                torch.float32 if dtype == torch.int8 else dtype, rows, g)
    sinks = torch.randn(heads, generator=g) * 3  # some far above the scores, some below
    caches = [kc, vc]
    if dtype == torch.int8:  # stored rotated: the reference reads the rotated values, rotated back
        caches = list(_int8_caches(kc, vc, head_dim))
        rotated = sink_reference(hadamard(q), *map(dequantize_q8, caches), tables, row_seq, row_len, window,
                                 sinks)
        want = hadamard(rotated)
    else:
        want = sink_reference(q, kc, vc, tables, row_seq, row_len, window, sinks)
    got = kernels.paged_attention(q, *caches, tables, row_seq, row_len, window, 2, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = kernels.paged_attention(q, *caches, tables, row_seq, row_len, window, 2)
    none = kernels.paged_attention(q, *caches, tables, row_seq, row_len, window, 2,
                                   sinks=torch.full((heads,), -math.inf))
    assert torch.equal(plain, none)  # a sink of -inf is no sink, bit for bit


def test_paged_attention_rows_are_bit_identical_in_any_tile_or_batch():
    """A row's output is the same alone, in its request's prefill tile, beside other requests and
    at any thread count: the property that makes chunked and cached prefill match cold runs."""
    g = torch.Generator().manual_seed(3)
    q, kc, vc, tables, row_seq, row_len = _case(4, 9, 3, 64, 16, torch.float16, 24, g)
    together = kernels.paged_attention(q, kc, vc, tables, row_seq, row_len, None, 2)
    for r in (0, 5, 23, 24, 95):
        alone = kernels.paged_attention(q[r: r + 1].contiguous(), kc, vc, tables, row_seq[r: r + 1],
                                        row_len[r: r + 1], None, 1)
        assert torch.equal(alone[0], together[r]), f"row {r}"
    half = kernels.paged_attention(q[10:40].contiguous(), kc, vc, tables, row_seq[10:40], row_len[10:40],
                                   None, 1)
    assert torch.equal(half, together[10:40])


def q8(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8_0 in torch: each 32 values over their largest magnitude, rounded to nearest
    even, then their float16 scale's two bytes; [..., n] float32 -> [..., n / 32 * 34] int8."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    inv = torch.where(scale > 0, 1 / scale.float(), torch.zeros(()))
    q = torch.round(g * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1).reshape(*x.shape[:-1], -1)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x's last dim in blocks of its largest power-of-two divisor, each times the orthonormal
    Hadamard matrix, by the kernel's butterflies in the kernel's order (so to the bit)."""
    r = x.shape[-1] & -x.shape[-1]
    y = x.reshape(-1, r)
    h = 1
    while h < r:
        pairs = y.view(-1, r // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], 2).view(-1, r)
        h *= 2
    return (y * torch.tensor(1 / math.sqrt(r), dtype=torch.float32)).view(x.shape)


def dequantize_q8(c: torch.Tensor) -> torch.Tensor:
    g = c.reshape(*c.shape[:-1], -1, 34)
    return (g[..., :32].float() * g[..., 32:].contiguous().view(torch.float16).float()).flatten(-2)


@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window,rows", [
    (64, 9, 3, 64, 16, None, 1),  # SmolLM2-135M's decode shapes
    (3, 8, 8, 128, 4, None, 1),
    (4, 16, 2, 64, 16, 50, 1),  # eight query heads a key head (two passes of four); a window
    (1, 32, 8, 64, 16, None, 1),  # the 1B shape's single decode
    (2, 4, 1, 256, 16, 40, 37),  # Gemma 3's head_dim; prefill tiles across a sliding window
    (5, 4, 2, 32, 16, 7, 20),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_cache_is_q8_0_and_attention_reads_it_in_place(seqs, heads, kv_heads, head_dim, block_size,
                                                            window, rows, threads):
    """store_kv writes each row rotated (fused_ops.c's hadamard_rotate) as q8_0 blocks, to the
    bit as torch computes them; the kernel's attention over them is attention over their
    dequantized values, with the queries rotated alike and the result rotated back."""
    g = torch.Generator().manual_seed(seqs + head_dim)
    q, kc, vc, tables, row_seq, row_len = _case(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                                                rows, g)
    kc8, vc8 = _int8_caches(kc, vc, head_dim)
    assert torch.equal(kc8[:-1], q8(hadamard(kc[:-1]))) and torch.equal(vc8[:-1], q8(hadamard(vc[:-1])))
    kc8[-1], vc8[-1] = 127, 127  # the unused tail's block: huge values, were it ever read
    got = kernels.paged_attention(q, kc8, vc8, tables, row_seq, row_len, window, threads)
    rotated = reference(hadamard(q), dequantize_q8(kc8), dequantize_q8(vc8), tables, row_seq, row_len, window)
    want = hadamard(rotated)  # the rotation is its own inverse
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_keys_rounded_by_a_weight_keep_their_scales_and_lower_its_error(head_dim):
    """With key_rounding.py's weight W, store_kv's keys (shape_key_q8) keep nearest rounding's
    scales, stay within one step of each value, and have a weighted error e^T W e no larger than
    nearest's, smaller on most rows; values are untouched. W = identity: nearest is best, and
    kept to the bit."""
    g = torch.Generator().manual_seed(head_dim)
    kv_heads, n = 2, 200
    k, v = torch.randn(n, kv_heads * head_dim, generator=g), torch.randn(n, kv_heads * head_dim, generator=g)
    # queries mostly along a few directions, as many as the kernel makes passes (one per 16 values)
    directions = torch.randn(kv_heads, head_dim, head_dim // 16, generator=g)
    w = (directions @ directions.transpose(1, 2) + 0.1 * torch.eye(head_dim)).contiguous()

    def stored(weight):
        kc = torch.zeros(n, 1, kv_heads, head_dim // 32 * 34, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        kernels.store_kv(k, v, kc, vc, torch.arange(n), head_dim, weight)
        return kc.view(n, kv_heads, -1), vc

    (nearest, v_nearest), (shaped, v_shaped) = stored(None), stored(w)
    assert torch.equal(v_shaped, v_nearest)
    blocks, nearest_blocks = shaped.view(n, kv_heads, -1, 34), nearest.view(n, kv_heads, -1, 34)
    assert torch.equal(blocks[..., 32:], nearest_blocks[..., 32:])  # the scales
    assert (blocks[..., :32].int() - nearest_blocks[..., :32].int()).abs().max() == 1
    rotated = hadamard(k.view(n, kv_heads, head_dim))
    step = blocks[..., 32:].contiguous().view(torch.float16).float().repeat_interleave(32, -1).flatten(-2)
    error = dequantize_q8(shaped) - rotated
    assert (error.abs() <= step * (1 + 1e-6)).all()

    def cost(e):
        return torch.einsum("nhi,hij,nhj->nh", e.double(), w.double(), e.double())

    before, after = cost(dequantize_q8(nearest) - rotated), cost(error)
    assert (after <= before * (1 + 1e-6)).all() and (after < before).float().mean() > 0.9
    assert after.sum() < 0.1 * before.sum()  # four passes at any head_dim: 0.27 at 256
    identity = torch.eye(head_dim).expand(kv_heads, -1, -1).contiguous()
    assert torch.equal(stored(identity)[0], nearest)


def test_key_rounding_is_the_query_moment_and_the_key_mean_in_the_caches_rotation():
    """key_rounding.py per layer and kv head: W = E[q q^T] over the head's queries and the mean
    of its keys, both rotated by the matrix the kernel's butterflies apply (so they weigh and
    shift the keys as stored)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 6, 64, generator=g), torch.randn(10, 2, 64, generator=g)
    moments = key_rounding.Moments(2, 2, 64)
    assert moments.wrap(lambda layer, q, k, v: q)(1, q, k, k) is q
    rotated = hadamard(q.view(10, 2, 3, 64))
    weight, mean = moments.rounding()
    torch.testing.assert_close(weight[1], torch.einsum("nhgi,nhgj->hij", rotated, rotated) / 30)
    torch.testing.assert_close(mean[1], hadamard(k).mean(0))
    assert not weight[0].any() and not mean[0].any()
    x = torch.randn(5, 96, generator=g)  # head_dim 96: blocks of 32
    torch.testing.assert_close(x @ key_rounding.hadamard(96).float(), hadamard(x))


def _shared_keys(kc, kv_heads, head_dim, g):
    """Keys that share a large direction, as real keys do, but for each request's first token
    (an attention sink: far from the others' mean). Returns the mean as store_kv takes it."""
    shared = 4 * torch.randn(kv_heads, head_dim, generator=g)
    kc[:-1] += shared
    kc[:-1, 0] -= 2 * shared  # every block's first row: table order puts some first tokens there
    return hadamard(shared).contiguous()  # rotated, as keys are stored


def _scales(c):
    return c.view(*c.shape[:3], -1, 34)[..., 32:].contiguous().view(torch.int16)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_int8_key_blocks_are_stored_less_the_mean_where_that_is_finer(head_dim):
    """store_kv stores a key's block less its head's mean (rotated) where that needs the smaller
    scale, and marks it by the scale's sign bit; the sink-like rows keep theirs whole. Values are
    as they were. Attention adds the mean back to the marked blocks: nearer float32's than over
    keys stored whole (0.63x here: the sink-like rows keep their coarse step), and far off if the
    reader is not given the mean."""
    g = torch.Generator().manual_seed(head_dim)
    seqs, heads, kv_heads = 4, 4, 2
    q, kc, vc, tables, row_seq, row_len = _case(seqs, heads, kv_heads, head_dim, 16, torch.float32, 3, g)
    mean = _shared_keys(kc, kv_heads, head_dim, g)
    whole_k, whole_v = _int8_caches(kc, vc, head_dim)
    less_k, less_v = _int8_caches(kc, vc, head_dim, key_mean=mean)
    assert torch.equal(less_v, whole_v) and (_scales(whole_k[:-1]) >= 0).all()
    marked = _scales(less_k[:-1]) < 0
    assert marked[:, 1:].all() and not marked[:, 0].any()  # the sink-like rows: whole
    step = _scales(less_k[:-1]).abs().view(torch.float16).float().repeat_interleave(32, -1).flatten(-2)
    stored = dequantize_q8(less_k[:-1]) + marked.repeat_interleave(32, -1).flatten(-2) * mean
    assert ((stored - hadamard(kc[:-1])).abs() <= step * 0.5 + 1e-5).all()
    less_k[-1], less_v[-1] = 127, 127  # the unused tail's block, never read
    # exact keys, the cache's own values: what differs below is the keys' storing alone
    want = hadamard(reference(hadamard(q), hadamard(kc), dequantize_q8(less_v), tables, row_seq, row_len,
                              None))
    error = {name: (kernels.paged_attention(q, k8, less_v, tables, row_seq, row_len, None, 1,
                                            key_mean=m) - want).abs().mean()
             for name, k8, m in (("whole", whole_k, None), ("less", less_k, mean), ("unread", less_k, None))}
    assert error["less"] < 0.75 * error["whole"] and error["unread"] > 10 * error["whole"], error


def _int8_caches(kc, vc, head_dim, key_mean=None):
    """kc, vc stored as the int8 cache holds them (store_kv's q8 blocks), keys less `key_mean`."""
    width = kc.shape[2] * head_dim
    rows_kv = torch.cat([kc[:-1].flatten(0, 1).flatten(1), vc[:-1].flatten(0, 1).flatten(1)], 1)
    kc8 = torch.zeros(*kc.shape[:3], head_dim // 32 * 34, dtype=torch.int8)
    vc8 = torch.zeros_like(kc8)
    kernels.store_kv(rows_kv[:, :width], rows_kv[:, width:], kc8, vc8, torch.arange(len(rows_kv)), head_dim,
                     None, key_mean)
    return kc8, vc8


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 64, None), (16, 2, 64, 30),
                                                            (16, 2, 128, None), (4, 4, 128, 20),
                                                            (16, 2, 256, None), (6, 2, 256, 20)])
def test_int8_decode_rows_have_the_bits_of_prefill_rows(heads, kv_heads, head_dim, window):
    """A row alone (a decode step: the int8 cache's one-row path) gets the bits it gets inside a
    tile of several rows (prefill: the general path), so a token's output does not depend on how
    it was batched or whether it was recomputed after a preemption."""
    g = torch.Generator().manual_seed(head_dim + heads)
    q, kc, vc, tables, row_seq, row_len = _case(3, heads, kv_heads, head_dim, 16, torch.float32, 4, g)
    mean = _shared_keys(kc, kv_heads, head_dim, g)  # blocks stored whole and less the mean, both
    kc8, vc8 = _int8_caches(kc, vc, head_dim, key_mean=mean)
    together = kernels.paged_attention(q, kc8, vc8, tables, row_seq, row_len, window, 1, key_mean=mean)
    for r in range(len(q)):
        alone = kernels.paged_attention(q[r:r + 1].contiguous(), kc8, vc8, tables, row_seq[r:r + 1],
                                        row_len[r:r + 1], window, 2, key_mean=mean)
        assert torch.equal(alone[0], together[r]), r


def _recent_run(k, v, q, table, block_size, steps, threads=1):
    """One request through the int8 cache with its recent rows (recent_rows.py), step by step:
    `steps` as (start, rows, logits_start); a step starting before the last one's end recomputes
    rejected draft rows. The outputs of the rows no later step recomputes, in position order."""
    n, width = k.shape
    heads, head_dim = q.shape[1], q.shape[2]
    recent = RecentRows(1, block_size, width // head_dim, head_dim)
    kc = torch.zeros(max(table) + 1, block_size, width // head_dim, head_dim // 32 * 34, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    out = torch.empty(n, heads, head_dim)
    for start, rows, logits_start in steps:
        end = start + rows
        step = recent.step([BatchItem([0] * rows, start, table, logits_start)])
        layer = recent.layer(step, 0)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(start, end)])
        kernels.store_kv(k[start:end], v[start:end], kc, vc, slots, head_dim, recent=layer)
        out[start:end] = kernels.paged_attention(
            q[start:end].contiguous(), kc, vc, torch.tensor([table]), torch.zeros(rows, dtype=torch.int64),
            torch.arange(start + 1, end + 1), None, threads, recent=layer)
    return out, kc, vc, recent


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_int8_recent_rows_are_read_exact_and_alike_however_a_request_is_split(heads, kv_heads, head_dim):
    """With recent rows, a query reads its own block's keys and values as float16 (of the rotated
    rows) and older ones from the q8 blocks. A request prefilled whole, in chunks that end
    mid-block, decoded row by row, or through drafts partly rejected gets the same bits."""
    g = torch.Generator().manual_seed(head_dim)
    bs, n, width = 16, 75, kv_heads * head_dim
    kv = torch.randn(n, 2 * width, generator=g)
    k, v = kv[:, :width], kv[:, width:]  # one row stride, as in the fused QKV output
    q = torch.randn(n, heads, head_dim, generator=g)
    table = torch.randperm(12, generator=g)[:5].tolist()
    whole, kc, vc, _ = _recent_run(k, v, q, table, bs, [(0, n, n - 1)], threads=2)
    # the reference: rotated space, own block float16, the rest dequantized q8
    group, rq = heads // kv_heads, hadamard(q)
    own = hadamard(k.reshape(n, kv_heads, head_dim)).half().float()
    own_v = hadamard(v.reshape(n, kv_heads, head_dim)).half().float()
    old = dequantize_q8(kc[table].flatten(0, 1))[:n]
    old_v = dequantize_q8(vc[table].flatten(0, 1))[:n]
    for p in range(n):
        mine = torch.arange(p + 1) // bs == p // bs
        keys = torch.where(mine[:, None, None], own[: p + 1], old[: p + 1]).repeat_interleave(group, 1)
        values = torch.where(mine[:, None, None], own_v[: p + 1], old_v[: p + 1]).repeat_interleave(group, 1)
        want = F.scaled_dot_product_attention(rq[p][:, None], keys.transpose(0, 1), values.transpose(0, 1))
        torch.testing.assert_close(whole[p], hadamard(want[:, 0]), rtol=1e-5, atol=1e-5)
    chunks = [(0, 20, 20), (20, 17, 16)] + [(p, 1, 0) for p in range(37, 50)] + [(50, 25, 24)]
    drafts = [(0, 37, 36), (37, 5, 0), (39, 6, 0), (44, 4, 0), (47, 1, 0), (48, 8, 0), (50, 25, 24)]
    for steps in (chunks, drafts):
        assert torch.equal(_recent_run(k, v, q, table, bs, steps)[0], whole)


def test_recent_rows_keep_a_twin_or_two_a_request():
    """Twins hold the blocks a request continues mid-way: those its start passed are released, a
    freed block's goes, and the pool does not grow over a long decode."""
    recent, table, bs = RecentRows(2, 16, 1, 64), list(range(40, 80)), 16
    recent.step([BatchItem([0] * 100, 0, table, 99)])  # ends mid-block 6: its twin is kept
    assert list(recent.twin_of) == [46]
    for p in range(100, 605):
        step = recent.step([BatchItem([0], p, table, 0)])
        assert step.twin.tolist() == [-1 if p % bs == 0 else recent.twin_of[table[p // bs]]]
        assert len(recent.twin_of) <= 1
    recent.step([BatchItem([0] * 5, 605, table, 0)])  # a draft crossing into the next block
    assert sorted(recent.twin_of) == [77, 78]
    recent.drop(78)  # two rows kept: the block past them is trimmed
    recent.step([BatchItem([0], 607, table, 0)])
    assert list(recent.twin_of) == [77] and recent.twins_k.shape[1] == 8


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_cache_is_torchs_fp8_and_attention_reads_it_in_place(fp8, threads):
    """store_kv rounds to fp8 as torch does (to the bit, subnormals included; past the largest
    finite value it saturates where torch would give NaN or infinity); the kernel's attention over
    the bytes is attention over their values."""
    g = torch.Generator().manual_seed(7)
    q, kc, vc, tables, row_seq, row_len = _case(5, 8, 2, 64, 16, torch.float32, 3, g)
    scales = torch.tensor([1e-6, 1e-3, 0.05, 1.0, 30.0])  # subnormal, small, normal, large values
    kc[:-1] *= scales[torch.randint(0, 5, kc[:-1].shape, generator=g)]
    rows_kv = torch.cat([kc[:-1].flatten(0, 1).flatten(1), vc[:-1].flatten(0, 1).flatten(1)], 1)
    rows_kv[0, :4] = torch.tensor([1e6, -1e6, 500.0, -70000.0])
    kc8, vc8 = torch.zeros(kc.shape, dtype=fp8), torch.zeros(vc.shape, dtype=fp8)
    kernels.store_kv(rows_kv[:, :128], rows_kv[:, 128:], kc8, vc8, torch.arange(len(rows_kv)), 64)
    top = torch.finfo(fp8).max
    stored = torch.cat([kc8[:-1].flatten(0, 1).flatten(1), vc8[:-1].flatten(0, 1).flatten(1)], 1)
    assert torch.equal(stored.view(torch.uint8), rows_kv.clamp(-top, top).to(fp8).view(torch.uint8))
    assert stored[0, :4].float().tolist() == [top, -top, min(top, 512.0), -top]
    kc8[-1], vc8[-1] = top, top  # the unused tail's block: huge values, were it ever read
    got = kernels.paged_attention(q, kc8, vc8, tables, row_seq, row_len, None, threads)
    want = reference(q, kc8.float(), vc8.float(), tables, row_seq, row_len, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_is_cached_by_source_and_cpu(tmp_path, monkeypatch):
    """build() compiles once per source, flags and CPU and publishes by a rename. A one-line source
    stands in for the kernels (their build takes seconds; every other test here loads it)."""
    import ctypes

    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "probe.c"
    monkeypatch.setattr(cpu_kernels, "SOURCES", [source])
    monkeypatch.setattr(cpu_kernels, "HEADERS", [])
    source.write_text("int probe(void) { return 7; }\n")
    first = cpu_kernels.build()
    assert first.parent == tmp_path / "cache" / "kernels" and ctypes.CDLL(str(first)).probe() == 7
    assert cpu_kernels.build() == first  # a second use loads the cached object
    assert list(first.parent.iterdir()) == [first]  # no temporary files left behind
    source.write_text("int probe(void) { return 8; }\n")
    changed = cpu_kernels.build()  # another source: its own object
    assert changed != first and ctypes.CDLL(str(changed)).probe() == 8
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: b"flags : another cpu")
    other = cpu_kernels.build()
    assert other not in (first, changed)  # another CPU: its own object too
    # Uses that start together (a first start's processes) wait for one build: one compile.
    compile_once, compiles = cpu_kernels._compile, []

    def slow_compile(*args):
        compiles.append(args)
        time.sleep(0.3)
        compile_once(*args)

    monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
    source.write_text("int probe(void) { return 9; }\n")
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: cpu_kernels.build(), range(3)))
    assert len(set(built)) == 1 and len(compiles) == 1 and ctypes.CDLL(str(built[0])).probe() == 9
    # A source that does not compile: the compiler's words, and nothing left behind.
    source.write_text("int probe(void) {\n")
    with pytest.raises(OSError, match="probe.c"):
        cpu_kernels.build()
    assert set(first.parent.iterdir()) == {first, changed, other, *built}


def test_fused_ops_match_torch_ops():
    g = torch.Generator().manual_seed(1)
    rows, dim = 70, 576  # over PARALLEL_ROWS: the threaded loop
    for n in (rows, 3):
        h, delta, w = (torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g),
                       torch.randn(dim, generator=g))
        h_ref = h.clone()
        want = TorchOps.add_rms_norm(h_ref, delta, w, 1e-5)
        torch.testing.assert_close(kernels.add_rms_norm(h, delta, w, 1e-5), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, h_ref)  # the residual was added in place, the same
        torch.testing.assert_close(kernels.add_rms_norm(h, None, w, 1e-5), want, rtol=1e-5, atol=1e-5)

    # Rotary embedding on q and k inside a fused QKV row (strided), leaving v untouched.
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    ref = qkv.clone()
    angles = torch.randn(rows, d // 2, generator=g) * 10
    cos, sin = angles.cos(), angles.sin()
    for ops, x in ((kernels, qkv), (TorchOps, ref)):
        ops.rope_(x[:, : heads * d], heads, d, cos, sin)
        ops.rope_(x[:, heads * d: (heads + kv_heads) * d], kv_heads, d, cos, sin)
    torch.testing.assert_close(qkv, ref, rtol=1e-6, atol=1e-6)

    # The KV-cache write: rows of k and v (strided, from the QKV output) into scattered slots.
    k, v = qkv[:, heads * d: (heads + kv_heads) * d], qkv[:, (heads + kv_heads) * d:]
    k_cache, v_cache = torch.zeros(200, kv_heads, d), torch.zeros(200, kv_heads, d)
    slots = torch.randperm(200, generator=g)[:rows]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # rounded as torch rounds
        k_cache = torch.zeros(200, kv_heads, d, dtype=dtype)
        v_cache = torch.zeros(200, kv_heads, d, dtype=dtype)
        kernels.store_kv(k, v, k_cache, v_cache, slots, d)
        assert torch.equal(k_cache[slots].view(rows, -1), k.to(dtype))
        assert torch.equal(v_cache[slots].view(rows, -1), v.to(dtype))
        untouched = torch.ones(200, dtype=torch.bool)
        untouched[slots] = False
        assert not k_cache[untouched].any() and not v_cache[untouched].any()

    gate_up = torch.randn(rows, 2 * 48, generator=g) * 4  # (swiglu_oai: past its clamp at 7 too)
    for act in ("silu", "gelu_tanh", "swiglu_oai"):
        torch.testing.assert_close(kernels.act_mul(gate_up, act), TorchOps.act_mul(gate_up.clone(), act),
                                   rtol=2e-6, atol=2e-6)


def _exact_int8(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Weights int8 blocks hold exactly: multiples of 1/128, each block of 32 reaching 127/128."""
    w = torch.randint(-127, 128, shape, generator=g).float()
    w.view(-1, 32)[:, 0] = 127
    return w / 128


def test_moe_with_gpt_oss_biases_and_clamped_swiglu_matches_the_float_reference():
    """csrc/moe.c with a router bias, the experts' gate / up / down biases and gpt-oss's clamped
    SwiGLU, against moe.FloatMoe (transformers' order of operations) on the same weights."""
    from unison.model.families import MoeConfig
    from unison.model.layers.moe import FloatMoe, MoeBiases, QuantMoe
    from unison.model.weights import quant

    g = torch.Generator().manual_seed(5)
    experts, hidden, inter = 8, 64, 64
    cfg = MoeConfig(experts, 2, inter, norm_topk_prob=True)
    router = torch.randn(experts, hidden, generator=g) * 0.3
    gate, up = _exact_int8((experts, inter, hidden), g), _exact_int8((experts, inter, hidden), g)
    down = _exact_int8((experts, hidden, inter), g)
    biases = MoeBiases(torch.randn(experts, generator=g), torch.randn(experts, inter, generator=g),
                       torch.randn(experts, inter, generator=g), torch.randn(experts, hidden, generator=g))
    packed = [quant.stack([quant.quantize(w[e], 8) for e in range(experts)]) for w in (gate, up, down)]
    fast = QuantMoe(cfg, "swiglu_oai", router, *packed, kernels, biases=biases)
    ref = FloatMoe(cfg, "swiglu_oai", router, gate, up, down, biases=biases)
    x = torch.randn(40, hidden, generator=g)
    (top, weight), (ref_top, ref_weight) = fast.route(x), ref.route(x)
    order = ref_top.sort(-1)
    assert torch.equal(top, order.values)
    torch.testing.assert_close(weight, ref_weight.gather(-1, order.indices), rtol=1e-5, atol=1e-6)
    got = fast(x)
    # outputs reach about 300 here: 16-bit activations round within 3e-5 of that
    torch.testing.assert_close(got, ref(x), rtol=0, atol=2e-2)
    plain = FloatMoe(cfg, "swiglu_oai", router, gate, up, down)(x)
    assert (got - plain).abs().max() > 0.5  # the biases count: the test tells them apart
    assert all(torch.equal(fast(x[i: i + 1])[0], got[i]) for i in (0, 17, 39))  # alone = together


def test_ctypes_mirrors_have_the_c_structs_layout(monkeypatch):
    """Checked on every load; a mirror missing a field (or with one the C struct lacks) is named."""
    import ctypes

    lib = cpu_kernels.load().lib
    cpu_kernels.check_struct_layout(lib)

    class Short(ctypes.Structure):
        _fields_ = [("parts", ctypes.c_int64), ("records", ctypes.c_void_p)]

    mirrors = cpu_kernels.struct_mirrors()
    monkeypatch.setattr(cpu_kernels, "struct_mirrors", lambda: {**mirrors, "QLinear": Short})
    with pytest.raises(RuntimeError, match=r"QLinear: C 80, ctypes 16.*QLinear.bias: C 72, ctypes None"):
        cpu_kernels.check_struct_layout(lib)


def _has_bf16_dot() -> bool:
    with open("/proc/cpuinfo") as f:
        return "avx512_bf16" in next((line for line in f if line.startswith("flags")), "").split()


@pytest.mark.skipif(not _has_bf16_dot(), reason="this CPU has no avx512_bf16: towers run torch's attention")
@pytest.mark.parametrize("n,heads,d", [(1, 1, 72), (37, 3, 72), (577, 4, 72), (100, 2, 64), (257, 4, 128),
                                       (50, 2, 17)])
def test_image_attention_is_float32_attention_within_bf16(n, heads, d):
    """Every patch against every patch (no mask), ragged sizes included: within bfloat16's rounding
    of the softmax's weights of torch's float32 attention over the same bfloat16 values."""
    g = torch.Generator().manual_seed(n * heads + d)
    q, k, v = (torch.randn(n, heads, d, generator=g).bfloat16().float() * 2 for _ in range(3))
    scale = d ** -0.5
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          scale=scale).transpose(0, 1)
    got = kernels.image_attention(q, k, v, scale)
    assert got is not None, "built for this CPU, the kernel must run"
    assert got.shape == want.shape and (got - want).abs().max() < 0.03 * want.abs().max()
    assert kernels.image_attention(*(torch.zeros(2, 1, 130) for _ in range(3)), 1.0) is None  # d > 128
