import hashlib
import os
import struct
import subprocess
import sys

import pytest
import torch

from wicore.engines.kvcache.block_hashes import BlockSegment, ImageSpan, block_hashes, hash_block, root_hash

IMG_A = hashlib.sha256(b"image a").hexdigest()
IMG_B = hashlib.sha256(b"image b").hexdigest()
PLACEHOLDER = 262144


def prompt_with_image(n_before=20, n_image=16, n_after=30):
    """Token ids with an image's placeholders at [n_before, n_before + n_image)."""
    ids = list(range(1, n_before + 1)) + [PLACEHOLDER] * n_image + list(range(500, 500 + n_after))
    return ids, (n_before, n_before + n_image)


def test_fixed_value_for_fixed_input():
    hashes = block_hashes(list(range(32)), 16, model_id="gemma-3-4b-it")
    assert hashes[1].hex() == "13d3e0262c0e9ca755c97927a55ab174b6e414edce8f0a245baf9ed047722a9f"


def test_encoding_is_the_documented_one():
    root = hashlib.sha256(b"wicore-kv-v1\0m").digest()
    tokens = [7, 8, 9, 10]
    expected = hashlib.sha256(root + b"B" + struct.pack("<5I", 4, *tokens) + struct.pack("<I", 0)).digest()
    assert root_hash("m") == root
    assert block_hashes(tokens, 4, model_id="m") == [expected]


def test_fixed_value_with_images_equals_the_chain_of_hash_block():
    ids = list(range(1, 11)) + [PLACEHOLDER] * 20 + [7, 8] + [PLACEHOLDER] * 6 + list(range(500, 530))
    spans = [(10, 30, IMG_A), (32, 38, IMG_B)]  # the first spans three 8-token blocks
    hashes = block_hashes(ids, 8, spans, model_id="m")
    assert hashes[-1].hex() == "1d0cf0b6d6d78a010c95f6e9728c022e2e78b87f126f6e6cc5b0db80b54b3bc9"
    parent, chain = root_hash("m"), []
    for start in range(0, 64, 8):
        segments = [
            BlockSegment(max(s, start) - start, min(e, start + 8) - start, d, max(s, start) - s)
            for s, e, d in spans
            if max(s, start) < min(e, start + 8)
        ]
        parent = hash_block(parent, ids[start : start + 8], segments)
        chain.append(parent)
    assert hashes == chain


def test_stable_across_processes():
    code = "from wicore.engines.kvcache.block_hashes import block_hashes; print(block_hashes(list(range(64)), 16, model_id='x')[-1].hex())"
    env = os.environ | {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == block_hashes(list(range(64)), 16, model_id="x")[-1].hex()


def test_only_full_blocks():
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


def test_chaining_a_change_propagates_forward_only():
    base = list(range(64))
    edited = base.copy()
    edited[40] = 9999  # in block 2
    a, b = block_hashes(base, 16), block_hashes(edited, 16)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_same_block_after_different_prefix_differs():
    a = block_hashes([1] * 16 + [5] * 16, 16)
    b = block_hashes([2] * 16 + [5] * 16, 16)
    assert a[1] != b[1]


def test_image_salt_changes_hashes_from_the_image_block_on():
    ids, (start, end) = prompt_with_image()  # image in blocks 1 and 2 (block size 16)
    plain = block_hashes(ids, 16, model_id="m")
    with_a = block_hashes(ids, 16, [(start, end, IMG_A)], model_id="m")
    with_b = block_hashes(ids, 16, [ImageSpan(start, end, IMG_B)], model_id="m")
    assert plain[0] == with_a[0] == with_b[0]
    for i in range(1, len(plain)):
        assert len({plain[i], with_a[i], with_b[i]}) == 3


def test_same_image_same_prefix_shares_blocks():
    ids, (start, end) = prompt_with_image()
    other_tail = ids[:48] + [42] * 18
    a = block_hashes(ids, 16, [(start, end, IMG_A)], model_id="m")
    b = block_hashes(other_tail, 16, [(start, end, IMG_A)], model_id="m")
    assert a[:3] == b[:3]
    assert a[3] != b[3]


def test_model_id_salts_every_block():
    a, b = block_hashes(list(range(32)), 16, model_id="m1"), block_hashes(list(range(32)), 16, model_id="m2")
    assert a[0] != b[0] and a[1] != b[1]


def test_parent_continues_a_chain():
    ids = list(range(64))
    first = block_hashes(ids[:32], 16, model_id="m")
    rest = block_hashes(ids[32:], 16, parent=first[-1])
    assert first + rest == block_hashes(ids, 16, model_id="m")
    assert rest[-1] == hash_block(rest[0], ids[48:64])


def test_accepts_a_tensor():
    assert block_hashes(torch.arange(32), 16) == block_hashes(list(range(32)), 16)


@pytest.mark.parametrize(
    "spans",
    [[(5, 40, IMG_A)], [(0, 10, IMG_A), (5, 12, IMG_B)], [(3, 3, IMG_A)], [(0, 4, "not-a-hash")]],
)
def test_bad_spans_raise(spans):
    with pytest.raises(ValueError):
        block_hashes(list(range(32)), 16, spans)


def test_bad_tokens_and_block_size_raise():
    with pytest.raises(ValueError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(ValueError):
        block_hashes(list(range(16)), 0)
