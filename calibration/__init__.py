"""Floor 2: calibration and evaluation data, observers, GPTQ/AWQ-style algorithms, sensitivity.

    data          the fixed text protocol (calibration.txt for calibration, evaluation.txt for measuring) and
                  length-bucketed batching
    metrics       the KL formula and relative error every figure is made of
    quantize      one weight -> its stored tensors by rtn / mse / gptq; activation scales and quantizers
    grids         each weight format as "scales per block + a value grid", bit-exact with kernels/
    observers     Hessians, |x| means, maxima and samples of a linear's inputs, batch by batch
    scale_search  MSE-optimal scales per block / channel (NVFP4 "4 over 6", MXFP4 exponents, FP8)
    gptq          GPTQ on the FP8 / E2M1 grids: damping, act-order, static or dynamic block scales
    awq           activation-aware per-channel scales (the pass folds them into norms / linears)
    tuning        end-to-end tuning of grid points with straight-through rounding (KL to the source)
    sensitivity   per-group sensitivity tables and the budgeted format assignment

Imports only `kernels`. The activations come from `PassContext.runner` (optimizer.measure.runner), which runs
the runtime's own modules block by block, so nothing here needs the runtime.
"""
