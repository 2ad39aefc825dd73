import os
import subprocess
import sys
import textwrap

import pytest
import torch

from wicore.engines import tensor_codec as codec
from wicore.engines.kvcache.block_hashes import block_hashes
from wicore.engines.kvcache.disk_tier import TEMP_PREFIX, DiskTier
from wicore.errors import ConfigError

KEYS = block_hashes(list(range(16 * 8)), 16, model_id="m")


def tensor(i):
    return torch.full((4, 16), float(i), dtype=torch.bfloat16)


def entry_size():
    return len(codec.encode(tensor(0), meta={"key": KEYS[0].hex()}))


def temp_files(root):
    return [p for p in root.rglob(f"{TEMP_PREFIX}*")]


def test_round_trip_survives_reopen(tmp_path):
    with DiskTier(tmp_path, 10**6) as tier:
        assert tier.put(KEYS[0], tensor(1))
        assert torch.equal(tier.get(KEYS[0]), tensor(1))
    with DiskTier(tmp_path, 10**6) as tier:
        assert len(tier) == 1 and torch.equal(tier.get(KEYS[0]), tensor(1))
        assert tier.get(KEYS[1]) is None
        assert (tier.stats.hits, tier.stats.misses) == (1, 1)


def test_threads_reading_and_writing_keep_the_index_the_files_and_the_cap(tmp_path):
    """Files are read and written outside the tier's lock (AsyncDiskTier's reader threads beside
    its writer): four threads putting and getting 8 keys' worth of blocks over a cap of 5, with
    evictions all along, never get another key's tensor, and the index ends equal to the folder."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    cap = 5 * entry_size()
    tier = DiskTier(tmp_path, cap)

    def work(seed):
        rng, seen = random.Random(seed), 0
        for _ in range(400):
            i = rng.randrange(8)
            if rng.random() < 0.5:
                tier.put(KEYS[i], tensor(i))
            elif (got := tier.get(KEYS[i])) is not None:
                assert torch.equal(got, tensor(i))
                seen += 1
        return seen

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(work, range(4))) > 0
    files = list(tmp_path.rglob("*.blk"))
    assert tier.total_bytes == sum(f.stat().st_size for f in files) <= cap
    assert len(tier) == len(files) and tier.stats.corrupt == 0 and not temp_files(tmp_path)
    tier.close()
    with DiskTier(tmp_path, cap, verify_on_open=True) as again:
        assert len(again) == len(files) and again.stats.corrupt == 0


def test_cap_is_enforced_by_policy(tmp_path):
    cap = 3 * entry_size()
    with DiskTier(tmp_path, cap) as tier:
        for i in range(3):
            tier.put(KEYS[i], tensor(i))
        tier.get(KEYS[0])  # recent: KEYS[1] goes first
        tier.put(KEYS[3], tensor(3))
        assert tier.total_bytes <= cap and len(tier) == 3
        assert KEYS[1] not in tier and not tier.path(KEYS[1]).exists()
        assert tier.stats.evictions == 1
        assert not tier.put(KEYS[4], torch.zeros(1000))  # bigger than the cap: refused
    with DiskTier(tmp_path, entry_size()) as tier:  # a smaller cap on reopen
        assert len(tier) == 1 and tier.total_bytes <= entry_size()


def test_crash_mid_write_leaves_no_entry(tmp_path):
    """A real process dies after writing its temp file and before the rename."""
    script = textwrap.dedent(f"""
        import os, torch
        from wicore.engines.kvcache.disk_tier import DiskTier
        tier = DiskTier({str(tmp_path)!r}, 10**6)
        tier.put(bytes.fromhex({KEYS[0].hex()!r}), torch.ones(4, 16))
        os.fsync = lambda fd: os._exit(3)
        tier.put(bytes.fromhex({KEYS[1].hex()!r}), torch.ones(4, 16))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert len(temp_files(tmp_path)) == 1
    with DiskTier(tmp_path, 10**6) as tier:  # the dead process' lock is gone
        assert temp_files(tmp_path) == []
        assert KEYS[1] not in tier and tier.get(KEYS[1]) is None
        assert torch.equal(tier.get(KEYS[0]), torch.ones(4, 16))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_file_is_a_miss(tmp_path, damage):
    with DiskTier(tmp_path, 10**6) as tier:
        tier.put(KEYS[0], tensor(1))
        tier.put(KEYS[1], tensor(2))
        path = tier.path(KEYS[0])
        blob = bytearray(path.read_bytes())
        if damage == "truncate":
            blob = blob[: len(blob) // 2]
        elif damage == "flip":
            blob[-3] ^= 0x10
        else:
            blob = bytearray()
        path.write_bytes(blob)
        assert tier.get(KEYS[0]) is None
        assert tier.stats.corrupt == 1 and not path.exists() and KEYS[0] not in tier
        assert tier.total_bytes == tier.path(KEYS[1]).stat().st_size
        assert torch.equal(tier.get(KEYS[1]), tensor(2))


def test_a_file_under_another_name_is_a_miss(tmp_path):
    with DiskTier(tmp_path, 10**6) as tier:
        tier.put(KEYS[0], tensor(1))
        target = tier.path(KEYS[1])
        target.parent.mkdir(exist_ok=True)
        os.replace(tier.path(KEYS[0]), target)
    with DiskTier(tmp_path, 10**6) as tier:
        assert KEYS[1] in tier and tier.get(KEYS[1]) is None and tier.stats.corrupt == 1


def test_verify_on_open_drops_damaged_files(tmp_path):
    with DiskTier(tmp_path, 10**6) as tier:
        tier.put(KEYS[0], tensor(1))
        tier.put(KEYS[1], tensor(2))
        tier.path(KEYS[0]).write_bytes(b"WCT1garbage")
    with DiskTier(tmp_path, 10**6, verify_on_open=True) as tier:
        assert KEYS[0] not in tier and KEYS[1] in tier and tier.stats.corrupt == 1


def test_one_process_per_folder(tmp_path):
    with DiskTier(tmp_path, 10**6), pytest.raises(ConfigError):
        DiskTier(tmp_path, 10**6)
