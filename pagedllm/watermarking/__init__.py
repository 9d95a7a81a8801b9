"""Text watermarking (vLLM's ``watermark_config``): the Philox PRF (``philox.py``), Gumbel-max
sampling (``gumbel.py``), the worker's choice of rows (``sampling.py``) and the detector
(``detector.py``)."""

from pagedllm.watermarking.detector import GumbelWatermarkDetector, WatermarkDetection
from pagedllm.watermarking.gumbel import GumbelWatermarker
from pagedllm.watermarking.philox import PhiloxPRF, create_prf

__all__ = ["GumbelWatermarkDetector", "GumbelWatermarker", "PhiloxPRF", "WatermarkDetection", "create_prf"]
