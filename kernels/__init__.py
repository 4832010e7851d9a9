"""MSTopK, fused LARS and Adam: a torch reference, a fast CPU path and a Triton path for CUDA; convolutions on
tiny maps as GEMMs for the CPU (small_conv).

Imports nothing from the rest of the repository (trainer, data, recipes import this package).
"""

from kernels.adam import build_adam
from kernels.lars import FusedLARS
from kernels.mstopk import mstopk, mstopk_device_ops, mstopk_reference, mstopk_warm_up
from kernels.small_conv import use_direct_convs, use_gemm_for_small_maps

__all__ = ["FusedLARS", "build_adam", "mstopk", "mstopk_device_ops", "mstopk_reference", "mstopk_warm_up",
           "use_direct_convs", "use_gemm_for_small_maps"]
