"""`optimize generate` (text from an artifact) and `optimize serve` (an OpenAI-compatible HTTP server over it).

    optimize generate ART "Once upon a time" --max-new-tokens 64
    optimize serve ART --port 8000
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.optimizer.cli.console import log
from kiln.optimizer.cli.options import (
    DEVICE_HELP,
    DRAFT_TOKENS,
    MAX_BATCHED,
    MAX_NEW_TOKENS,
    MAX_NUM_SEQS,
    MAX_QUEUE,
    PORT,
    REPETITION_PENALTY,
    REQUEST_TIMEOUT,
    SEED,
    SLO,
    TEMPERATURE,
    TOP_P,
    TREE_WIDTH,
)


def generate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    prompt: Annotated[list[str], typer.Argument(help="one or more prompts")],
    max_new_tokens: Annotated[int, typer.Option(callback=MAX_NEW_TOKENS, help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(callback=TEMPERATURE, help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(callback=TOP_P, help="nucleus sampling")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    seed: Annotated[int | None, typer.Option(callback=SEED, help="sampling seed")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(callback=REPETITION_PENALTY, help="above 1 discourages repeats, below 1 "
                                                             "encourages them (default: the artifact's "
                                                             "generation_config.json, else 1)")] = None,
    speculative: Annotated[bool, typer.Option(help="speculative decoding: draft tokens, verify them in one "
                                              "target forward (greedy output is plain decoding's)")] = False,
    draft_tokens: Annotated[int, typer.Option(callback=DRAFT_TOKENS, help="speculative: tokens drafted per target forward")] = 4,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto (the artifact's draft head or MTP layer, "
                                       "else prompt-lookup), head, prompt-lookup")] = "auto",
    tree_width: Annotated[int | None, typer.Option(callback=TREE_WIDTH, help="speculative, greedy, head: candidates per depth verified "
                                                   "as a tree (default: the artifact's; 1: a chain)")] = None,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the decode step first (pays on long "
                                          "generations: compiling takes minutes; CUDA graphs on a GPU)")] = False,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
) -> None:
    """Generate text from an artifact with the slim runtime."""
    from kiln import runtime  # lazy: loading an artifact imports torch, which --help never needs

    engine = runtime.load(artifact, device=device)
    if compile:
        log("compiling the decode step (torch.compile) ...")
        engine.compile_decode(mode="reduce-overhead" if engine.device.type == "cuda" else None)
    drafter = engine.drafter(draft, tree_width=tree_width) if speculative else None
    for p, g in zip(prompt, engine.generate(prompt, max_new_tokens, temperature, top_p, stop, seed,
                                            repetition_penalty, speculative, draft_tokens, drafter), strict=True):
        print(p + g.text)
    if speculative:
        stats = engine.last_speculative
        log(f"speculative ({draft}): tau {stats.tau:.3f} tokens per target call over {stats.steps} verifications, "
            f"{stats.accepted} of {stats.drafted} drafts accepted")


def serve(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(callback=PORT, help="port to listen on (0: any free port)")] = 8000,
    max_queue: Annotated[int, typer.Option(callback=MAX_QUEUE, help="requests waiting for a slot; beyond, 429")] = 256,
    max_num_seqs: Annotated[int, typer.Option(callback=MAX_NUM_SEQS, help="requests decoding together")] = 32,
    max_num_batched_tokens: Annotated[int, typer.Option(callback=MAX_BATCHED, help="tokens one step runs")] = 512,
    request_timeout: Annotated[float | None, typer.Option(callback=REQUEST_TIMEOUT, help="abort a request after SEC seconds (504)")] = None,
    prefix_caching: Annotated[bool, typer.Option(help="reuse the KV blocks of shared prompt prefixes")] = True,
    served_model_name: Annotated[str | None, typer.Option(help="model id (default: the directory name)")] = None,
    compile: Annotated[str, typer.Option("--compile", help="torch.compile the decode step: "
                                         "background (answer eagerly while it compiles), before (minutes of "
                                         "start-up), off; auto: background on the CPU, off on a GPU")] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    ttft_slo: Annotated[float | None, typer.Option(callback=SLO, help="SLO: seconds to the first token; "
                                                   "/metrics counts the requests that met it (kiln_slo_*)")] = None,
    tpot_slo: Annotated[float | None, typer.Option(callback=SLO, help="SLO: seconds per output token after the "
                                                   "first (kiln_slo_*)")] = None,
    speculative: Annotated[bool, typer.Option(help="speculative decoding in the running batch: each step drafts "
                                              "for every decoding request and verifies in one target forward "
                                              "(greedy output unchanged; /metrics kiln_spec_decode_*)")] = False,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto, head, prompt-lookup")] = "auto",
    draft_tokens: Annotated[int, typer.Option(callback=DRAFT_TOKENS, help="speculative: tokens drafted per step")] = 4,
    tree_width: Annotated[int | None, typer.Option(callback=TREE_WIDTH, help="speculative, head: candidates per "
                                                   "depth verified as a tree (default: the artifact's; 1: a chain)")] = None,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (continuous batching); SIGTERM drains, then exits 0."""
    # lazy: imports torch and fastapi, which --help never needs
    from kiln.runtime.server import serve as run_server
    from kiln.runtime.serving_state import ServerConfig

    run_server(artifact, ServerConfig(host, port, max_queue, max_num_seqs, max_num_batched_tokens, request_timeout,
                                      prefix_caching, served_model_name, compile_decode=compile, device=device,
                                      ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                                      speculative=draft if speculative else None, draft_tokens=draft_tokens,
                                      tree_width=tree_width))
