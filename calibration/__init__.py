"""Floor 2: calibration and evaluation data, observers, GPTQ/AWQ-style algorithms, sensitivity.

Imports only `kernels`.
"""
