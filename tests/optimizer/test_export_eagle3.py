"""`optimize export --format eagle3`: an EAGLE-3 draft head in the layout of ModelOpt's speculative export
(names, shapes, config), whose numerics are those vLLM's Eagle3LlamaForCausalLM runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.optimizer.export import export
from kiln.optimizer.recipes import Recipe
from kiln.passes.draft_head import DraftHead

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 8, 64, 128, 4, 2, 16


def tiny_llama(path, generated_checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((generated_checkpoint / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=vocab,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (generated_checkpoint / name).is_file():
            shutil.copy(generated_checkpoint / name, path / name)
    return path


@pytest.fixture(scope="module")
def eagle3_artifact(tmp_path_factory, generated_checkpoint):
    from kiln.optimizer.build import build

    root = tmp_path_factory.mktemp("eagle3")
    ckpt = tiny_llama(root / "llama", generated_checkpoint)
    text = root / "text.txt"
    text.write_text("\n\n".join(f"Once upon a time there was a cat number {i}. It sat on mat {i % 7} and was "
                                f"happy with the {i % 5} dogs." for i in range(80)))
    recipe = Recipe("eagle3", (DraftHead(architecture="eagle3", train_steps=3, generated=4, generated_tokens=8,
                                         min_tau=1.0),))
    art = build(ckpt, "hopper", recipe, root / "art", eval_data=text, calib_data=text, paragraphs=20,
                force=True).path
    return ckpt, art


DRAFT_VOCAB = 48


@pytest.fixture(scope="module")
def eagle3_vocab_artifact(tmp_path_factory, eagle3_artifact):
    """The same target with an EAGLE-3 head over a draft vocabulary of DRAFT_VOCAB tokens."""
    from kiln.optimizer.build import build

    ckpt, _ = eagle3_artifact
    root = tmp_path_factory.mktemp("eagle3_vocab")
    text = root / "text.txt"
    text.write_text("\n\n".join(f"Once upon a time there was a cat number {i}. It sat on mat {i % 7} and was "
                                f"happy with the {i % 5} dogs." for i in range(80)))
    recipe = Recipe("eagle3", (DraftHead(architecture="eagle3", train_steps=3, generated=4, generated_tokens=8,
                                         min_tau=1.0, draft_vocab=DRAFT_VOCAB),))
    art = build(ckpt, "hopper", recipe, root / "art", eval_data=text, calib_data=text, paragraphs=20,
                force=True).path
    return ckpt, art


def test_eagle3_export_matches_modelopts_layout(eagle3_artifact, tmp_path):
    mtsp = pytest.importorskip("modelopt.torch.speculative", reason="nvidia-modelopt (the anchors extra)")
    import copy

    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import LlamaForCausalLM

    ckpt, art = eagle3_artifact
    ours = export(art, "eagle3", tmp_path / "ours")
    model = LlamaForCausalLM.from_pretrained(ckpt).eval()
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update(intermediate_size=INTER, num_attention_heads=HEADS,
                                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                            draft_vocab_size=model.config.vocab_size)
    cfg.update(eagle_decoder_type="llama", eagle_use_torch_compile=False)
    mtsp.convert(model, [("eagle", cfg)])
    export_speculative_decoding(model, export_dir=str(tmp_path / "theirs"))
    a, b = load_file(ours / "model.safetensors"), load_file(tmp_path / "theirs" / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in a.items()} == {n: tuple(t.shape) for n, t in b.items()}
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])  # both: the target's, full vocabulary
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (ours, tmp_path / "theirs"))
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "eagle_config"):
        assert ca[key] == cb[key], key
    assert ca["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cb["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert ca["rope_theta"] == 10000.0 and ca["rope_scaling"] is None  # the target's rope, not a YaRN default


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta, dim):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = positions[:, None].float() * inv
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


@pytest.mark.parametrize("which", ["whole vocabulary", "draft vocabulary"])
def test_exported_head_run_as_vllm_does_gives_the_runtimes_draft(which, request, tmp_path):
    """vLLM's Eagle3 forward, written out from the exported files and transformers' target, against Kiln's
    runtime head on the same prompt: the same draft logits (with a draft vocabulary, scattered to their target
    ids through d2t and -inf elsewhere, as vLLM's compute_logits)."""
    from transformers import LlamaForCausalLM

    from kiln import runtime

    fixture = "eagle3_artifact" if which == "whole vocabulary" else "eagle3_vocab_artifact"
    ckpt, art = request.getfixturevalue(fixture)
    out = export(art, "eagle3", tmp_path / "e")
    w, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    target = LlamaForCausalLM.from_pretrained(ckpt).eval()
    tokens = torch.tensor([[1, 17, 42, 9, 33, 7, 101, 5]])
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
        # vLLM's ids count before the layer: hidden_states[j] is the output of layer j - 1
        aux = torch.cat([hs[j] for j in config["eagle_aux_hidden_state_layer_ids"]], -1)[0, :-1]
        h = aux @ w["fc.weight"].T
        emb = target.model.embed_tokens(tokens)[0, 1:]
        x = torch.cat([_rms(emb, w["layers.0.input_layernorm.weight"]), _rms(h, w["layers.0.hidden_norm.weight"])], -1)
        T, p = x.shape[0], torch.arange(x.shape[0])
        q = _rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM), p, config["rope_theta"], HEAD_DIM)
        k = _rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM), p, config["rope_theta"],
                  HEAD_DIM)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        h = h + att.transpose(0, 1).reshape(T, -1) @ w["layers.0.self_attn.o_proj.weight"].T
        m = _rms(h, w["layers.0.post_attention_layernorm.weight"])
        mlp = (F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T))
        h = h + mlp @ w["layers.0.mlp.down_proj.weight"].T
        want = _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
        if "d2t" in w:
            targets = torch.arange(config["draft_vocab_size"]) + w["d2t"]
            full = want.new_full((want.shape[0], config["vocab_size"]), float("-inf"))
            full[:, targets] = want
            want = full
        engine = runtime.load(art)
        module = engine.draft_module()
        positions = torch.arange(tokens.shape[1])[None]
        _, collected = engine.model.features(tokens, positions, collect=module.aux_layers)
        got = module.logits(module(module.project(collected[:, :-1]), tokens[:, 1:], positions[:, :-1]))[0]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-4), (got[finite] - want[finite]).abs().max()


