"""Floor 2: the slim runtime. Loads an engine artifact and executes it; imports only `kernels`.

    import runtime
    engine = runtime.load("artifacts/s260k-fp8")
    print(engine.generate(["Once upon a time"], max_new_tokens=64)[0].text)
"""

from runtime.engine import Engine, Generation, load

__all__ = ["Engine", "Generation", "load"]
