"""The prefix cache's disk tier (kv_cache_dir): blocks evicted from RAM come back from files, in
this run and the next; bad files are removed, never served; the disk stays within its size; KV
events name the medium.

An in-process EngineCore with a pool of 20 blocks, so a second long prompt evicts the first;
the last test runs the real processes through the Engine API, across a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from unison import Engine
from unison.config import EngineConfig
from unison.core.engine_core import EngineCore
from unison.core.kv import disk_cache
from unison.core.kv.disk_cache import MAGIC
from unison.deploy.kv_index import KVIndex
from unison.model.weights.loader import resolve_model_dir
from unison.wire.kv_events import DISK, MEDIUM, BlockRemoved, BlockStored, block_hashes
from unison.wire.messages import CoreSamplingParams, Generate

BS = 16
PROMPT_BLOCKS = 12  # a prompt of 12 blocks and 5 tokens: two such do not fit in the pool together


def prompts(n: int) -> list[list[int]]:
    return [[(i * 7919 + j * 104729) % 40000 + 100 for j in range(PROMPT_BLOCKS * BS + 5)] for i in range(n)]


@contextmanager
def core_at(tmp: Path, **kw) -> Iterator[EngineCore]:
    """A core with its disk tier in `tmp` (closed at the end: its writes finish)."""
    config = EngineConfig(num_threads=1, max_total_tokens=20 * BS, kv_cache_dir=str(tmp), **kw)
    core = EngineCore(config, str(resolve_model_dir(None)))
    try:
        yield core
    finally:
        core.close()


def settle(core: EngineCore) -> None:
    """The queued files written, and indexed."""
    core.disk.writer.drain()
    core.disk.poll()


_rids = iter(range(10**9))


def run(core: EngineCore, tokens: list[int], max_new: int = 6) -> tuple[list[int], int]:
    """Greedy output ids and the cached tokens of one request run alone."""
    rid = f"r{next(_rids)}"
    core.add(b"fe", Generate(rid, tokens, CoreSamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                                              temperature=0.0)))
    ids, cached = [], -1
    while core.has_work:
        for out in core.step().get(b"fe", []):
            ids += out.token_ids
            cached = max(cached, out.cached_tokens)
    core.check_integrity()
    return ids, cached


def files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("*/*.kv"))


def test_evicted_blocks_come_back_from_disk_in_this_run_and_the_next(tmp_path):
    a, b = prompts(2)
    with core_at(tmp_path) as core:
        cold, cached = run(core, a)
        assert cached == 0
        run(core, b)  # evicts a's blocks from RAM
        core.disk.writer.drain()
        assert len(files(tmp_path)) == 2 * PROMPT_BLOCKS
        assert core.scheduler.kv.cache.match_len(a) < PROMPT_BLOCKS * BS, "a should have left RAM"
        from_disk, cached = run(core, a)
        assert cached == PROMPT_BLOCKS * BS and core.disk.num_loaded == PROMPT_BLOCKS
        assert from_disk == cold
        ram, cached = run(core, a)  # now a RAM hit: the same bytes, so the same tokens
        assert cached == PROMPT_BLOCKS * BS and ram == from_disk
    with core_at(tmp_path) as core:  # a restart: nothing in RAM, everything on disk
        assert len(core.disk.index) == 2 * PROMPT_BLOCKS
        again, cached = run(core, a)
        assert cached == PROMPT_BLOCKS * BS and again == from_disk


def test_a_prompt_of_whole_blocks_computes_one_token_after_a_restart(tmp_path):
    """Its last block is on disk too: read back, its head is copied (prefix cache), so only the
    prompt's last token is computed, as from RAM."""
    whole = prompts(3)[2][: PROMPT_BLOCKS * BS]
    with core_at(tmp_path) as core:
        cold, _ = run(core, whole)
    with core_at(tmp_path) as core:
        again, cached = run(core, whole)
        assert cached == len(whole) - 1 and again == cold


