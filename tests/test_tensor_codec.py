import pickle

import pytest
import torch

from wicore.engines import tensor_codec as codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_round_trip_is_exact(dtype):
    tensor = (torch.randn(3, 5) * 10).to(dtype)
    decoded = codec.decode(codec.encode(tensor, meta={"key": "ab"}))
    assert decoded.tensor.dtype == dtype and torch.equal(decoded.tensor, tensor)
    assert decoded.meta == {"key": "ab"}


def test_non_contiguous_and_empty():
    tensor = torch.randn(4, 6)[:, ::2]
    assert torch.equal(codec.decode(codec.encode(tensor)).tensor, tensor)
    assert codec.decode(codec.encode(torch.zeros(0, 3))).tensor.shape == (0, 3)


def test_decoded_tensor_is_writable_and_private():
    blob = codec.encode(torch.zeros(4))
    decoded = codec.decode(blob).tensor
    decoded += 1
    assert torch.equal(codec.decode(blob).tensor, torch.zeros(4))


def test_damage_is_detected():
    blob = bytearray(codec.encode(torch.randn(8)))
    for damaged in (blob[:-1], blob[:10], b"", blob[:40] + bytes([blob[40] ^ 1]) + blob[41:]):
        with pytest.raises(codec.CorruptBlob):
            codec.decode(bytes(damaged))


def test_pickle_is_refused_not_run():
    with pytest.raises(codec.CorruptBlob):
        codec.decode(pickle.dumps(torch.zeros(2)))
