"""Floor 3: the IR the passes rewrite (`graph`), the pass protocol and `Pipeline` (`base`), one file per pass.

Imports `calibration` and `kernels` only; the accuracy gate reaches a pass as a callable in its context.
"""
