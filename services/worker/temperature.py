"""GPU temperature for the heartbeat: a file override (tests, simulations) or NVML.

Returns None where neither exists (a CPU-only worker), which routers treat as cool.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


class TemperatureSource:
    def __init__(self, override_file: str = "", device_index: int = 0) -> None:
        self._file = Path(override_file) if override_file else None
        # Set by a simulated worker's fault knobs; wins over the file and NVML.
        self.override: float | None = None
        self._device_index = device_index
        self._nvml_handle = None
        self._nvml_tried = False

    def _from_nvml(self) -> float | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml  # from nvidia-ml-py; only present on GPU images

                pynvml.nvmlInit()
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(self._device_index)
            except Exception:  # no driver, no GPU or no package: this worker has no GPU reading
                self._nvml_handle = None
        if self._nvml_handle is None:
            return None
        import pynvml

        return float(pynvml.nvmlDeviceGetTemperature(self._nvml_handle, pynvml.NVML_TEMPERATURE_GPU))

    def read(self) -> float | None:
        if self.override is not None:
            return self.override
        if self._file is not None:
            try:
                return float(self._file.read_text().strip())
            except (OSError, ValueError):
                # A missing or half-written file must not take the worker down.
                return None
        return self._from_nvml()
