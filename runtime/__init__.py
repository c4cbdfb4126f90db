"""Floor 2: the slim runtime. Loads an engine artifact and executes it; imports only `kernels`.

    from kiln import runtime
    engine = runtime.load("artifacts/s260k-fp8")
    print(engine.generate(["Once upon a time"], max_new_tokens=64)[0].text)

`Engine`, `Generation` and `load` are imported on first use, so reading a manifest (runtime.artifact) does
not pay for torch.
"""

__all__ = ["Engine", "Generation", "load"]


def __getattr__(name: str):
    if name in __all__:
        from kiln.runtime import engine  # lazy: reading a manifest (runtime.artifact) must not pay for torch

        return getattr(engine, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