def test_bad_and_foreign_files_are_removed_never_served(tmp_path):
    a, b = prompts(2)
    with core_at(tmp_path) as core:
        cold, _ = run(core, a)
    mine = files(tmp_path)
    folder = mine[0].parent
    hashes = block_hashes(a, BS)
    # The 4th block's payload flipped (its checksum then fails), a stranger and a half-write.
    fourth = folder / f"{hashes[3]:016x}.kv"
    data = bytearray(fourth.read_bytes())
    data[-1] ^= 0xFF
    fourth.write_bytes(bytes(data))
    (folder / "0123456789abcdef.kv").write_bytes(MAGIC + b"\x05\x00\x00\x00junk!")
    (folder / "notes.txt").write_text("not a block")
    (folder / f".{hashes[5]:016x}.123.tmp").write_bytes(b"half")
    # Another model's block (another fingerprint) under this model's name for block 6.
    sixth = folder / f"{hashes[6]:016x}.kv"
    with sixth.open("rb") as f:
        header = disk_cache._decode(f)
        payload = f.read()
    header.fingerprint = bytes(16)
    sixth.write_bytes(disk_cache._encode(header) + payload)
    with core_at(tmp_path) as core:
        assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".kv")) == []
        assert not (folder / "0123456789abcdef.kv").exists() and not sixth.exists()
        got, cached = run(core, a)
        assert cached == 3 * BS, "served up to the bad 4th block, no further"
        assert core.disk.num_bad == 1 and got == cold
        core.disk.writer.drain()  # the recomputed block is written afresh
        assert fourth.read_bytes() != bytes(data)


def test_the_disk_keeps_its_size_dropping_the_least_recently_used(tmp_path):
    a, b = prompts(2)
    with core_at(tmp_path) as core:
        run(core, a)
        settle(core)
        per_file = core.disk.used // PROMPT_BLOCKS  # headers differ by a few bytes: half a file spare
        core.disk.capacity = 14 * per_file + per_file // 2  # b's 12 push out 10 of a's, oldest first
        run(core, b)
        settle(core)
        assert core.disk.used <= core.disk.capacity
        kept = {int(p.stem, 16) for p in files(tmp_path)}
        assert set(block_hashes(b, BS)) <= kept
        assert kept & set(block_hashes(a, BS)) == set(block_hashes(a, BS)[10:])


def test_kv_events_name_the_medium_and_a_restart_announces_the_files(tmp_path):
    a, b = prompts(2)
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"}
    with core_at(tmp_path, kv_events_config=events) as core:
        run(core, a)
        run(core, b)
        settle(core)
        log = core.kv_events.take()
        index = KVIndex()
        index.apply(0, log)
        on_disk = [h for e in log if isinstance(e, BlockStored) and e.medium == DISK for h in e.block_hashes]
        assert sorted(on_disk) == sorted(block_hashes(a, BS) + block_hashes(b, BS))
        assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM for e in log), "a left RAM"
        assert set(block_hashes(a, BS)) <= index.blocks[0], "still on disk: still held"
    with core_at(tmp_path, kv_events_config=events) as core:
        log = core.kv_events.take()
        assert type(log[0]).__name__ == "AllBlocksCleared"
        stored = [e for e in log[1:] if isinstance(e, BlockStored)]
        assert {h for e in stored for h in e.block_hashes} == set(block_hashes(a, BS) + block_hashes(b, BS))
        seen: set[int | None] = {None}
        for e in stored:  # parents first: a subscriber can check each chain
            assert e.parent_block_hash in seen and e.medium == DISK
            seen.update(e.block_hashes)


def test_flush_removes_the_files_and_a_weight_update_stops_the_tier(tmp_path):
    a, _ = prompts(2)
    with core_at(tmp_path) as core:
        run(core, a)
        core.disk.writer.drain()
        core.flush_cache()
        assert files(tmp_path) == [] and not core.disk.index
        run(core, a)
        settle(core)
        assert len(core.disk.index) == PROMPT_BLOCKS
        core.disk.retire()  # what update_tensors does: no file holds the weights then
        core.flush_cache()
        _, cached = run(core, a)
        assert cached == 0 and len(files(tmp_path)) == PROMPT_BLOCKS, "files stay for the next run"


def test_bad_options_name_their_field(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir=str(tmp_path), disable_radix_cache=True)
    with pytest.raises(ValueError, match="kv_cache_disk_gb"):
        EngineConfig(kv_cache_dir=str(tmp_path), kv_cache_disk_gb=0)


def test_the_engine_serves_a_prefix_from_disk_after_a_restart(tmp_path):
    kw = {"num_threads": 1, "kv_cache_dir": str(tmp_path)}
    with Engine(**kw) as engine:
        prompt = engine.tokenizer.encode(" ".join(["The tides follow the moon."] * 60))
        params = {"temperature": 0, "max_new_tokens": 8}
        first = engine.generate(input_ids=prompt, sampling_params=params)
    assert len(files(tmp_path)) == len(prompt) // BS, "shutdown finishes the queued writes"
    with Engine(**kw) as engine:
        again = engine.generate(input_ids=prompt, sampling_params=params)
    whole = len(prompt) // BS * BS  # the blocks on disk; a last one the prompt ends with is copied
    assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1 if whole == len(prompt) else whole)
    assert again["output_ids"] == first["output_ids"]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
