"""vLLM's import path ``vllm.v1.watermarking``: re-exports of ``pagedllm.watermarking``."""

from pagedllm.config import WatermarkConfig
from pagedllm.watermarking import (GumbelWatermarkDetector, GumbelWatermarker, PhiloxPRF, WatermarkDetection,
                                   create_prf)

__all__ = ["GumbelWatermarkDetector", "GumbelWatermarker", "PhiloxPRF", "WatermarkConfig", "WatermarkDetection",
           "create_prf"]
