"""The device's busy fraction over a timed window, read from outside the process under test.

NVML keeps a ring of GPU-utilization samples (`NVML_GPU_UTILIZATION_SAMPLES`: "percent of time
over the sample period during which one or more kernels was executing on the GPU"), about six a
second and the last ~16 s of them. `GpuBusySampler` drains that ring from a thread of the
benchmark's own process every second, and `busy_fraction` weights each sample by how much of its
period lies inside the window. The process being measured records nothing: no events, no CUPTI,
no extra GIL holder, so the figure is that of the product as it runs, over the whole window.

NVML is reached through ctypes on the driver's own libnvidia-ml.so.1 (as torch.cuda does for
device counts): no Python package needed. Without it (no NVIDIA driver, a CPU run) the
fraction is None.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t
NVML_SUCCESS, NVML_ERROR_NOT_FOUND = 0, 6
# nvmlValueType_t -> the union member that holds it
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


@dataclass(frozen=True)
class Sample:
    at_us: int  # end of the sample's period, microseconds since the epoch (NVML's clock: time.time)
    percent: float  # of that period during which a kernel ran


def busy_fraction(samples: list[Sample], start_us: int, end_us: int) -> float | None:
    """The share of [start_us, end_us] during which a kernel ran: each sample covers the time
    since the one before it, weighted by its overlap with the window. None without a sample
    that covers part of the window."""
    ordered = sorted(samples, key=lambda s: s.at_us)
    busy = covered = 0.0
    for before, sample in zip(ordered, ordered[1:], strict=False):
        overlap = min(sample.at_us, end_us) - max(before.at_us, start_us)
        if overlap > 0:
            busy += overlap * sample.percent / 100.0
            covered += overlap
    return busy / covered if covered > 0 else None


def busy_profile(samples: list[Sample], start_us: int, end_us: int, slice_us: int = 1_000_000) -> list[float | None]:
    """`busy_fraction` of each consecutive slice of [start_us, end_us] (the last one shorter):
    where in the window the device idled, e.g. while the pipeline fills or drains."""
    edges = list(range(start_us, end_us, slice_us)) + [end_us]
    return [busy_fraction(samples, a, b) for a, b in zip(edges, edges[1:], strict=False)]


class _Value(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class _Sample(ctypes.Structure):  # nvmlSample_t
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", _Value)]


class Nvml:
    """The two NVML calls this needs, on one device (NVML's index: PCI order, GPU 0 on a machine
    of one). Raises OSError when the library or the device is not there."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)), "handle")

    def samples_since(self, last_us: int) -> list[Sample]:
        """Utilization samples newer than `last_us` (all NVML still holds for 0)."""
        value_type, count = ctypes.c_int(), ctypes.c_uint(0)
        args = (self.handle, ctypes.c_int(GPU_UTILIZATION_SAMPLES), ctypes.c_ulonglong(last_us))
        status = self.lib.nvmlDeviceGetSamples(*args, ctypes.byref(value_type), ctypes.byref(count), None)
        if status == NVML_ERROR_NOT_FOUND or (status == NVML_SUCCESS and not count.value):
            return []
        self._check(status, "nvmlDeviceGetSamples (count)")
        buffer = (_Sample * count.value)()
        status = self.lib.nvmlDeviceGetSamples(*args, ctypes.byref(value_type), ctypes.byref(count), buffer)
        if status == NVML_ERROR_NOT_FOUND:
            return []
        self._check(status, "nvmlDeviceGetSamples")
        field = _VALUE_FIELDS.get(value_type.value, "uiVal")
        return [Sample(int(s.timeStamp), float(getattr(s.sampleValue, field))) for s in buffer[: count.value]]

    def close(self) -> None:
        self.lib.nvmlShutdown()

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != NVML_SUCCESS:
            raise OSError(f"NVML {call} returned {status}")


class GpuBusySampler:
    """Collects NVML's utilization samples of one GPU while it runs (`with` block), from a
    thread polling every `every_s` seconds: well inside the ~16 s NVML keeps. `fraction(start,
    end)` is the busy share of a window inside that time; None where NVML is not available, or
    with `index` None (no GPU to watch)."""

    def __init__(self, index: int | None = 0, every_s: float = 1.0):
        self.index, self.every_s = index, every_s
        self.samples: list[Sample] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Nvml | None = None

    def __enter__(self) -> GpuBusySampler:
        if self.index is None:
            self.error = "no GPU: the run is not on a CUDA device"
            return self
        try:
            self._nvml = Nvml(self.index)
        except (OSError, AttributeError) as error:  # no library; a library without the call
            self.error = f"NVML unavailable: {error}"
            return self
        self._thread = threading.Thread(target=self._run, name="wicore-gpu-busy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.close()

    def fraction(self, start_s: float, end_s: float) -> float | None:
        """Busy share of [start_s, end_s] (time.time() seconds)."""
        return busy_fraction(self.samples, int(start_s * 1e6), int(end_s * 1e6)) if self.samples else None

    def profile(self, start_s: float, end_s: float) -> list[float | None]:
        """Busy share of each second of [start_s, end_s] (`busy_profile`); [] without samples."""
        return busy_profile(self.samples, int(start_s * 1e6), int(end_s * 1e6)) if self.samples else []

    def _run(self) -> None:
        while True:
            self._poll()
            if self._stop.wait(self.every_s):
                self._poll()  # the last samples, up to the end of the window
                return

    def _poll(self) -> None:
        last = self.samples[-1].at_us if self.samples else 0
        try:
            fresh = self._nvml.samples_since(last)
        except OSError as error:
            self.error = str(error)
            return
        self.samples += sorted((s for s in fresh if s.at_us > last), key=lambda s: s.at_us)
