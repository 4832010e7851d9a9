"""MSTopK, fused LARS and Adam: a torch reference, a fast CPU path and a Triton path for CUDA; convolutions on
tiny maps as GEMMs and max pooling through the channels-last kernel for the CPU (small_conv, max_pool).

Imports nothing from the rest of the repository (trainer, data, recipes import this package).
"""

from kernels.adam import build_adam
from kernels.lars import FusedLARS
from kernels.max_pool import use_channels_last_max_pool
from kernels.mstopk import mstopk, mstopk_device_ops, mstopk_reference, mstopk_warm_up
from kernels.small_conv import use_direct_convs, use_gemm_for_small_maps

__all__ = ["FusedLARS", "build_adam", "mstopk", "mstopk_device_ops", "mstopk_reference", "mstopk_warm_up",
           "use_channels_last_max_pool", "use_direct_convs", "use_gemm_for_small_maps"]
