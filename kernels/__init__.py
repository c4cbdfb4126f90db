"""Floor 1: number formats, the hardware target table and (later) Triton kernels with torch references.

Imports nothing of Kiln's: every other package may import this one.
"""
