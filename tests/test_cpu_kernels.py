"""The C decode-attention kernel against a plain PyTorch reference, shape by shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unison.model import cpu_kernels
from unison.model.llama import TorchOps

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the runner uses torch's path")


def reference(q, k_cache, v_cache, tables, lens, window):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        k = k_cache[tables[i]].flatten(0, 1)[:n]  # [n, kv_heads, d], in position order
        v = v_cache[tables[i]].flatten(0, 1)[:n]
        if window:
            k, v = k[-window:], v[-window:]
        k = k.transpose(0, 1).repeat_interleave(group, 0)
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(q[i][:, None], k, v)[:, 0]
    return out


@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window", [
    (64, 9, 3, 64, 16, None),  # SmolLM2-135M's shapes, one task per sequence
    (1, 9, 3, 64, 16, None),  # a single decode: split by kv head across threads
    (3, 8, 8, 128, 4, None),  # no GQA, the other unrolled head_dim
    (5, 4, 2, 32, 16, 7),  # a head_dim without its own copy; sliding window
    (2, 6, 1, 16, 1, 3),  # multi-query; one-token blocks
])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference(seqs, heads, kv_heads, head_dim, block_size, window, threads):
    g = torch.Generator().manual_seed(seqs * heads + head_dim)
    lens = torch.randint(1, 300, (seqs,), generator=g)
    lens[0] = 1  # the shortest context there is
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = seqs * width + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    # Scattered blocks. The tail of each table is padding that the kernel must never read: it
    # points at a block of NaNs, which would poison the output.
    tables = torch.randperm(num_blocks - 1, generator=g)[: seqs * width].view(seqs, width).contiguous()
    k_cache[-1], v_cache[-1] = float("nan"), float("nan")
    for i, n in enumerate(lens.tolist()):
        tables[i, (n + block_size - 1) // block_size:] = num_blocks - 1
    q = torch.randn(seqs, heads, head_dim, generator=g)
    got = kernels.decode_attention(q, k_cache, v_cache, tables, lens, window, threads)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, window),
                               rtol=1e-5, atol=1e-5)


def test_kernel_is_cached_by_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    assert cpu_kernels.build() == first  # a second use loads the cached object
    assert list(first.parent.iterdir()) == [first]  # no temporary files left behind


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
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots].view(rows, -1), k) and torch.equal(v_cache[slots].view(rows, -1), v)
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
