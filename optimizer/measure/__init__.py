"""What runs a model through the runtime to measure it, or to train on it, for the passes and the gate.

    gate                 AccuracyGate: perplexity, KL and top-1 of a candidate against its baseline, floors
    generation_check     long greedy generations of both models: agreement, distinct 4-grams, first divergence
    runner               RuntimeRunner: the `ctx.runner` the passes calibrate, probe and train through
    calibration_session  per-linear inputs block by block, and the distillation loss of tuning
    kv_capture           K/V cache activations on the calibration tokens
    logit_kl             measured sensitivity: KL of the final logits per probe, and its heatmap
    fisher               estimated sensitivity: every candidate's KL from one gradient pass
    draft_training       distilling a draft head or MTP layer from the target itself
"""