def test_a_draft_vocabulary_is_the_most_frequent_tokens_and_the_targets_own_rows(eagle3_vocab_artifact, tmp_path):
    """d2t names DRAFT_VOCAB distinct target ids ascending (t2d marks the same ones); the head's lm_head is
    the target's lm_head at those rows exactly; the config says the draft vocabulary's size; speculative
    decoding over it is still exactly plain greedy decoding."""
    from transformers import LlamaForCausalLM

    from kiln import runtime

    ckpt, art = eagle3_vocab_artifact
    out = export(art, "eagle3", tmp_path / "e")
    w, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] > DRAFT_VOCAB
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (DRAFT_VOCAB,)
    ids = torch.arange(DRAFT_VOCAB) + w["d2t"]
    assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < config["vocab_size"]
    assert torch.equal(w["t2d"].nonzero()[:, 0], ids)
    target = LlamaForCausalLM.from_pretrained(ckpt).eval()
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight.detach()[ids].to(w["lm_head.weight"].dtype))
    engine = runtime.load(art)
    record = next(r for r in engine.manifest["passes"] if r["name"] == "draft-head")
    assert record["result"]["metrics"]["draft_vocab"] == DRAFT_VOCAB
    assert 0.5 < record["result"]["metrics"]["draft_vocab_coverage"] <= 1.0
    prompts = [[1, 17, 42, 9], [1, 5, 33, 7, 101]]
    plain = engine.generate_ids(prompts, 12)
    for width in (1, 3):
        spec, stats = engine.speculative_ids(prompts, 12, 3, engine.drafter("head", tree_width=width))
        assert spec == plain and stats.steps > 0


def test_only_an_eagle3_head_exports_so(eagle3_artifact, tmp_path, plain_artifact):
    with pytest.raises(KilnError, match="no draft head"):
        export(plain_artifact, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_d2t_outside_the_vocabulary_or_out_of_order_is_refused():
    """The runtime refuses a d2t whose ids leave the vocabulary or repeat (an artifact's tensors may come from
    hostile hands; the structure check has already held its dtype and shape)."""
    from types import SimpleNamespace

    from kiln.runtime.draft import draft_vocab_ids
    from kiln.runtime.spec import ExtraModuleSpec

    module = ExtraModuleSpec("eagle3", "draft_head", None, {}, (), draft_vocab="draft_head.d2t")

    def ids(offsets):
        return draft_vocab_ids(module, SimpleNamespace(tensors={"draft_head.d2t": torch.tensor(offsets)}), 10)

    assert ids([0, 2, 5]).tolist() == [0, 3, 7]
    with pytest.raises(KilnError, match="target id 10, outside the vocabulary of 10"):
        ids([0, 0, 8])
    with pytest.raises(KilnError, match="target id -1"):
        ids([-1, 0])
    with pytest.raises(KilnError, match="strictly increasing"):
        ids([3, 1])
