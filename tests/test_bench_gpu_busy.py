"""The GPU busy fraction of the caption and cache benchmarks: the window arithmetic over NVML's samples (any
machine), and NVML itself on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from wicore.bench.gpu_busy import GpuBusySampler, Sample, busy_fraction, busy_profile


def test_each_sample_covers_the_time_since_the_one_before_weighted_by_its_overlap():
    samples = [Sample(0, 0.0), Sample(100, 100.0), Sample(200, 50.0), Sample(300, 0.0)]
    assert busy_fraction(samples, 0, 300) == pytest.approx(0.5)  # (100 + 50 + 0) / 300
    assert busy_fraction(samples, 0, 200) == pytest.approx(0.75)
    assert busy_fraction(samples, 50, 150) == pytest.approx(0.75), "half of (0, 100] at 100%, half of (100, 200] at 50%"
    assert busy_fraction(list(reversed(samples)), 100, 200) == pytest.approx(0.5), "order does not matter"


def test_the_cache_bench_reports_each_runs_share_and_its_median_runs():
    from wicore.bench.cache_bench import add_busy

    sampler = GpuBusySampler(None)
    sampler.samples = [Sample(0, 0.0), Sample(1_000_000, 100.0), Sample(2_000_000, 50.0), Sample(3_000_000, 90.0)]
    run = {"seconds_runs": [1.3, 0.9, 1.1], "windows": [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]}
    add_busy(run, sampler)
    assert run["gpu_busy_fraction_runs"] == [1.0, 0.5, 0.9] and "windows" not in run
    assert run["gpu_busy_fraction"] == pytest.approx(0.9), "the run of the median time (1.1 s) is the third"
    idle = add_busy({"seconds_runs": [1.0], "windows": [(5.0, 6.0)]}, sampler)
    assert idle["gpu_busy_fraction"] is None and idle["gpu_busy_fraction_runs"] == [None]


def test_no_sample_inside_the_window_is_no_figure():
    samples = [Sample(0, 10.0), Sample(100, 90.0)]
    assert busy_fraction(samples, 200, 300) is None
    assert busy_fraction([Sample(150, 100.0)], 100, 200) is None, "one sample has no period"
    assert busy_fraction([], 0, 1) is None


def test_the_profile_gives_each_slice_of_the_window_its_own_share():
    samples = [Sample(0, 0.0), Sample(100, 100.0), Sample(200, 50.0), Sample(300, 0.0)]
    assert busy_profile(samples, 0, 300, slice_us=100) == pytest.approx([1.0, 0.5, 0.0])
    assert busy_profile(samples, 50, 300, slice_us=200) == pytest.approx([(50 + 50) / 200, 0.0]), "last slice shorter"
    assert busy_profile(samples, 300, 400, slice_us=100) == [None], "a slice no sample covers has no figure"


def test_without_a_gpu_the_sampler_gives_none_and_says_why():
    with GpuBusySampler(None) as busy:
        pass
    assert busy.fraction(0.0, time.time()) is None and busy.error.startswith("no GPU")
    assert busy.profile(0.0, time.time()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvml_sees_a_busy_gpu_busy_and_an_idle_one_idle():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with GpuBusySampler(torch.cuda.current_device(), every_s=0.5) as busy:
        time.sleep(2.0)
        idle = (time.time() - 1.5, time.time())
        start = time.time()
        while time.time() - start < 3.0:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
        loaded = (start + 0.5, time.time())
        time.sleep(0.5)
    assert busy.error is None and len(busy.samples) > 10
    assert busy.fraction(*loaded) > 0.9 and busy.fraction(*idle) < 0.1
