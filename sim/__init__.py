"""Discrete-event simulator: the real `scheduler/` policies driven by a simulated clock on a
calibrated cost model, at scales beyond one machine. Imports no torch and no
engine; it emits the engine's lifecycle events and iteration records.
"""

from __future__ import annotations

from scheduler.calibrate import (
    Calibration,
    calibrate,
    fit,
    load_calibration,
    load_records,
    save_calibration,
)
from scheduler.cost_model import (
    GEOMETRIES,
    KERNELS,
    CostModel,
    CostParams,
    KernelKind,
    ModelGeometry,
    get_geometry,
)
from scheduler.hardware import HARDWARE, Hardware, get_hardware
from sim.cluster import ClusterConfig, cluster_for
from sim.run import SimResult, simulate

__all__ = [
    "GEOMETRIES",
    "HARDWARE",
    "KERNELS",
    "ClusterConfig",
    "CostModel",
    "CostParams",
    "Hardware",
    "KernelKind",
    "ModelGeometry",
    "SimResult",
    "Calibration",
    "calibrate",
    "cluster_for",
    "get_geometry",
    "get_hardware",
    "fit",
    "load_calibration",
    "load_records",
    "save_calibration",
    "simulate",
]
